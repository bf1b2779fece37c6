"""The router's NATS edges: policy and membership consumers, KV events, dumps, status.

Each turns bus messages into scheduler commands and scheduler answers into bus messages; none holds
routing state. nats exceptions are caught here, at the edge, and logged with their ids: a router
keeps serving with its last good state while NATS is away.

- :class:`PolicyConsumer`: one ordered consumer for all served models (a multi-subject filter of
  ``rudder.policy.<key>.*``), starting with the last message per subject, then live. The
  revision is the message's stream sequence. Each event goes through
  :class:`~router.commands.ApplyPolicy` with its headers, so its signature is checked (replayed
  or live, re-read or not) in the policy state; the answer is published as an :class:`ApplyAck`
  on ``rudder.acks.<router_id>`` (the ``RUDDER_ACKS`` stream, from a queue that retries, so
  neither a lost ACK nor a slow stream holds up the policy path) and a status write is
  requested (coalesced, off the path).
  A reported gap re-reads the document's head with a direct get and applies it if newer.
- :class:`MembershipConsumer`: the same, one consumer on ``rudder.workers.<key>.*``; the first
  discovery is complete when the replay has been applied (``num_pending`` reaches 0, or nothing was there).
- :class:`KvEventSubscriber`: core subscription on ``rudder.kv.<key>.*``; gaps and new workers
  lead to a full dump over ``rudder.kvdump.<instance_id>`` (:class:`KvDumper`).
- :class:`StatusPublisher`: the router's :class:`RouterStatus` in ``RUDDER_ROUTERS``.

Hostile but well-formed input is dropped here, before it reaches the scheduler (DESIGN §9): a
payload whose ids differ from its subject's, a worker URL outside ``RUDDER_WORKER_URL_ALLOW``,
anything past the size bounds (refused at decode). Each drop is logged once per source and counted
(:class:`~controlplane.protocol.guard.Drops`). A policy stream whose sequence went backwards (it
was deleted and created again) is noticed by :meth:`PolicyConsumer.check_stream`, which re-syncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue

from controlplane.protocol.errors import InvalidRequest, RudderError, SubjectMismatch, ValidationFailed
from controlplane.protocol.events import (
    AckStatus,
    ApplyAck,
    MembershipEvent,
    PolicyResync,
    RouterRole,
    RouterStatus,
    WorkerCalibration,
    check_kv_dump,
    check_kv_subject,
    check_membership_subject,
    decode_kv_dump,
    decode_kv_event,
    decode_membership_event,
    utcnow,
)
from controlplane.protocol.guard import Drops, UrlAllowList
from controlplane.protocol.policy import CacheInput, Number, PolicyKind
from controlplane.protocol.subjects import (
    HDR_MSG_ID,
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
from router.commands import (
    ApplyKvEvents,
    ApplyMembership,
    ApplyPolicy,
    DiscoveryComplete,
    LoadKvDump,
    ResyncPolicy,
    Tick,
)
from router.discovery import Change
from router.policy_state import ApplyResult, Outcome, stream_went_backwards
from router.scheduler import Scheduler

log = logging.getLogger(__name__)


def _reason(exc: InvalidRequest) -> str:
    return "subject_mismatch" if isinstance(exc, SubjectMismatch) else "malformed"

_NATS_ERRORS = (nats.errors.Error, asyncio.TimeoutError, OSError)


# Ordered consumers notice a consumer lost with a node after two missed idle heartbeats: short
# heartbeats bound how long a router misses policy events after a JetStream node dies.
IDLE_HEARTBEAT_S = 0.5


async def ordered_consumer(js: JetStreamContext, stream: str, filters: list[str],
                           cb: Callable[[Msg], Awaitable[None]]) -> Any:
    """An ordered push consumer on ``stream`` over every subject in ``filters``, starting with the
    last message per subject (the current state), then live."""
    config = ConsumerConfig(filter_subjects=filters) if len(filters) > 1 else None
    return await js.subscribe(
        filters[0] if len(filters) == 1 else "", stream=stream, cb=cb, ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, idle_heartbeat=IDLE_HEARTBEAT_S, config=config,
    )


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
        self._dirty = asyncio.Event()
        self.resync: PolicyResync | None = None  # set by the policy consumer when it re-syncs
        self._calibration: list[WorkerCalibration] = []

    def status(self) -> RouterStatus:
        return RouterStatus(
            **self._static, applied=self.scheduler.view.applied, heartbeat_at=utcnow(),
            policy_resync=self.resync,
            calibration=self._calibration,
        )

    async def put(self) -> None:
        async with self._lock:
            self._dirty.clear()
            with contextlib.suppress(RudderError):  # stopping: keep the last one
                self._calibration = await self.scheduler.inspect(lambda s: s.calibration_status())
            try:
                await self.kv.put(router_status_key(self.router_id), self.status().to_bytes())
            except _NATS_ERRORS as exc:
                log.warning("router status not written: %s", type(exc).__name__)

    def request(self) -> None:
        """Ask for a status write soon, without waiting for it: a burst of applied events costs
        one write, and a bucket electing a leader never holds up the policy consumer."""
        self._dirty.set()

    async def run(self) -> None:
        """The writer behind :meth:`request` (a task of the router's lifespan)."""
        while True:
            await self._dirty.wait()
            await self.put()

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
        on_resync: Callable[[], None] | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.scheduler = scheduler
        self.status = status
        self.router_id = router_id
        self.models = models
        self.on_result = on_result
        self.on_resync = on_resync
        self._subs: list[Any] = []
        self._stream_created: datetime | None = None
        self._resync_lock = asyncio.Lock()
        self.resyncs = 0
        self.acks = AckPublisher(js, router_id)
        # Set once the replay of every document's head is through (readiness, DESIGN §5).
        self.loaded = asyncio.Event()

    async def start(self) -> None:
        info = await self._stream_info()
        if info is not None:
            self._stream_created = info.created
        await self._subscribe()

    async def _stream_info(self) -> Any:
        try:
            return await self.js.stream_info(STREAM_POLICY)
        except (*_NATS_ERRORS, nats.js.errors.Error) as exc:
            log.debug("%s info not read: %s", STREAM_POLICY, type(exc).__name__)
            return None

    async def check_stream(self) -> bool:
        """Re-sync when ``RUDDER_POLICY`` went backwards: it was created again (its creation time
        changed) or its last sequence is below a revision this router has seen. Otherwise the
        router would skip every later revision as "already seen" (and its ordered consumers would
        wait past the old sequence). Returns whether it re-synced."""
        info = await self._stream_info()
        if info is None:
            return False
        if not self._subs:  # a re-sync whose subscribe failed (NATS away): subscribe again
            async with self._resync_lock:
                if not self._subs:
                    await self._subscribe()
        seen = await self.scheduler.inspect(lambda s: s.policy.max_seen())
        reason = stream_went_backwards(
            known_created=self._stream_created, created=info.created,
            last_seq=info.state.last_seq, max_seen=seen,
        )
        if self._stream_created is None:
            self._stream_created = info.created
        if reason is None:
            return False
        await self.resync(reason, created=info.created)
        return True

    async def resync(self, reason: str, *, created: datetime | None) -> None:
        """Forget the applied revisions (keeping the effective values) and read every document
        again from the last message per subject; report it in the status, the log and a metric."""
        async with self._resync_lock:
            await unsubscribe_all(self._subs)
            forgotten = await self.scheduler.call(ResyncPolicy(reason))
            self._stream_created = created
            self.resyncs += 1
            log.warning(
                "policy stream %s went backwards (%s): re-syncing; forgot applied revisions %s",
                STREAM_POLICY, reason, forgotten or "none",
            )
            self.status.resync = PolicyResync(at=utcnow(), reason=reason, count=self.resyncs)
            if self.on_resync is not None:
                self.on_resync()
            await self._subscribe()
            await self.status.put()

    async def _subscribe(self) -> None:
        """One ordered consumer for every served model (a multi-subject filter): a router's
        consumers do not grow with its models (JetStream limits consumers per stream)."""
        sub = await ordered_consumer(
            self.js, STREAM_POLICY, [policy_filter(m) for m in self.models], self._on_msg)
        self._subs.append(sub)
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq):
                self.loaded.set()  # no document yet: the startup values are the policy
        except (*_NATS_ERRORS, nats.js.errors.Error):
            pass

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
        await self._apply(model, kind, revision, msg.data, msg.headers)
        with contextlib.suppress(ValueError, AttributeError):
            if msg.metadata.num_pending == 0:
                self.loaded.set()  # the head of every document is applied (or NACKed)

    async def _apply(
        self, model: str, kind: PolicyKind, revision: int, payload: bytes, headers: dict[str, str] | None,
    ) -> None:
        try:
            applied = await self.scheduler.call(ApplyPolicy(model, kind, revision, payload, headers))
        except RudderError as exc:
            log.warning("policy %s|%s revision %d not applied: %s", model, kind.value, revision, exc)
            return
        result = applied.result
        if result.outcome is Outcome.SKIP:
            return
        await self._ack(result)
        if self.on_result is not None:
            self.on_result(result)
        self.status.request()
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
            await self._apply(model, kind, msg.seq, msg.data, msg.headers)

    async def _ack(self, result: ApplyResult) -> None:
        ack = ApplyAck(
            router_id=self.router_id, model=result.model, kind=result.kind,
            revision=result.revision,
            status=AckStatus.ACK if result.outcome is Outcome.ACK else AckStatus.NACK,
            detail=result.detail, event_id=result.event_id, effective=result.effective,
            at=utcnow(),
        )
        self.acks.put(ack)


