"""What the control plane knows of the fleet: live routers (``RUDDER_ROUTERS``), live workers
(``RUDDER_MEMBERSHIP``). Router ACK/NACKs are recorded by ``controlplane.acks``.

Background watchers keep an in-memory view so the write path's capability check costs no I/O.
A router is live while its status is younger than 3 heartbeats; a worker while its last
membership event is not ``leave`` and younger than the worker TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from controlplane.protocol.errors import InvalidRequest
from controlplane.protocol.events import (
    MembershipEvent,
    MembershipOp,
    RouterStatus,
    decode_membership_event,
    decode_router_status,
)
from controlplane.protocol.policy import CacheInput, PolicyKind, missing_cache_inputs
from controlplane.protocol.subjects import (
    BUCKET_ROUTERS,
    MEMBERSHIP_SUBJECTS,
)

log = logging.getLogger(__name__)

async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel background tasks and wait for them to end (their errors were logged where they ran)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    tasks.clear()


class FleetView:
    def __init__(self, nc: NATS, *, worker_ttl_s: float, router_heartbeat_s: float,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.worker_ttl = timedelta(seconds=worker_ttl_s)
        self.router_ttl = timedelta(seconds=3 * router_heartbeat_s)
        self.clock = clock
        self._routers: dict[str, RouterStatus] = {}
        self._workers: dict[int, MembershipEvent] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._watch_routers(), name="fleet-routers"))
        self._subs.append(await self.js.subscribe(
            MEMBERSHIP_SUBJECTS, ordered_consumer=True, cb=self._on_membership,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ))

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await cancel_all(self._tasks)
        self._subs.clear()

    async def _watch_routers(self) -> None:
        while True:
            try:
                kv = await self.js.key_value(BUCKET_ROUTERS)
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is None:
                        continue
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        self._routers.pop(entry.key, None)
                        continue
                    try:
                        self._routers[entry.key] = decode_router_status(entry.value)
                    except InvalidRequest as exc:
                        log.warning("malformed router status %s: %s", entry.key, exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS restart, bucket not created yet: retry
                log.debug("router watch restarting: %s", exc)
                await asyncio.sleep(1.0)

    async def _on_membership(self, msg: Msg) -> None:
        try:
            event = decode_membership_event(msg.data)
        except InvalidRequest as exc:
            log.warning("malformed membership event on %s: %s", msg.subject, exc)
            return
        self._workers[event.worker.instance_id] = event

    # ---- queries (no I/O) ----------------------------------------------------------------

    def live_routers(self, model: str | None = None) -> list[RouterStatus]:
        now = self.clock()
        return sorted(
            (
                r for r in self._routers.values()
                if now - r.heartbeat_at <= self.router_ttl and (model is None or model in r.models)
            ),
            key=lambda r: r.router_id,
        )

    def live_workers(self, model: str | None = None) -> list[MembershipEvent]:
        now = self.clock()
        return sorted(
            (
                w for w in self._workers.values()
                if w.op is not MembershipOp.LEAVE and now - w.at <= self.worker_ttl
                and (model is None or w.worker.model == model)
            ),
            key=lambda w: (w.worker.model, w.worker.instance_id),
        )

    def serves(self, model: str) -> bool:
        return bool(self.live_routers(model) or self.live_workers(model))

    def capability_violations(self, model: str, kind: PolicyKind,
                              document: dict[str, Any]) -> dict[str, list[str]]:
        """``{router_id: [weights it cannot feed]}`` among live routers serving ``model``."""
        out: dict[str, list[str]] = {}
        for router in self.live_routers(model):
            missing = missing_cache_inputs(kind, document, frozenset(CacheInput(c) for c in router.cache_inputs))
            if missing:
                out[router.router_id] = missing
        return out
