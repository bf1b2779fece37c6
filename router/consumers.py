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
anything past the size bounds (refused at decode), membership messages and KV events past their
worker's rate (:class:`~router.claims.RateLimits`, checked on the subject before decoding, so a
flood costs a dictionary look-up a message). A record's claims past the worker's signed manifest
(:mod:`router.manifests`) are cut to it (reason ``manifest_capped``), and a record outside it (model,
role, block size, engine, URL) is dropped (``manifest_refused``) and the worker taken out of
discovery as if it left; a worker without a manifest is
cut to the router's caps (:class:`~router.claims.ClaimCaps`: ``dp_size``, ``kv_total_blocks``;
reason ``claim_capped``). Each drop is logged once per source and counted
(:class:`~controlplane.protocol.guard.Drops`). A policy stream whose sequence went backwards (it
was deleted and created again) is noticed by :meth:`PolicyConsumer.check_stream`, which re-syncs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from bus.client import Bucket, Bus, Message, StreamState, Subscription
from bus.tasks import Tasks
from controlplane.protocol.errors import (
    InvalidRequest,
    RudderError,
    ServiceUnavailable,
    SubjectMismatch,
    ValidationFailed,
)
from controlplane.protocol.events import (
    AckStatus,
    ApplyAck,
    KvDumpReply,
    KvEvent,
    MembershipEvent,
    MembershipOp,
    PolicyResync,
    RestoreRequest,
    RouterRole,
    RouterStatus,
    WorkerCalibration,
    WorkerQuarantine,
    check_kv_dump,
    check_kv_subject,
    check_membership_subject,
    decode_kv_dump,
    decode_kv_event,
    decode_membership_event,
    decode_policy_event,
    utcnow,
)
from controlplane.protocol.guard import Drops, UrlAllowList
from controlplane.protocol.manifests import bound
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
    restore_subject,
    router_status_key,
)
from controlplane.telemetry import traces
from router.claims import ClaimCaps, RateLimits
from router.commands import (
    ApplyKvEvents,
    ApplyMembership,
    ApplyPolicy,
    BusHealth,
    DiscoveryComplete,
    LoadKvDump,
    RestorePolicy,
    ResyncPolicy,
    Tick,
)
from router.discovery import Change
from router.manifests import ManifestBook
from router.policy_state import ApplyResult, Outcome, stream_went_backwards
from router.scheduler import Scheduler

log = logging.getLogger(__name__)

#: How often a router asks the control plane for a document's last good version at most.
RESTORE_EVERY_S = 5.0


def expected_revision_of(payload: bytes) -> int | None:
    """The ``expected_revision`` a policy event names, or None when it is not one."""
    try:
        return decode_policy_event(payload).expected_revision
    except InvalidRequest:
        return None


def _reason(exc: InvalidRequest) -> str:
    return "subject_mismatch" if isinstance(exc, SubjectMismatch) else "malformed"

async def unsubscribe_all(subs: list[Subscription]) -> None:
    """Stop every subscription (a NATS that is already gone is not an error) and forget them."""
    for sub in subs:
        await sub.stop()
    subs.clear()


# ---------------------------------------------------------------------------------------------


