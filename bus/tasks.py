"""The one owner of background tasks, in every Rudder process (STYLE rule 8).

Every long-lived task of a process belongs to one :class:`Tasks` owned by its lifespan (the
control plane, a router, a worker agent, the audit store's writer). A task that dies is logged
with its traceback where it died, and the owner's ``on_death`` hook hears of it (a worker agent
turns that into "failed"); it never vanishes. :meth:`Tasks.close` cancels what is left and waits
for it, so a stop leaves nothing running.

It lives in ``bus/`` because every process is a bus client and imports ``bus``; it has nothing of
NATS in it. :func:`every` is the one periodic loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from controlplane.protocol.errors import RudderError

log = logging.getLogger(__name__)


class Tasks:
    """Background tasks owned by one lifespan."""

    def __init__(self, owner: str = "", *, on_death: Callable[[asyncio.Task[Any], BaseException], None] | None = None,
                 ) -> None:
        self.owner = owner
        self.on_death = on_death
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closing = False

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self.closing:
            return
        exc = task.exception()
        if exc is None:
            return
        log.error("%stask %s died", f"{self.owner}: " if self.owner else "", task.get_name(), exc_info=exc)
        if self.on_death is not None:
            self.on_death(task, exc)

    def names(self) -> list[str]:
        return sorted(t.get_name() for t in self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel(self, name: str) -> None:
        """Cancel the tasks called ``name`` and wait for them to end."""
        await _cancel([t for t in self._tasks if t.get_name() == name])

    async def close(self, *, keep: Callable[[asyncio.Task[Any]], bool] | None = None) -> None:
        """Cancel every task (but those ``keep`` lets finish on their own) and wait for all."""
        self.closing = True
        tasks = list(self._tasks)
        await _cancel([t for t in tasks if keep is None or not keep(t)])
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()


async def _cancel(tasks: list[asyncio.Task[Any]], *, again_s: float = 1.0) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again every ``again_s`` a task that is still
    running: on Python 3.11 ``asyncio.wait_for`` (under nats-py's requests) can swallow a cancel
    that arrives as its answer lands, and a loop that swallowed one would keep the stop waiting."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_s)
    await asyncio.gather(*tasks, return_exceptions=True)


def _cancelled() -> bool:
    """The current task was asked to stop (a cancel a callee swallowed still counts)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def every(interval: float, fn: Callable[[], Awaitable[Any]], what: str) -> None:
    """Call ``fn`` every ``interval`` seconds until cancelled; a failure is logged, not fatal
    (a RudderError at debug level: expected while a dependency is away)."""
    while True:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except RudderError as exc:
            log.debug("%s: %s", what, exc.message)
        except Exception:
            log.exception("%s failed", what)
        if _cancelled():
            raise asyncio.CancelledError
        await asyncio.sleep(interval)