class AckPublisher:
    """ACK/NACKs to the ``RUDDER_ACKS`` stream, in order, from a queue: the policy consumer never
    waits for JetStream (a stream electing a leader takes seconds), and an ACK whose publish
    failed is retried until stored, so none is lost while a router runs. Each ACK has its own
    ``Nats-Msg-Id``, so a retry whose first attempt was stored after all is not stored twice."""

    def __init__(self, js: JetStreamContext, router_id: str, *, limit: int = 10_000) -> None:
        self.js = js
        self.router_id = router_id
        self._queue: asyncio.Queue[tuple[str, ApplyAck]] = asyncio.Queue(maxsize=limit)
        self.dropped = 0

    def put(self, ack: ApplyAck) -> None:
        if self._queue.full():  # a bus away for a very long time: keep the newest
            self._queue.get_nowait()
            self.dropped += 1
            log.error("ACK queue full: dropped the oldest ACK (%d so far)", self.dropped)
        self._queue.put_nowait((f"ack-{self.router_id}-{uuid.uuid4().hex}", ack))

    async def run(self) -> None:
        while True:
            msg_id, ack = await self._queue.get()
            delay = 0.1
            while True:
                try:
                    await self.js.publish(acks_subject(self.router_id), ack.to_bytes(),
                                          headers={HDR_MSG_ID: msg_id})
                    break
                except (*_NATS_ERRORS, nats.js.errors.Error) as exc:
                    log.warning("ACK for revision %d not stored yet (%s); retrying", ack.revision,
                                type(exc).__name__)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Give queued ACKs a moment to be stored (graceful stop)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._queue.empty() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


