"""The router's NATS edges: policy and membership consumers, KV events, dumps, status.

Each turns bus messages into scheduler commands and scheduler answers into bus messages; none holds
routing state. nats exceptions are caught here, at the edge, and logged with their ids: a router
keeps serving with its last good state while NATS is away.

- :class:`PolicyConsumer`: one ordered consumer per served model on ``rudder.policy.<key>.*``,
  starting with the last message per subject, then live. The revision is the message's stream
  sequence. Each event goes through :class:`~router.scheduler.ApplyPolicy`; the answer is
  published as an :class:`ApplyAck` on ``rudder.acks.<router_id>`` and the status is rewritten.
  A reported gap re-reads the document's head with a direct get and applies it if newer.
- :class:`MembershipConsumer`: the same on ``rudder.workers.<key>.*``; the first discovery is
  complete when the replay has been applied (``num_pending`` reaches 0, or nothing was there).
- :class:`KvEventSubscriber`: core subscription on ``rudder.kv.<key>.*``; gaps and new workers
  lead to a full dump over ``rudder.kvdump.<instance_id>`` (:class:`KvDumper`).
- :class:`StatusPublisher`: the router's :class:`RouterStatus` in ``RUDDER_ROUTERS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.kv import KeyValue

from controlplane.protocol.errors import InvalidRequest, RudderError
from controlplane.protocol.events import (
    AckStatus,
    ApplyAck,
    RouterRole,
    RouterStatus,
    WorkerCalibration,
    decode_kv_dump,
    decode_kv_event,
    decode_membership_event,
    utcnow,
)
from controlplane.protocol.policy import CacheInput, Number, PolicyKind
from controlplane.protocol.subjects import (
    STREAM_MEMBERSHIP,
    STREAM_POLICY,
    acks_subject,
    kv_filter,
    kvdump_subject,
    membership_filter,
    parse_policy_subject,
    policy_filter,
    policy_subject,
    router_status_key,
)
from router.discovery import Change
from router.policy_state import ApplyResult, Outcome
from router.scheduler import (
    ApplyKvEvents,
    ApplyMembership,
    ApplyPolicy,
    DiscoveryComplete,
    LoadKvDump,
    Scheduler,
    Tick,
)

log = logging.getLogger(__name__)

_NATS_ERRORS = (nats.errors.Error, asyncio.TimeoutError, OSError)


async def unsubscribe_all(subs: list[Any]) -> None:
    """Unsubscribe every subscription (a NATS that is already gone is not an error) and forget them."""
    for sub in subs:
        try:
            await sub.unsubscribe()
        except _NATS_ERRORS:
            pass
    subs.clear()


class TaskSet:
    """Background tasks owned by one lifespan: a task that dies is logged with its traceback."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s died", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def every(interval: float, fn: Callable[[], Awaitable[Any]], what: str) -> None:
    """Call ``fn`` every ``interval`` seconds until cancelled; a failure is logged, not fatal."""
    while True:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except RudderError as exc:
            log.debug("%s: %s", what, exc.message)
        except Exception:
            log.exception("%s failed", what)
        await asyncio.sleep(interval)


# ---------------------------------------------------------------------------------------------


class StatusPublisher:
    def __init__(
        self, kv: KeyValue, scheduler: Scheduler, *, router_id: str, models: list[str],
        role: RouterRole, mode: str, url: str, cache_inputs: frozenset[CacheInput],
        startup: dict[PolicyKind, dict[str, Number | None]], started_at: datetime,
    ) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.router_id = router_id
        self._static: dict[str, Any] = {
            "router_id": router_id, "models": models, "role": role, "mode": mode, "url": url,
            "cache_inputs": sorted(cache_inputs),
            "startup": {k.value: dict(v) for k, v in startup.items()},
            "started_at": started_at,
        }
        self._lock = asyncio.Lock()
        self._calibration: list[WorkerCalibration] = []

    def status(self) -> RouterStatus:
        return RouterStatus(
            **self._static, applied=self.scheduler.view.applied, heartbeat_at=utcnow(),
            calibration=self._calibration,
        )

    async def put(self) -> None:
        async with self._lock:
            with contextlib.suppress(RudderError):  # stopping: keep the last one
                self._calibration = await self.scheduler.inspect(lambda s: s.calibration_status())
            try:
                await self.kv.put(router_status_key(self.router_id), self.status().to_bytes())
            except _NATS_ERRORS as exc:
                log.warning("router status not written: %s", type(exc).__name__)

    async def delete(self) -> None:
        try:
            await self.kv.delete(router_status_key(self.router_id))
        except _NATS_ERRORS as exc:
            log.info("router status not deleted: %s", type(exc).__name__)


