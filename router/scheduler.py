"""The scheduler actor: the one owner of a router's routing state (DESIGN §5).

Effective policy, the discovery snapshot, the prefix index, bookings and busy flags live here and
nowhere else. Everything that reads or changes them arrives as a typed command on one queue and is
handled, one at a time, in :meth:`Scheduler._dispatch`; a handler never awaits, so a policy
change lands between two selections, never inside one, and queued selections survive it.

Other tasks send a command and await its future. A selection whose future is already done (its
client went away and cancelled it) is skipped. :meth:`Scheduler.stop` answers every waiter still
queued with ``ServiceUnavailable`` and then returns; an unexpected error in a handler fails that
command's future (logged with its traceback) and the actor carries on.

For speed at thousands of workers each (worker, dp rank) has one persistent :class:`Slot`
(a :class:`~router.selection.Candidate`), updated in place when its load, bookings, health or
busy flag change, so a selection only scans the eligible slots once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

from controlplane.protocol.errors import (
    InvalidRequest,
    Overloaded,
    QueueFull,
    RudderError,
    ServiceUnavailable,
)
from controlplane.protocol.events import (
    AppliedDocument,
    KvDumpReply,
    KvEvent,
    MembershipEvent,
    RouterRole,
    WorkerRole,
    utcnow,
)
from controlplane.protocol.policy import CacheInput, Number, PolicyKind
from controlplane.protocol.signing import Keyring
from router.bookings import Bookings
from router.busy import Thresholds, rank_busy
from router.discovery import Change, Discovery, Health, WorkerState
from router.index import KvApplied, PrefixIndex, WorkerKey
from router.loadvec import VECTOR_MIN_CANDIDATES, LoadTable, pick_index
from router.policy_state import ApplyResult, Outcome, PolicyState
from router.selection import (
    NO_OVERLAP,
    Candidate,
    Overlap,
    RoundRobin,
    SelectionParams,
    costs,
    least_loaded,
    pick,
)
from router.settings import RoutingMode
from router.targets import Pin, Targets, pool_of, prefill_not_allowed, resolve_pin

log = logging.getLogger(__name__)
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Requests and answers

PREFILL_BOOKING = ":prefill"  # suffix of the booking id of a disaggregated request's prefill phase


class Phase(enum.Enum):
    """What a selection is for. ``AUTO``: the whole request on a router of a prefill or decode
    role or on an aggregated deployment, or its prefill phase when the model's snapshot holds
    prefill and decode workers (the answer says so); ``DECODE``: the decode phase that follows."""

    AUTO = "auto"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    request_id: str
    model: str
    prompt_tokens: int
    hashes: Mapping[int, Sequence[int]]  # block size → chain hashes of the prompt's full blocks
    pin: Pin | None = None  # used when ``targets`` is None
    exclude: frozenset[int] = frozenset()  # workers that already failed this request
    targets: Targets | None = None  # both phases' explicit targets (parse_targets)
    phase: Phase = Phase.AUTO


@dataclass(frozen=True, slots=True)
class Selection:
    request_id: str
    model: str
    instance_id: int
    dp_rank: int
    url: str
    revisions: dict[str, int]  # kind → revision of the document it was scored with
    seq: int  # position of the command in the queue
    cost: float | None
    overlap_blocks: int
    cached_tokens: int
    prompt_tokens: int
    candidates: int
    pinned: bool = False
    pool: WorkerRole = WorkerRole.AGGREGATED
    # Id its booking is kept under (send RequestFirstToken / RequestDone with it).
    booking_id: str = ""
    # True for the prefill phase of a disaggregated request: a decode phase must follow.
    disaggregated: bool = False

    @property
    def predicted_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PolicyApplied:
    result: ApplyResult
    seq: int


@dataclass(frozen=True, slots=True)
class RouterView:
    """What the HTTP side may read without asking the actor (replaced, never mutated)."""

    ready: bool = False
    block_sizes: dict[str, frozenset[int]] = field(default_factory=dict)
    tokenizers: dict[str, frozenset[str]] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)
    applied: dict[str, AppliedDocument] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Commands (imperative names; each carries the future its sender awaits, if any)


@dataclass(slots=True)
class _Command(Generic[T]):
    future: asyncio.Future[T] | None = field(default=None, kw_only=True)
    seq: int = field(default=0, kw_only=True)


@dataclass(slots=True)
class SelectWorker(_Command[Selection]):
    request: RoutingRequest


@dataclass(slots=True)
class ApplyPolicy(_Command[PolicyApplied]):
    model: str
    kind: PolicyKind
    revision: int
    payload: bytes
    headers: dict[str, str] | None  # the message's headers: the signature is among them


@dataclass(slots=True)
class UseVerifyKeys(_Command[None]):
    """The verify-keys file changed: check policy signatures against this keyring from now on."""

    keyring: Keyring


@dataclass(slots=True)
class ResyncPolicy(_Command[dict[str, int]]):
    """The policy stream went backwards: forget applied revisions (answers them)."""

    reason: str


@dataclass(slots=True)
class ApplyMembership(_Command[Change]):
    event: MembershipEvent
    received_at: datetime | None = None  # when the bus stored it (liveness uses it, not event.at)


@dataclass(slots=True)
class ApplyKvEvents(_Command[list[int]]):
    """Answers the worker ids whose full state must be fetched (gap or new worker)."""

    events: list[KvEvent]


@dataclass(slots=True)
class LoadKvDump(_Command[None]):
    instance_id: int
    reply: KvDumpReply | None  # None: the dump failed; replay what was buffered


@dataclass(slots=True)
class DiscoveryComplete(_Command[None]):
    pass


@dataclass(slots=True)
class RequestFirstToken(_Command[None]):
    request_id: str


@dataclass(slots=True)
class RequestDone(_Command[None]):
    request_id: str


@dataclass(slots=True)
class MarkUnavailable(_Command[None]):
    instance_id: int


@dataclass(slots=True)
class Tick(_Command[list[int]]):
    """Expire workers and approximate-index entries; answers the ids of workers gone."""


@dataclass(slots=True)
class Inspect(_Command[Any]):
    """Run a read-only function on the actor's state (status, tests)."""

    fn: Callable[[Scheduler], Any]