class StatusPublisher:
    def __init__(
        self, kv: Bucket, scheduler: Scheduler, *, router_id: str, models: list[str],
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
        self._quarantined: list[WorkerQuarantine] = []

    def status(self) -> RouterStatus:
        return RouterStatus(
            **self._static, applied=self.scheduler.view.applied, heartbeat_at=utcnow(),
            policy_resync=self.resync,
            calibration=self._calibration, quarantined=self._quarantined,
        )

    async def put(self) -> None:
        async with self._lock:
            self._dirty.clear()
            with contextlib.suppress(RudderError):  # stopping: keep the last one
                self._calibration, self._quarantined = await self.scheduler.inspect(
                    lambda s: (s.calibration_status(), s.quarantine_status()))
            try:
                await self.kv.put(router_status_key(self.router_id), self.status().to_bytes())
            except RudderError as exc:
                log.warning("router status not written: %s", exc.message)
                self.scheduler.send(BusHealth(can_store=False))
            else:
                self.scheduler.send(BusHealth(can_store=True))

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
        except RudderError as exc:
            log.info("router status not deleted: %s", exc.message)


#: A subscription silent this long while the stream moves on is taken as stuck (a healthy one
#: delivers a write within milliseconds; nats-py resets a lost consumer after two idle heartbeats).
STALL_S = 1.0


class PolicyConsumer:
    def __init__(
        self, bus: Bus, scheduler: Scheduler, status: StatusPublisher, *,
        router_id: str, models: list[str],
        on_result: Callable[[ApplyResult], None] | None = None,
        on_resync: Callable[[], None] | None = None, restore_wait_s: float = 1.0,
    ) -> None:
        self.bus = bus
        self.scheduler = scheduler
        self.status = status
        self.router_id = router_id
        self.models = models
        self.on_result = on_result
        self.on_resync = on_resync
        self._subs: list[Subscription] = []
        self._stream_created: datetime | None = None
        self._resync_lock = asyncio.Lock()
        self.resyncs = 0
        self.acks = AckPublisher(bus, router_id)
        self.restore_wait_s = restore_wait_s
        self._restore_asked: dict[tuple[str, PolicyKind], float] = {}
        self._delivered_at = 0.0  # when the subscription last delivered a message (loop time)
        self._caught_up_to = 0  # the stream's last sequence when the heads were last read directly
        # Set once the replay of every document's head is through (readiness, DESIGN §5).
        self.loaded = asyncio.Event()

    async def start(self) -> None:
        info = await self._stream_info()
        if info is not None:
            self._stream_created = info.created
        self._delivered_at = asyncio.get_running_loop().time()
        await self._subscribe()

    async def _stream_info(self) -> StreamState | None:
        try:
            return await self.bus.stream_state(STREAM_POLICY)
        except RudderError as exc:
            log.debug("%s info not read: %s", STREAM_POLICY, exc.message)
            return None

    async def check_stream(self) -> bool:
        """Re-sync when ``RUDDER_POLICY`` went backwards: it was created again (its creation time
        changed) or its last sequence is below a revision this router has seen. Otherwise the
        router would skip every later revision as "already seen" (and its ordered consumers would
        wait past the old sequence). Returns whether it re-synced."""
        # The highest revision seen is read before the stream's last sequence: read after, a
        # revision stored and applied between the two reads looked like the stream going back.
        seen = await self.scheduler.inspect(lambda s: s.policy.max_seen())
        info = await self._stream_info()
        if info is None:
            return False
        if not self._subs:  # a re-sync whose subscribe failed (NATS away): subscribe again
            async with self._resync_lock:
                if not self._subs:
                    await self._subscribe()
        reason = stream_went_backwards(
            known_created=self._stream_created, created=info.created,
            last_seq=info.last_seq, max_seen=seen,
        )
        if self._stream_created is None:
            self._stream_created = info.created
        if reason is None:
            await self._catch_up(info.last_seq, seen)
            return False
        await self.resync(reason, created=info.created)
        return True

    async def _catch_up(self, last_seq: int, seen: int) -> None:
        """Read each document's head directly and apply it when the stream moved past what this
        router has seen and the subscription has delivered nothing for ``STALL_S``. Its consumer
        went with a JetStream node and nats-py cannot create it again until the cluster's meta
        leader is back (seconds, when the node killed held it: test_up_ha's routers sat one step
        behind for more than 2 s); a direct get needs only a replica. Once per stream position."""
        loop = asyncio.get_running_loop()
        if last_seq <= seen or last_seq == self._caught_up_to or loop.time() - self._delivered_at < STALL_S:
            return
        self._caught_up_to = last_seq
        applied = await self.scheduler.inspect(
            lambda s: {(m, k): s.policy.get(m, k).revision for m in self.models for k in PolicyKind})
        for (model, kind), revision in applied.items():
            await self._reread(model, kind, revision)

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
        # Per document, the revision this subscription delivered last. Its deliveries have no gap
        # (an ordered consumer resumes after the last one it delivered), so an event written on
        # that revision is in its place without a read of the stream: a router catching up after
        # a partition applied one revision per bus round trip (1.6-2.8 s for ~3 s of writes). A
        # new subscription starts from the last message per subject: it starts with none.
        follows: dict[tuple[str, PolicyKind], int] = {}

        async def on_msg(msg: Message) -> None:
            await self._on_msg(msg, follows)

        sub = await self.bus.ordered(STREAM_POLICY, [policy_filter(m) for m in self.models], on_msg)
        self._subs.append(sub)
        if await sub.nothing_to_replay():
            self.loaded.set()  # no document yet: the startup values are the policy

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)

    async def _on_msg(self, msg: Message, follows: dict[tuple[str, PolicyKind], int]) -> None:
        self._delivered_at = asyncio.get_running_loop().time()
        try:
            model, kind_name = parse_policy_subject(msg.subject)
            kind = PolicyKind(kind_name)
        except (InvalidRequest, ValueError) as exc:
            log.warning("ignoring message on %s: %s", msg.subject, exc)
            return
        if msg.seq is None:
            log.warning("ignoring message on %s: no stream sequence", msg.subject)
            return
        await self._apply(model, kind, msg.seq, msg.data, dict(msg.headers), follows=follows.get((model, kind)))
        follows[(model, kind)] = msg.seq
        if msg.pending == 0:
            self.loaded.set()  # the head of every document is applied (or NACKed)

    async def _apply(
        self, model: str, kind: PolicyKind, revision: int, payload: bytes, headers: dict[str, str] | None,
        *, follows: int | None = None,
    ) -> None:
        """Apply one revision; ``follows``: the revision of the document its subscription
        delivered just before it (None: unknown, or a re-read)."""
        previous = await self._previous(model, kind, revision, payload, follows=follows)
        span = None
        if traces.enabled():  # linked to the PATCH that published it (its traceparent header)
            span = traces.tracer(__name__).start_span(
                "policy apply", links=traces.link_from(headers), attributes={
                    "rudder.router_id": self.router_id, "rudder.model": model, "rudder.kind": kind.value,
                    "rudder.revision": revision})
        try:
            applied = await self.scheduler.call(
                ApplyPolicy(model, kind, revision, payload, headers, previous))
        except RudderError as exc:
            log.warning("policy %s|%s revision %d not applied: %s", model, kind.value, revision, exc)
            if span is not None:
                span.set_attribute("rudder.outcome", "error")
                span.end()
            return
        result = applied.result
        if span is not None:
            span.set_attribute("rudder.outcome", result.outcome.value)
            span.end()
        if result.outcome is Outcome.SKIP:
            return
        await self._ack(result)
        if result.outcome is Outcome.NACK:
            await self._restore(model, kind)
        if self.on_result is not None:
            self.on_result(result)
        self.status.request()
        if result.gap:
            log.warning(
                "policy %s|%s: gap before revision %d; re-reading the head", model, kind.value,
                revision,
            )
            await self._reread(model, kind, revision)

    async def _restore(self, model: str, kind: PolicyKind) -> None:
        """A document whose head was refused and that has no applied revision (a start after
        junk evicted every good revision, or a replay as the head) runs its startup values: ask
        the control plane for the last document it wrote (a signed answer to this question's
        nonce) rather than serve them. At most once per document per ``RESTORE_EVERY_S``."""
        now = asyncio.get_running_loop().time()
        if now - self._restore_asked.get((model, kind), -RESTORE_EVERY_S) < RESTORE_EVERY_S:
            return
        self._restore_asked[(model, kind)] = now
        if await self.scheduler.inspect(lambda s: s.policy.get(model, kind).revision):
            return
        nonce = secrets.token_hex(16)
        question = RestoreRequest(router_id=self.router_id, model=model, kind=kind, nonce=nonce)
        try:
            reply = await self.bus.request(restore_subject(self.router_id), question.to_bytes(),
                                           wait_s=self.restore_wait_s)
            applied = await self.scheduler.call(RestorePolicy(model, kind, reply.data, nonce))
        except RudderError as exc:
            log.warning("policy %s|%s: no last good document from the control plane: %s",
                        model, kind.value, exc.message)
            return
        result = applied.result
        if result.outcome is Outcome.ACK:
            log.warning("policy %s|%s: no valid signed head; %s", model, kind.value, result.detail)
            self.status.request()
        elif result.outcome is Outcome.NACK:
            log.error("policy %s|%s: %s", model, kind.value, result.detail)

    async def _previous(self, model: str, kind: PolicyKind, revision: int, payload: bytes, *,
                        follows: int | None = None) -> int | None:
        """The chain check's evidence: the first message of the event's subject after the revision
        it was written on. For an event in its place that is the event itself (returned as its
        ``expected_revision``); for a replay, a message in between. None when it cannot be told
        (not an event: the policy state refuses it anyway; or NATS away: the state then checks
        against the revision it saw last)."""
        expected = expected_revision_of(payload)
        if expected is None or expected >= revision:
            return None
        if follows is not None and follows == expected:
            return expected  # the message before it on its subject is the one delivered before it
        try:
            msg = await self.bus.get(STREAM_POLICY, expected + 1, subject=policy_subject(model, kind.value))
        except RudderError as exc:
            log.warning("chain of %s|%s revision %d not checked: %s", model, kind.value, revision,
                        exc.message)
            return None
        if msg is None or msg.seq is None or msg.seq > revision:
            # Past the event itself: the stream no longer holds it (a router that resumes after
            # more than the history's depth of newer revisions); nothing in between can be seen.
            return None
        return expected if msg.seq == revision else msg.seq

    async def _reread(self, model: str, kind: PolicyKind, revision: int) -> None:
        try:
            msg = await self.bus.last(STREAM_POLICY, policy_subject(model, kind.value))
        except RudderError as exc:
            log.warning("head of %s|%s not re-read: %s", model, kind.value, exc.message)
            return
        if msg is not None and msg.seq is not None and msg.seq > revision:
            await self._apply(model, kind, msg.seq, msg.data, dict(msg.headers))

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
    ``Nats-Msg-Id``, so a retry whose first attempt was stored after all is not stored twice.
    Retries back off to at most ``max_retry_s`` (0.5 s): an ACK is what tells the control plane
    the router is on the head, so it must follow soon after the bus can store again (a failed
    store is cheap: refused locally while disconnected, or bounded by the ack wait)."""

    def __init__(self, bus: Bus, router_id: str, *, limit: int = 10_000, max_retry_s: float = 0.5) -> None:
        self.bus = bus
        self.router_id = router_id
        self.max_retry_s = max_retry_s
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
                    await self.bus.store(acks_subject(self.router_id), ack.to_bytes(),
                                         headers={HDR_MSG_ID: msg_id})
                    break
                except RudderError as exc:
                    log.warning("ACK for revision %d not stored yet (%s); retrying", ack.revision,
                                exc.message)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.max_retry_s)

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Give queued ACKs a moment to be stored (graceful stop)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._queue.empty() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


class KvDumper:
    # Dumps asked for in a row while the scheduler answers "ask again" with no new reason to ask.
    MAX_ASKS = 4

    def __init__(
        self, bus: Bus, scheduler: Scheduler, tasks: Tasks, *, timeout_s: float, drops: Drops,
        min_interval_s: float = 0.0,
    ) -> None:
        self.bus = bus
        self.scheduler = scheduler
        self.tasks = tasks
        self.timeout_s = timeout_s
        self.drops = drops
        # A worker's dump is asked for at most this often: a worker that keeps making gaps (event
        # ids jumping) cannot make the router request and load its full state in a loop.
        self.min_interval_s = min_interval_s
        self._last: dict[int, float] = {}
        self._inflight: set[int] = set()
        self._stale: set[int] = set()
        self.missed = 0  # dumps asked for that did not come (timeout, no responder, refused payload)

    def request(self, instance_id: int) -> None:
        if instance_id in self._inflight:
            # The dump on its way may answer for what was there before (a restart): ask again.
            self._stale.add(instance_id)
            return
        self._inflight.add(instance_id)
        self.tasks.spawn(self._dumps(instance_id), name=f"kvdump-{instance_id}")

    async def _dumps(self, instance_id: int) -> None:
        """Ask for the worker's dump and hand it to the scheduler, again while the scheduler
        answers "ask again" (``Scheduler._load_dump``): without limit after a stale reply (each
        follows a new reason to ask: a join, a restart), ``MAX_ASKS`` times in a row otherwise;
        then a last hand-over takes what can be taken."""
        try:
            asks = 0
            while True:
                self._stale.discard(instance_id)
                reply = await self._dump(instance_id)
                stale = instance_id in self._stale
                again = await self.scheduler.call(LoadKvDump(instance_id, reply, stale=stale))
                if again:
                    asks = 0 if stale else asks + 1
                    if asks >= self.MAX_ASKS:
                        await self.scheduler.call(LoadKvDump(instance_id, None, final=True))
                        again = False
                if not again:
                    if instance_id not in self._stale:
                        return
                    # Asked for again while the answer came back (a gap right after the load):
                    # that request found this task still here, so this task asks.
                    asks = 0
        except ServiceUnavailable:  # the router stops
            pass
        finally:
            self._inflight.discard(instance_id)
            self._stale.discard(instance_id)

    async def _dump(self, instance_id: int) -> KvDumpReply | None:
        try:
            wait = self._last.get(instance_id, -self.min_interval_s) + self.min_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last[instance_id] = time.monotonic()
            if len(self._last) > 65_536:
                del self._last[next(iter(self._last))]
            msg = await self.bus.request(kvdump_subject(instance_id), wait_s=self.timeout_s)
            reply = decode_kv_dump(msg.data)
            check_kv_dump(instance_id, reply)
            return reply
        except InvalidRequest as exc:
            self.drops.drop("kvdump", _reason(exc), kvdump_subject(instance_id), exc.message)
        except RudderError as exc:
            log.info("no dump from worker %s: %s", instance_id, exc.message)
        self.missed += 1
        return None


class MembershipConsumer:
    def __init__(
        self, bus: Bus, scheduler: Scheduler, dumper: KvDumper | None, *,
        models: list[str], allow: UrlAllowList, drops: Drops, ready_timeout_s: float = 3.0,
        caps: ClaimCaps | None = None, limits: RateLimits | None = None,
        manifests: ManifestBook | None = None,
    ) -> None:
        self.caps = caps or ClaimCaps()
        self.manifests = manifests
        self.limits = limits
        self.bus = bus
        self.scheduler = scheduler
        self.dumper = dumper
        self.models = models
        self.allow = allow
        self.drops = drops
        self.ready_timeout_s = ready_timeout_s
        self._subs: list[Subscription] = []
        self._complete = asyncio.Event()

    async def start(self) -> None:
        sub = await self.bus.ordered(STREAM_MEMBERSHIP, [membership_filter(m) for m in self.models],
                                     self._on_msg)
        self._subs.append(sub)
        if await sub.nothing_to_replay():
            self._declare()  # nothing to replay: discovery is complete (and empty)

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

    def _accept(self, msg: Message) -> MembershipEvent | None:
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
        manifest = self.manifests.get(event.worker.instance_id) if self.manifests is not None else None
        if manifest is not None:
            try:
                bounded, cut = bound(event, manifest)
            except ValidationFailed as exc:
                self.drops.drop("membership", "manifest_refused", msg.subject, exc.message)
                # Outside what was issued: the worker is no candidate (as if it left) until a
                # record within its manifest arrives (its heartbeats would not age it out alone).
                return event.model_copy(update={"op": MembershipOp.LEAVE, "load": []})
            if cut:
                self.drops.drop("membership", "manifest_capped", msg.subject,
                                f"worker {event.worker.instance_id}: {', '.join(cut)} cut to its manifest")
            return bounded
        capped, fields = self.caps.cap(event)
        if fields:
            self.drops.drop("membership", "claim_capped", msg.subject,
                            f"worker {event.worker.instance_id}: {', '.join(fields)} cut to the router's caps")
        return capped

    async def _on_msg(self, msg: Message) -> None:
        if self.limits is not None and not self.limits.allow(msg.subject, time.monotonic()):
            self.drops.drop("membership", "rate_limited", msg.subject, "membership messages past the rate")
            if msg.pending == 0:
                self._declare()
            return
        event = self._accept(msg)
        if event is not None:
            try:
                change = await self.scheduler.call(
                    ApplyMembership(event, msg.stored_at, live=self._complete.is_set()))
            except RudderError:
                return
            if (change is Change.JOINED or change is Change.RESTARTED) and self.dumper is not None:
                self.dumper.request(event.worker.instance_id)
        if msg.pending == 0:
            self._declare()  # the replay of the last state of every worker is applied


#: KV events handed to the scheduler in one command at most: a command of this many takes the
#: actor about a millisecond, so selections queued behind it wait no longer than that.
KV_BATCH = 64
#: KV commands handed to the scheduler at once, at most: under load the actor takes several in
#: one of its turns (a turn grows with the loop's other work, decision 107), where one command a
#: round trip left it a batch every two turns of the loop.
KV_INFLIGHT = 8
#: KV events received and not yet handed to the scheduler, at most; past it an event is dropped
#: (reason ``backlog``) and its worker's next one is a gap, which asks for the worker's dump.
KV_BACKLOG = 16384


class KvEventSubscriber:
    """Core subscriptions on the served models' KV events. Each message is checked and decoded as
    it comes and joins a backlog; :meth:`run` hands the backlog to the scheduler, up to
    :data:`KV_BATCH` events a command, in the order they came. One command a message (awaited
    before the next was read) took a round trip through the actor's queue each, two turns of the
    event loop: under load a turn takes a millisecond or more, fewer events were applied a second
    than the workers sent, and the rest waited in nats-py's queue (the index minutes behind, the
    router's memory growing by the events waiting: docs/decisions.md 122)."""

    def __init__(
        self, bus: Bus, scheduler: Scheduler, dumper: KvDumper, *, models: list[str], drops: Drops,
        limits: RateLimits | None = None,
    ) -> None:
        self.limits = limits
        self.bus = bus
        self.scheduler = scheduler
        self.dumper = dumper
        self.models = models
        self.drops = drops
        self._subs: list[Subscription] = []
        self.received = 0
        self._backlog: collections.deque[KvEvent] = collections.deque()
        self._more = asyncio.Event()
        self.handing = 0  # events handed to the scheduler, not yet applied

    @property
    def backlog(self) -> int:
        """Events received and not yet applied."""
        return len(self._backlog) + self.handing

    async def start(self) -> None:
        for model in self.models:
            self._subs.append(await self.bus.subscribe(kv_filter(model), functools.partial(self._on_msg, model)))

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)

    async def _on_msg(self, model: str, msg: Message) -> None:
        if self.limits is not None and not self.limits.allow(msg.subject, time.monotonic(), len(msg.data)):
            self.drops.drop("kv", "rate_limited", msg.subject, "KV events past the worker's byte rate")
            return
        try:
            event = decode_kv_event(msg.data)
            check_kv_subject(msg.subject, model, event)
        except InvalidRequest as exc:
            self.drops.drop("kv", _reason(exc), msg.subject, exc.message)
            return
        self.received += 1
        if len(self._backlog) >= KV_BACKLOG:
            self.drops.drop("kv", "backlog", msg.subject, f"{KV_BACKLOG} KV events wait for the scheduler")
            return
        self._backlog.append(event)
        self._more.set()

    async def run(self) -> None:
        """Hands the backlog to the scheduler (a task of the router's lifespan), up to
        :data:`KV_INFLIGHT` commands at once; asks for the dumps the scheduler answers it needs."""
        backlog = self._backlog
        while True:
            await self._more.wait()
            self._more.clear()
            while backlog:
                batches: list[list[KvEvent]] = []
                while backlog and len(batches) < KV_INFLIGHT:
                    batches.append([backlog.popleft() for _ in range(min(len(backlog), KV_BATCH))])
                self.handing = sum(len(batch) for batch in batches)
                try:
                    futures = [self.scheduler.submit(ApplyKvEvents(batch)) for batch in batches]
                    answers = await asyncio.gather(*futures, return_exceptions=True)
                except RudderError:  # the scheduler is stopping
                    answers = []
                finally:
                    self.handing = 0
                for answer in answers:
                    if isinstance(answer, RudderError):  # the scheduler is stopping
                        continue
                    if isinstance(answer, BaseException):  # a bug in a handler: the next batches still
                        log.error("KV events not applied: %r", answer)  # go; their gap asks for a dump
                        continue
                    for wid in answer:
                        self.dumper.request(wid)


async def tick(scheduler: Scheduler) -> None:
    gone = await scheduler.call(Tick())
    if gone:
        log.info("workers expired: %s", gone)