class PolicyConsumer:
    def __init__(
        self, nc: NATS, js: JetStreamContext, scheduler: Scheduler, status: StatusPublisher, *,
        router_id: str, models: list[str],
        on_result: Callable[[ApplyResult], None] | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.scheduler = scheduler
        self.status = status
        self.router_id = router_id
        self.models = models
        self.on_result = on_result
        self._subs: list[Any] = []

    async def start(self) -> None:
        for model in self.models:
            sub = await self.js.subscribe(
                policy_filter(model), stream=STREAM_POLICY,
                cb=self._on_msg, ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, idle_heartbeat=2.0,
            )
            self._subs.append(sub)

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            revision = msg.metadata.sequence.stream
            model, kind_name = parse_policy_subject(msg.subject)
            kind = PolicyKind(kind_name)
        except (InvalidRequest, ValueError) as exc:
            log.warning("ignoring message on %s: %s", msg.subject, exc)
            return
        await self._apply(model, kind, revision, msg.data)

    async def _apply(self, model: str, kind: PolicyKind, revision: int, payload: bytes) -> None:
        try:
            applied = await self.scheduler.call(ApplyPolicy(model, kind, revision, payload))
        except RudderError as exc:
            log.warning("policy %s|%s revision %d not applied: %s", model, kind.value, revision, exc)
            return
        result = applied.result
        if result.outcome is Outcome.SKIP:
            return
        await self._ack(result)
        if self.on_result is not None:
            self.on_result(result)
        await self.status.put()
        if result.gap:
            log.warning(
                "policy %s|%s: gap before revision %d; re-reading the head", model, kind.value,
                revision,
            )
            await self._reread(model, kind, revision)

    async def _reread(self, model: str, kind: PolicyKind, revision: int) -> None:
        try:
            msg = await self.js.get_last_msg(STREAM_POLICY, policy_subject(model, kind.value), direct=True)
        except (*_NATS_ERRORS, nats.js.errors.Error) as exc:
            log.warning("head of %s|%s not re-read: %s", model, kind.value, type(exc).__name__)
            return
        if msg.seq is not None and msg.seq > revision and msg.data is not None:
            await self._apply(model, kind, msg.seq, msg.data)

    async def _ack(self, result: ApplyResult) -> None:
        ack = ApplyAck(
            router_id=self.router_id, model=result.model, kind=result.kind,
            revision=result.revision,
            status=AckStatus.ACK if result.outcome is Outcome.ACK else AckStatus.NACK,
            detail=result.detail, event_id=result.event_id, effective=result.effective,
            at=utcnow(),
        )
        try:
            await self.nc.publish(acks_subject(self.router_id), ack.to_bytes())
        except _NATS_ERRORS as exc:
            log.warning("ACK for revision %d not published: %s", result.revision, type(exc).__name__)


class KvDumper:
    def __init__(self, nc: NATS, scheduler: Scheduler, tasks: TaskSet, *, timeout_s: float) -> None:
        self.nc = nc
        self.scheduler = scheduler
        self.tasks = tasks
        self.timeout_s = timeout_s
        self._inflight: set[int] = set()

    def request(self, instance_id: int) -> None:
        if instance_id in self._inflight:
            return
        self._inflight.add(instance_id)
        self.tasks.spawn(self._dump(instance_id), name=f"kvdump-{instance_id}")

    async def _dump(self, instance_id: int) -> None:
        reply = None
        try:
            msg = await self.nc.request(kvdump_subject(instance_id), b"", timeout=self.timeout_s)
            reply = decode_kv_dump(msg.data)
            if reply.instance_id != instance_id:
                log.warning("dump for %s answered by %s", instance_id, reply.instance_id)
                reply = None
        except InvalidRequest as exc:
            log.warning("bad dump from worker %s: %s", instance_id, exc.message)
        except _NATS_ERRORS as exc:
            log.info("no dump from worker %s: %s", instance_id, type(exc).__name__)
        finally:
            self._inflight.discard(instance_id)
        self.scheduler.send(LoadKvDump(instance_id, reply))


class MembershipConsumer:
    def __init__(
        self, js: JetStreamContext, scheduler: Scheduler, dumper: KvDumper | None, *,
        models: list[str], ready_timeout_s: float = 3.0,
    ) -> None:
        self.js = js
        self.scheduler = scheduler
        self.dumper = dumper
        self.models = models
        self.ready_timeout_s = ready_timeout_s
        self._pending_models: set[str] = set(models)
        self._subs: list[Any] = []
        self._complete = asyncio.Event()

    async def start(self) -> None:
        for model in self.models:
            sub = await self.js.subscribe(
                membership_filter(model), stream=STREAM_MEMBERSHIP,
                cb=functools.partial(self._on_msg, model), ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, idle_heartbeat=2.0,
            )
            self._subs.append(sub)
            try:
                info = await sub.consumer_info()
                if info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq):
                    self._model_done(model)
            except (*_NATS_ERRORS, nats.js.errors.Error):
                pass

    async def wait_complete(self) -> None:
        """Wait for the first discovery; give up waiting (and declare it) after the timeout."""
        try:
            await asyncio.wait_for(self._complete.wait(), self.ready_timeout_s)
        except TimeoutError:
            log.warning("membership replay not confirmed in %.1fs; serving anyway", self.ready_timeout_s)
            self._declare()

    def _model_done(self, model: str) -> None:
        self._pending_models.discard(model)
        if not self._pending_models:
            self._declare()

    def _declare(self) -> None:
        if not self._complete.is_set():
            self._complete.set()
            self.scheduler.send(DiscoveryComplete())

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)

    async def _on_msg(self, model: str, msg: Msg) -> None:
        try:
            event = decode_membership_event(msg.data)
        except InvalidRequest as exc:
            log.warning("bad membership event on %s: %s", msg.subject, exc.message)
            event = None
        if event is not None:
            try:
                change = await self.scheduler.call(ApplyMembership(event))
            except RudderError:
                return
            if change is Change.JOINED and self.dumper is not None:
                self.dumper.request(event.worker.instance_id)
        try:
            if msg.metadata.num_pending == 0:
                self._model_done(model)
        except (ValueError, AttributeError):
            pass


class KvEventSubscriber:
    def __init__(self, nc: NATS, scheduler: Scheduler, dumper: KvDumper, *, models: list[str]) -> None:
        self.nc = nc
        self.scheduler = scheduler
        self.dumper = dumper
        self.models = models
        self._subs: list[Any] = []
        self.received = 0

    async def start(self) -> None:
        for model in self.models:
            self._subs.append(await self.nc.subscribe(kv_filter(model), cb=self._on_msg))

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = decode_kv_event(msg.data)
        except InvalidRequest as exc:
            log.warning("bad KV event on %s: %s", msg.subject, exc.message)
            return
        self.received += 1
        try:
            need = await self.scheduler.call(ApplyKvEvents([event]))
        except RudderError:
            return
        for wid in need:
            self.dumper.request(wid)


async def tick(scheduler: Scheduler) -> None:
    gone = await scheduler.call(Tick())
    if gone:
        log.info("workers expired: %s", gone)