_STOP = object()


class Slot(Candidate):
    """A candidate kept between selections, with what eligibility needs."""

    __slots__ = ("busy", "healthy", "role", "url")

    def __init__(self, state: WorkerState, dp_rank: int) -> None:
        rec = state.record
        super().__init__(rec.instance_id, dp_rank, rec.block_size, 0, 0, 0)
        self.busy = False
        self.healthy = True
        self.url = rec.url
        self.role = rec.role


def selectable(slot: Slot) -> bool:
    """Whether a slot may be chosen by a selection that names no target."""
    return slot.healthy and not slot.busy


# ---------------------------------------------------------------------------------------------


class Scheduler:
    def __init__(
        self, *, router_id: str, models: Sequence[str], role: RouterRole, mode: RoutingMode,
        kv_events: bool, cache_inputs: frozenset[CacheInput],
        startup: dict[PolicyKind, dict[str, Number | None]],
        worker_ttl_s: float, worker_stale_s: float, approx_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], datetime] = utcnow,
        keyring: Keyring, rng: random.Random | None = None, max_queued_selections: int | None = None,
    ) -> None:
        self.router_id = router_id
        # Selections waiting in the queue at most (None: unbounded); past it submit refuses.
        self.max_queued_selections = max_queued_selections
        self._queued_selections = 0
        self.models = list(models)
        self.role = role
        self.pool = pool_of(role)
        # An aggregated router serves aggregated deployments and disaggregated ones (prefill and
        # decode workers of one model); a prefill or decode router selects in its own pool only.
        self.pools: frozenset[WorkerRole] = (
            frozenset(WorkerRole) if role is RouterRole.AGGREGATED else frozenset({self.pool})
        )
        self.mode = mode
        self.kv_events = kv_events
        self.approximate = mode is RoutingMode.KV and not kv_events
        self.use_index = mode is RoutingMode.KV and role is not RouterRole.DECODE
        self.approx_ttl_s = approx_ttl_s
        self.clock = clock
        self.wall = wall
        self.rng = rng or random.Random()
        self.policy = PolicyState(
            router_id=router_id, models=models, startup=startup, cache_inputs=cache_inputs,
            keyring=keyring,
        )
        self.discovery = Discovery(ttl_s=worker_ttl_s, stale_s=worker_stale_s, models=frozenset(models))
        self.index = PrefixIndex()
        self.bookings = Bookings()
        self.round_robin = {m: RoundRobin() for m in models}
        self._slots: dict[str, dict[WorkerKey, Slot]] = {m: {} for m in models}  # every pool
        self._pools: dict[tuple[str, WorkerRole], LoadTable[Slot]] = {
            (m, p): LoadTable(selectable) for m in models for p in self.pools
        }
        self._params: dict[str, SelectionParams] = {}
        self._thresholds: dict[str, Thresholds] = {}
        for m in models:
            self._refresh_policy(m)
        self.view = RouterView(applied=self.policy.applied())
        self._ready = False
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._seq = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.stats: dict[str, int] = {"selections": 0, "skipped": 0, "applied": 0, "nacked": 0}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"scheduler-{self.router_id}")
        return self._task

    async def stop(self) -> None:
        """Stop taking commands, answer every waiter still queued, and end the actor."""
        if self._stopping:
            if self._task is not None:
                await asyncio.shield(self._task)
            return
        self._stopping = True
        self._queue.put_nowait(_STOP)
        if self._task is not None:
            await self._task
        else:
            self._drain()

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if isinstance(cmd, SelectWorker):
                self._queued_selections -= 1
            if isinstance(cmd, _Command) and cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(ServiceUnavailable("router is stopping", retry_after=1))

    async def _run(self) -> None:
        try:
            while True:
                cmd = await self._queue.get()
                if cmd is _STOP:
                    break
                self._handle(cmd)
                # Let the loop breathe between commands: the queue never empties under load, and
                # NATS, HTTP and the commands' senders must keep running meanwhile.
                await asyncio.sleep(0)
        finally:
            self._drain()

    def _handle(self, cmd: _Command[Any]) -> None:
        fut = cmd.future
        if isinstance(cmd, SelectWorker):
            self._queued_selections -= 1
        if fut is not None and fut.done():
            if isinstance(cmd, SelectWorker):
                self.stats["skipped"] += 1
                log.info("selection %s skipped: client gone while queued", cmd.request.request_id)
            return
        try:
            result = self._dispatch(cmd)
        except RudderError as exc:
            if fut is not None:
                fut.set_exception(exc)
            return
        except Exception as exc:
            log.exception("scheduler command %s failed", type(cmd).__name__)
            if fut is not None:
                fut.set_exception(exc)
            return
        if fut is not None:
            fut.set_result(result)

    # -- sending -----------------------------------------------------------------------------

    def submit(self, cmd: _Command[T]) -> asyncio.Future[T]:
        """Queue a command; the returned future answers it. Raises ServiceUnavailable if stopping,
        QueueFull for a selection when ``max_queued_selections`` are already waiting."""
        if self._stopping:
            raise ServiceUnavailable("router is stopping", retry_after=1)
        if isinstance(cmd, SelectWorker):
            bound = self.max_queued_selections
            if bound is not None and self._queued_selections >= bound:
                raise QueueFull(f"router queue is full ({bound} selections waiting)", queued=bound)
            self._queued_selections += 1
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        cmd.future = fut
        cmd.seq = next(self._seq)
        self._queue.put_nowait(cmd)
        return fut

    def send(self, cmd: _Command[Any]) -> None:
        """Queue a command nobody waits for (completions, KV events). Dropped when stopping."""
        if self._stopping:
            return
        cmd.seq = next(self._seq)
        self._queue.put_nowait(cmd)

    async def call(self, cmd: _Command[T]) -> T:
        fut = self.submit(cmd)
        try:
            return await fut
        except asyncio.CancelledError:
            fut.cancel()
            raise

    async def select(self, request: RoutingRequest) -> Selection:
        return await self.call(SelectWorker(request))

    async def inspect(self, fn: Callable[[Scheduler], T]) -> T:
        result: T = await self.call(Inspect(fn))
        return result

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # -- dispatch ----------------------------------------------------------------------------

    def _dispatch(self, cmd: _Command[Any]) -> Any:
        match cmd:
            case SelectWorker():
                return self._select(cmd.request, cmd.seq)
            case ApplyPolicy():
                return self._apply_policy(cmd)
            case UseVerifyKeys():
                self.policy.use_keyring(cmd.keyring)
                return None
            case ResyncPolicy():
                forgotten = self.policy.resync()
                log.warning("policy re-sync (%s): revisions %s forgotten", cmd.reason, forgotten)
                self._publish_view()
                return forgotten
            case ApplyMembership():
                return self._apply_membership(cmd.event, cmd.received_at)
            case ApplyKvEvents():
                return self._apply_kv(cmd.events)
            case LoadKvDump():
                return self._load_dump(cmd.instance_id, cmd.reply)
            case RequestFirstToken():
                booking = self.bookings.first_token(cmd.request_id)
                if booking is not None:
                    self._refresh_slot(booking.model, booking.key)
                return None
            case RequestDone():
                booking = self.bookings.free(cmd.request_id)
                if booking is not None:
                    self._refresh_slot(booking.model, booking.key)
                return None
            case MarkUnavailable():
                if self.discovery.mark_unreachable(cmd.instance_id):
                    log.warning("worker %s unreachable until its next heartbeat", cmd.instance_id)
                    self._refresh_worker(cmd.instance_id)
                return None
            case Tick():
                return self._tick()
            case DiscoveryComplete():
                self._ready = True
                self._publish_view()
                return None
            case Inspect():
                return cmd.fn(self)
        raise TypeError(f"unknown command {cmd!r}")

    # -- policy ------------------------------------------------------------------------------

    def _refresh_policy(self, model: str) -> None:
        self._params[model] = SelectionParams.from_values(
            self.policy.get(model, PolicyKind.SELECTION).effective
        )
        self._thresholds[model] = Thresholds.from_values(
            self.policy.get(model, PolicyKind.BUSY_THRESHOLD).effective
        )

    def _apply_policy(self, cmd: ApplyPolicy) -> PolicyApplied:
        result = self.policy.apply(cmd.model, cmd.kind, cmd.revision, cmd.payload, cmd.headers)
        if result.outcome is Outcome.ACK:
            self.stats["applied"] += 1
            self._refresh_policy(cmd.model)
            if cmd.kind is PolicyKind.BUSY_THRESHOLD:
                for slot in self._slots[cmd.model].values():
                    self._refresh_busy(cmd.model, slot)
        elif result.outcome is Outcome.NACK:
            self.stats["nacked"] += 1
        if result.outcome is not Outcome.SKIP:
            log.info(
                "policy %s|%s revision %d: %s %s", cmd.model, cmd.kind.value, cmd.revision,
                result.outcome.value, result.detail,
            )
            self._publish_view()
        return PolicyApplied(result, cmd.seq)

    def revisions(self, model: str) -> dict[str, int]:
        return {k.value: self.policy.get(model, k).revision for k in PolicyKind}

    def params(self, model: str) -> SelectionParams:
        return self._params[model]

    # -- membership --------------------------------------------------------------------------

    def _apply_membership(self, event: MembershipEvent, received_at: datetime | None = None) -> Change:
        change = self.discovery.apply(
            event, now=self.clock(), wall_now=self.wall(), received_at=received_at
        )
        wid = event.worker.instance_id
        if change is Change.LEFT:
            self._forget(wid, "left")
        elif change is Change.JOINED:
            log.info("worker %s joined (%s, %s)", wid, event.worker.model, event.worker.url)
            self._rebuild_worker(wid)
            if self.use_index and self.kv_events:
                self.index.begin_dump(wid)
            self._publish_view()
        elif change is Change.UPDATED:
            self._rebuild_worker(wid)
        return change

    def _forget(self, wid: int, why: str) -> None:
        self.index.remove_worker(wid)
        dropped = self.bookings.drop_worker(wid)
        for slots in (*self._slots.values(), *self._pools.values()):
            for key in [k for k in slots if k[0] == wid]:
                del slots[key]
        log.info("worker %s %s: %d bookings dropped", wid, why, len(dropped))
        self._publish_view()

    def _rebuild_worker(self, wid: int) -> None:
        state = self.discovery.get(wid)
        if state is None:
            return
        model = state.record.model
        role = state.record.role
        if role not in self.pools:
            return
        slots = self._slots[model]
        pool = self._pools[(model, role)]
        size = state.record.dp_size
        for key in [k for k in slots if k[0] == wid and (k[1] >= size or slots[k].role is not role)]:
            self._pools[(model, slots[key].role)].pop(key, None)
            del slots[key]
        for rank in range(size):
            slot = slots.get((wid, rank))
            if slot is None or slot.block_size != state.record.block_size:
                slot = slots[(wid, rank)] = pool[(wid, rank)] = Slot(state, rank)
            slot.url = state.record.url
            self._refresh_slot(model, (wid, rank), state)

    def _refresh_worker(self, wid: int) -> None:
        state = self.discovery.get(wid)
        if state is not None:
            for rank in range(state.record.dp_size):
                self._refresh_slot(state.record.model, (wid, rank), state)

    def _refresh_slot(self, model: str, key: WorkerKey, state: WorkerState | None = None) -> None:
        slot = self._slots[model].get(key)
        if slot is None:
            return
        if state is None:
            state = self.discovery.get(key[0])
            if state is None:
                return
        reported = state.load.get(key[1])
        booked = self.bookings.rank(key)
        slot.active_prefill_tokens = max(
            booked.prefill_tokens if booked else 0, reported.active_prefill_tokens if reported else 0
        )
        slot.decode_blocks = max(
            booked.active_blocks if booked else 0, reported.active_decode_blocks if reported else 0
        )
        slot.active_requests = max(
            booked.requests if booked else 0,
            (reported.running + reported.waiting) if reported else 0,
        )
        slot.healthy = self.discovery.health(state, self.clock()) is Health.LIVE
        self._refresh_busy(model, slot, state)

    def _refresh_busy(self, model: str, slot: Slot, state: WorkerState | None = None) -> None:
        slot.touch()  # its load figures or flags change: its pool's LoadTable re-reads it
        th = self._thresholds[model]
        if not th.enabled:
            slot.busy = False
            return
        state = state or self.discovery.get(slot.instance_id)
        if state is None:
            return
        slot.busy = rank_busy(
            th, active_decode_blocks=slot.decode_blocks,
            active_prefill_tokens=slot.active_prefill_tokens,
            kv_total_blocks=state.record.kv_total_blocks,
            max_num_batched_tokens=state.record.max_num_batched_tokens,
        )

    def _tick(self) -> list[int]:
        now = self.clock()
        gone = self.discovery.expire(now)
        for wid in gone:
            self._forget(wid, "expired (no heartbeat within the TTL)")
        if self.approximate:
            self.index.expire(now)
        for slots in self._slots.values():
            for slot in slots.values():
                state = self.discovery.get(slot.instance_id)
                if state is not None:
                    slot.healthy = self.discovery.health(state, now) is Health.LIVE
                    slot.touch()
        return gone

    # -- KV events ---------------------------------------------------------------------------

    def _apply_kv(self, events: list[KvEvent]) -> list[int]:
        need: list[int] = []
        if not self.use_index or not self.kv_events:
            return need
        for event in events:
            if self.discovery.get(event.instance_id) is None:
                continue  # not (or no longer) a worker of ours; its dump comes when it joins
            applied = self.index.apply(event)
            if applied in (KvApplied.GAP, KvApplied.NEW_WORKER):
                if applied is KvApplied.GAP:
                    log.warning("KV event gap from worker %s at event %d", event.instance_id, event.event_id)
                if self.index.begin_dump(event.instance_id):
                    need.append(event.instance_id)
        return need

    def _load_dump(self, wid: int, reply: KvDumpReply | None) -> None:
        if self.discovery.get(wid) is None:
            self.index.remove_worker(wid)
            return
        results = self.index.abandon_dump(wid) if reply is None else self.index.load_dump(reply)
        if any(r in (KvApplied.GAP, KvApplied.NEW_WORKER) for r in results):
            log.warning("worker %s: events still missing after its dump", wid)

    def dumps_pending(self) -> list[int]:
        return [w for w in self.discovery.workers if self.index.dump_pending(w)]

    # -- selection ---------------------------------------------------------------------------

    def disaggregated(self, model: str) -> bool:
        """The model's snapshot holds prefill and decode workers (and this router runs both)."""
        pools = self._pools
        return bool(
            self.role is RouterRole.AGGREGATED
            and pools[(model, WorkerRole.PREFILL)] and pools[(model, WorkerRole.DECODE)]
        )

    def _plan(self, req: RoutingRequest) -> tuple[WorkerRole, Pin | None, bool]:
        """(pool, explicit target, whether a decode phase follows) of a selection.
        Raises InvalidRequest for a prefill target on an aggregated deployment."""
        t = req.targets
        if self.role is not RouterRole.AGGREGATED:
            if t is None:
                return self.pool, req.pin, False
            return self.pool, t.prefill if self.pool is WorkerRole.PREFILL else t.decode, False
        decode_pin = req.pin if t is None else t.decode
        if req.phase is Phase.DECODE:
            return WorkerRole.DECODE, decode_pin, False
        if self.disaggregated(req.model):
            return WorkerRole.PREFILL, None if t is None else t.prefill, True
        if t is not None and t.prefill_field is not None:
            raise prefill_not_allowed(t.prefill_field)
        if not self._pools[(req.model, WorkerRole.AGGREGATED)] and self._pools[(req.model, WorkerRole.DECODE)]:
            # Decode workers and no prefill worker: they prefill locally (as vLLM does without
            # remote KV), so they serve whole requests rather than none.
            return WorkerRole.DECODE, decode_pin, False
        return WorkerRole.AGGREGATED, decode_pin, False

    def _select(self, req: RoutingRequest, seq: int) -> Selection:
        model = req.model
        if model not in self._slots:
            raise InvalidRequest(f"model {model!r} is not served by this router", field="model")
        revisions = self.revisions(model)
        pool, pin, then_decode = self._plan(req)
        if pin is not None:
            return self._select_pinned(req, seq, revisions, pool, pin, then_decode)
        slots = self._pools[(model, pool)]
        exclude = req.exclude
        if self.mode is RoutingMode.KV and len(slots) >= VECTOR_MIN_CANDIDATES:
            many = self._select_many(req, slots)
            if many is not None:
                return self._book(req, seq, revisions, *many, disaggregated=then_decode)
        eligible = [
            s for s in slots.values()
            if s.healthy and not s.busy and (not exclude or s.instance_id not in exclude)
        ]
        if not eligible:
            where = "" if pool is WorkerRole.AGGREGATED else f" in the {pool.value} pool"
            if any(s.healthy and s.instance_id not in exclude for s in slots.values()):
                raise Overloaded(f"every worker of model {model}{where} is busy", model=model)
            raise ServiceUnavailable(f"no worker available for model {model}{where}", retry_after=1)
        p = req.prompt_tokens
        overlaps: dict[WorkerKey, Overlap] = {}
        cost: float | None = None
        if self.mode is RoutingMode.KV:
            params = self._params[model]
            if self.use_index:
                for hashes in req.hashes.values():
                    if hashes:
                        overlaps.update(self.index.overlaps(hashes))
            request_blocks = {bs: -(-p // bs) for bs in req.hashes} or {
                eligible[0].block_size: -(-p // eligible[0].block_size)
            }
            all_costs = costs(
                eligible, params, p, overlaps=overlaps, request_blocks=request_blocks,
                booked_shared=self._booked_shared(req, slots),
            )
            i = pick(all_costs, params.router_temperature, self.rng)
            cost = all_costs[i]
        elif self.mode is RoutingMode.ROUND_ROBIN:
            i = self.round_robin[model].pick(eligible)
        elif self.mode is RoutingMode.RANDOM:
            i = self.rng.randrange(len(eligible))
        else:
            i = least_loaded(eligible, self.rng)
        chosen = eligible[i]
        return self._book(
            req, seq, revisions, chosen, overlaps.get(chosen.key, NO_OVERLAP), cost, len(eligible),
            disaggregated=then_decode,
        )

    def _select_many(self, req: RoutingRequest, slots: LoadTable[Slot]) -> tuple[Slot, Overlap, float, int] | None:
        """The KV selection of :meth:`_select` over a large pool, on numpy columns
        (:mod:`router.loadvec`): the same costs, candidate order and random draws. ``None`` when no
        rank is eligible, so that :meth:`_select` raises the error that fits.
        Returns (chosen slot, its overlap, its cost, number of candidates)."""
        rows = slots.eligible_rows(req.exclude)
        n = len(slots) if rows is None else len(rows)
        if n == 0:
            return None
        params = self._params[req.model]
        p = req.prompt_tokens
        overlaps: dict[WorkerKey, Overlap] = {}
        if self.use_index:
            for hashes in req.hashes.values():
                if hashes:
                    overlaps.update(self.index.overlaps(hashes))
        size = slots.row(0 if rows is None else int(rows[0])).block_size
        request_blocks = {bs: -(-p // bs) for bs in req.hashes} or {size: -(-p // size)}
        cost = slots.costs(
            rows, params, p, overlaps=overlaps, request_blocks=request_blocks,
            booked_shared=self._booked_shared(req, slots),
        )
        i = pick_index(cost, params.router_temperature, self.rng)
        chosen = slots.row(i if rows is None else int(rows[i]))
        return chosen, overlaps.get(chosen.key, NO_OVERLAP), float(cost[i]), n

    def _booked_shared(self, req: RoutingRequest, slots: Mapping[WorkerKey, Slot]) -> dict[WorkerKey, int]:
        """Blocks of the request already booked on each rank for other requests."""
        shared: dict[WorkerKey, int] = {}
        for key in self.bookings.keys():
            rank = self.bookings.rank(key)
            slot = slots.get(key)
            if rank is None or slot is None:
                continue
            hashes = req.hashes.get(slot.block_size, ())
            shared[key] = sum(1 for h in hashes if h in rank.blocks)
        return shared

    def _select_pinned(
        self, req: RoutingRequest, seq: int, revisions: dict[str, int], pool: WorkerRole, pin: Pin,
        then_decode: bool,
    ) -> Selection:
        model = req.model

        def busy(state: WorkerState, rank: int) -> bool:
            slot = self._slots[model].get((state.instance_id, rank))
            return slot is not None and slot.busy

        state, rank = resolve_pin(
            pin, self.discovery, model=model, pool=pool, now=self.clock(), rank_busy=busy,
        )
        slot = self._slots[model].get((state.instance_id, rank))
        if slot is None:  # role mismatch is caught by resolve_pin; this is a bug
            raise RudderError(f"no slot for pinned worker {state.instance_id} rank {rank}")
        overlap = NO_OVERLAP
        hashes = req.hashes.get(slot.block_size, ())
        if self.use_index and hashes:
            overlap = self.index.overlaps(hashes).get(slot.key, NO_OVERLAP)
        return self._book(
            req, seq, revisions, slot, overlap, None, 1, pinned=True, disaggregated=then_decode
        )

    def _book(
        self, req: RoutingRequest, seq: int, revisions: dict[str, int], slot: Slot,
        overlap: Overlap, cost: float | None, candidates: int, *, pinned: bool = False,
        disaggregated: bool = False,
    ) -> Selection:
        p = req.prompt_tokens
        # As vLLM does (and the mock engine), the last prompt token is always computed, so a hit
        # covers at most the full blocks before it: a prompt of exactly k blocks hits k - 1.
        cached = min(overlap.total, max(p - 1, 0) // slot.block_size) * slot.block_size
        hashes = req.hashes.get(slot.block_size, ())
        booking_id = req.request_id + PREFILL_BOOKING if disaggregated else req.request_id
        self.bookings.book(
            booking_id, slot.key, model=req.model, prefill_tokens=p - cached, hashes=hashes
        )
        if self.approximate and hashes:
            self.index.record(slot.key, hashes, now=self.clock(), ttl=self.approx_ttl_s)
        self._refresh_slot(req.model, slot.key)
        self.stats["selections"] += 1
        log.debug(
            "request %s → %s worker %s rank %d (cost %s, overlap %d blocks, revisions %s)",
            req.request_id, slot.role.value, slot.instance_id, slot.dp_rank, cost, overlap.total,
            revisions,
        )
        return Selection(
            request_id=req.request_id, model=req.model, instance_id=slot.instance_id,
            dp_rank=slot.dp_rank, url=slot.url, revisions=revisions, seq=seq, cost=cost,
            overlap_blocks=overlap.total, cached_tokens=cached, prompt_tokens=p,
            candidates=candidates, pinned=pinned, pool=slot.role, booking_id=booking_id,
            disaggregated=disaggregated,
        )

    # -- the view the HTTP side reads -----------------------------------------------------------

    def _publish_view(self) -> None:
        block_sizes: dict[str, set[int]] = {m: set() for m in self.models}
        tokenizers: dict[str, set[str]] = {m: set() for m in self.models}
        workers: dict[str, int] = dict.fromkeys(self.models, 0)
        for state in self.discovery.workers.values():
            rec = state.record
            if rec.model in block_sizes and rec.role in self.pools:
                block_sizes[rec.model].add(rec.block_size)
                tokenizers[rec.model].add(rec.tokenizer)
                workers[rec.model] += 1
        self.view = RouterView(
            ready=self._ready,
            block_sizes={m: frozenset(v) for m, v in block_sizes.items()},
            tokenizers={m: frozenset(v) for m, v in tokenizers.items()},
            workers=workers,
            applied=self.policy.applied(),
        )


async def cancel_quietly(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