class KvDumper:
    def __init__(
        self, nc: NATS, scheduler: Scheduler, tasks: TaskSet, *, timeout_s: float, drops: Drops,
    ) -> None:
        self.nc = nc
        self.scheduler = scheduler
        self.tasks = tasks
        self.timeout_s = timeout_s
        self.drops = drops
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
            check_kv_dump(instance_id, reply)
        except InvalidRequest as exc:
            reply = None
            self.drops.drop("kvdump", _reason(exc), kvdump_subject(instance_id), exc.message)
        except _NATS_ERRORS as exc:
            log.info("no dump from worker %s: %s", instance_id, type(exc).__name__)
        finally:
            self._inflight.discard(instance_id)
        self.scheduler.send(LoadKvDump(instance_id, reply))


class MembershipConsumer:
    def __init__(
        self, js: JetStreamContext, scheduler: Scheduler, dumper: KvDumper | None, *,
        models: list[str], allow: UrlAllowList, drops: Drops, ready_timeout_s: float = 3.0,
    ) -> None:
        self.js = js
        self.scheduler = scheduler
        self.dumper = dumper
        self.models = models
        self.allow = allow
        self.drops = drops
        self.ready_timeout_s = ready_timeout_s
        self._subs: list[Any] = []
        self._complete = asyncio.Event()

    async def start(self) -> None:
        sub = await ordered_consumer(self.js, STREAM_MEMBERSHIP,
                                     [membership_filter(m) for m in self.models], self._on_msg)
        self._subs.append(sub)
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq):
                self._declare()  # nothing to replay: discovery is complete (and empty)
        except (*_NATS_ERRORS, nats.js.errors.Error):
            pass

    async def wait_complete(self) -> None:
        """Wait for the first discovery; give up waiting (and declare it) after the timeout."""
        try:
            await asyncio.wait_for(self._complete.wait(), self.ready_timeout_s)
        except TimeoutError:
            log.warning("membership replay not confirmed in %.1fs; serving anyway", self.ready_timeout_s)
            self._declare()


    def _declare(self) -> None:
        if not self._complete.is_set():
            self._complete.set()
            self.scheduler.send(DiscoveryComplete())

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)

    def _accept(self, msg: Msg) -> MembershipEvent | None:
        """The event, if it speaks for its own subject and names an allowed URL; else None
        (dropped and reported)."""
        try:
            event = decode_membership_event(msg.data)
            check_membership_subject(msg.subject, event)
        except InvalidRequest as exc:
            self.drops.drop("membership", _reason(exc), msg.subject, exc.message)
            return None
        try:
            self.allow.check(event.worker.url)
        except ValidationFailed as exc:
            self.drops.drop(
                "membership", "url_not_allowed", msg.subject,
                f"worker {event.worker.instance_id}: {exc.message}",
            )
            return None
        return event

    async def _on_msg(self, msg: Msg) -> None:
        event = self._accept(msg)
        if event is not None:
            try:
                stored_at: datetime | None = msg.metadata.timestamp
            except (ValueError, AttributeError, IndexError):
                stored_at = None
            try:
                change = await self.scheduler.call(ApplyMembership(event, stored_at))
            except RudderError:
                return
            if change is Change.JOINED and self.dumper is not None:
                self.dumper.request(event.worker.instance_id)
        try:
            if msg.metadata.num_pending == 0:
                self._declare()  # the replay of the last state of every worker is applied
        except (ValueError, AttributeError):
            pass


class KvEventSubscriber:
    def __init__(
        self, nc: NATS, scheduler: Scheduler, dumper: KvDumper, *, models: list[str], drops: Drops,
    ) -> None:
        self.nc = nc
        self.scheduler = scheduler
        self.dumper = dumper
        self.models = models
        self.drops = drops
        self._subs: list[Any] = []
        self.received = 0

    async def start(self) -> None:
        for model in self.models:
            self._subs.append(await self.nc.subscribe(
                kv_filter(model), cb=functools.partial(self._on_msg, model)
            ))

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)

    async def _on_msg(self, model: str, msg: Msg) -> None:
        try:
            event = decode_kv_event(msg.data)
            check_kv_subject(msg.subject, model, event)
        except InvalidRequest as exc:
            self.drops.drop("kv", _reason(exc), msg.subject, exc.message)
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
