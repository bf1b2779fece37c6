"""The scheduler actor: the one owner of a router's routing state (DESIGN §5).

Effective policy, the discovery snapshot, the prefix index, bookings, busy flags and the workers'
timing models live here and nowhere else. Everything that reads or changes them arrives as a
typed command (:mod:`router.commands`) on one queue and is handled, one at a time, in
:meth:`Scheduler._dispatch`; a handler never awaits, so a policy change lands between two
selections, never inside one, and queued selections survive it. The queue has two lanes: what
says whether workers are alive (membership, ticks, the bus's health, an unreachable worker) goes
ahead of the requests' commands, so that a backlog of requests never ages a worker's heartbeat.

Other tasks send a command and await its future. A selection whose future is already done (its
client went away and cancelled it) is skipped. :meth:`Scheduler.stop` answers every waiter still
queued with ``ServiceUnavailable`` and then returns; an unexpected error in a handler fails that
command's future (logged with its traceback) and the actor carries on.

The pure parts it drives: :mod:`router.pools` (slots and load tables), :mod:`router.choose`
(the routing mode's choice of a rank, by :mod:`router.cost`), :mod:`router.calibration`
(per-worker timing fit), :mod:`router.index`, :mod:`router.bookings`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from controlplane.protocol.errors import (
    InvalidRequest,
    QueueFull,
    RudderError,
    ServiceUnavailable,
)
from controlplane.protocol.events import (
    KvDumpReply,
    KvEvent,
    MembershipEvent,
    RouterRole,
    WorkerCalibration,
    WorkerQuarantine,
    WorkerRole,
    utcnow,
)
from controlplane.protocol.policy import CacheInput, Number, PolicyKind
from controlplane.protocol.signing import Keyring
from router.bookings import Booking, Bookings
from router.busy import Thresholds
from router.calibration import Calibration, Calibrations, Pending
from router.choose import Choice, Chooser
from router.claims import CacheOutcomes, ClaimCaps
from router.commands import (
    PREFILL_BOOKING,
    ApplyFits,
    ApplyKvEvents,
    ApplyMembership,
    ApplyPeerLoad,
    ApplyPolicy,
    BusHealth,
    Command,
    DiscoveryComplete,
    Inspect,
    LoadKvDump,
    MarkUnavailable,
    PolicyApplied,
    RequestDone,
    RequestFirstToken,
    RestorePolicy,
    ResyncPolicy,
    Revisions,
    RouterView,
    RoutingRequest,
    Selection,
    SelectWorker,
    TakeBookings,
    TakeFitWindows,
    Tick,
    UseVerifyKeys,
)
from router.cost.common import SelectionParams
from router.cost.time import DEFAULT_TIMING, Timing, predict_row, time_row
from router.decisions import DecisionLog
from router.discovery import Change, Discovery, Health, SamePool, WorkerState
from router.index import KvApplied, PrefixIndex, WorkerKey
from router.peers import Outbox, PeerLoads, apply_returns
from router.policy_state import ApplyResult, Outcome, PolicyState
from router.pools import Pools, Slot
from router.settings import RoutingMode
from router.targets import pool_of
from router.timing_fit import PrefillObservation

log = logging.getLogger(__name__)

# How long the actor handles queued commands in one turn of the event loop before it lets the
# others run (a command that alone takes longer, a large KV event, still gets its own turn): at
# least _TURN_S, and while commands wait, as long as the rest of the loop took since its last
# turn, up to _TURN_MAX_S (docs/decisions.md 107).
_TURN_S = 0.0005
_TURN_MAX_S = 0.01
T = TypeVar("T")
_STOP = object()


class Scheduler:
    def __init__(
        self, *, router_id: str, models: Sequence[str], role: RouterRole, mode: RoutingMode,
        kv_events: bool, cache_inputs: frozenset[CacheInput],
        startup: dict[PolicyKind, dict[str, Number | None]],
        worker_ttl_s: float, worker_stale_s: float, bus_outage_grace_s: float = 30.0, approx_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], datetime] = utcnow,
        keyring: Keyring, rng: random.Random | None = None, max_queued_selections: int | None = None,
        decisions: DecisionLog | None = None, background_fits: bool = False,
        caps: ClaimCaps | None = None, peer_stale_s: float = 1.5, peer_sync: bool = False,
    ) -> None:
        self.router_id = router_id
        # What a worker's own word is believed up to (router.claims): its timing prior, the blocks
        # of it the prefix index holds.
        self.caps = caps or ClaimCaps()
        # KV claims checked against what each worker delivers (router.claims.CacheOutcomes).
        self.outcomes = CacheOutcomes()
        # Timing priors checked against measured TTFT (router.claims.TimingOutcomes).
        self.timing_outcomes = self.caps.timing_outcomes()
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
        self.approximate = mode.kv_aware and not kv_events
        self.use_index = mode.kv_aware and role is not RouterRole.DECODE
        self.approx_ttl_s = approx_ttl_s
        self.clock = clock
        self.wall = wall
        self.policy = PolicyState(
            router_id=router_id, models=models, startup=startup, cache_inputs=cache_inputs,
            keyring=keyring,
        )
        self.discovery = Discovery(ttl_s=worker_ttl_s, stale_s=worker_stale_s, models=frozenset(models),
                                   outage_grace_s=bus_outage_grace_s)
        self.index = PrefixIndex()
        self.bookings = Bookings()
        # Other router replicas' bookings (router.peers; empty unless router.peersync runs).
        self.peers = PeerLoads(stale_s=peer_stale_s)
        # With peer_sync, the expected-returns events peers must hear of (TakeBookings takes them):
        # requests finished here (rank, last block hash, when) and entries closed here.
        self.peer_sync = peer_sync
        self.outbox = Outbox()
        # Per-worker timing models (router.calibration) and the predictions awaiting their outcome.
        # With background_fits (a router process) the actor only records observations and a
        # router.fitting.Fitter task fits them (TakeFitWindows, ApplyFits); without, they are
        # fitted as they come (the pure core's tests, the simulator).
        self.timings = Calibrations(models, inline=not background_fits)
        self._epochs: dict[str, Number | None] = {}
        self.tables = Pools(
            models=models, roles=self.pools, discovery=self.discovery, bookings=self.bookings,
            clock=clock, timing=self.timings.timing, peers=self.peers,
        )
        # Where a selection goes: its pool, its rank (and the round-robin positions, the objective counters).
        self.chooser = Chooser(mode=mode, role=role, models=models, pools=self.tables, discovery=self.discovery,
                               index=self.index if self.use_index else None, rng=rng or random.Random(),
                               decisions=decisions)
        self._params: dict[str, SelectionParams] = {}
        self._revisions: dict[str, Revisions] = {}  # model → revisions (Scheduler.revisions)
        for m in models:
            self._refresh_policy(m)
        self.view = RouterView(applied=self.policy.applied())
        self._ready = False
        # (lane, seq, command): the liveness lane (0) ahead of the rest (1), each in order; the
        # stop (2) after everything queued before it.
        self._queue: asyncio.PriorityQueue[tuple[int, int, Any]] = asyncio.PriorityQueue()
        self._seq = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The slots' re-read after a request's commands, due at the end of this turn of the loop.
        self._settling: asyncio.Handle | None = None
        self._stopping = False
        self._handling = False  # inside a handler: a command sent meanwhile is queued, not nested
        self.stats: dict[str, int] = {"selections": 0, "skipped": 0, "applied": 0, "nacked": 0}
        # With a clock (tests, diagnostics: ``time.thread_time`` counts the actor's own CPU, not
        # preemption or waits for the GIL), the longest handling of each command type, in
        # seconds: its bound is what keeps selections from waiting behind the work of others.
        # Off by default: a thread-CPU clock read is a system call, twice per command.
        self.handling_clock: Callable[[], float] | None = None
        self.slowest: dict[str, float] = {}
        # The clock a turn of the actor is timed by (a test replaces it: a compiled module's
        # globals cannot be patched).
        self.turn_clock: Callable[[], float] = time.perf_counter

    @property
    def calibration(self) -> dict[int, Calibration]:
        return self.timings.workers

    @property
    def _slots(self) -> dict[str, dict[WorkerKey, Slot]]:
        self.tables.settle()  # the slots as their bookings have them
        return self.tables.slots

    @property
    def _thresholds(self) -> dict[str, Thresholds]:
        return self.tables.thresholds

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self.tables.defer = self._settle_soon  # the slots' re-reads after a request's commands: once a turn
            self._task = asyncio.create_task(self._run(), name=f"scheduler-{self.router_id}")
        return self._task

    async def stop(self) -> None:
        """Stop taking commands, answer every waiter still queued, and end the actor."""
        if self._stopping:
            if self._task is not None:
                await asyncio.shield(self._task)
            return
        self._stopping = True
        self._queue.put_nowait((2, 0, _STOP))
        if self._task is not None:
            await self._task
        else:
            self._drain()

    def _drain(self) -> None:
        self.tables.defer = None  # the actor has stopped: re-read at once again, from now on
        self.tables.settle()
        while True:
            try:
                _, _, cmd = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if isinstance(cmd, SelectWorker):
                self._queued_selections -= 1
            if isinstance(cmd, Command) and cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(ServiceUnavailable("router is stopping", retry_after=1))

    async def _run(self) -> None:
        queue = self._queue
        now = self.turn_clock
        ended = now()  # when the last turn ended
        try:
            while True:
                _, _, cmd = await queue.get()
                # Queued commands for a turn (a handler never awaits), then the loop breathes if
                # more are waiting: the queue never empties under load, and NATS, HTTP and the
                # commands' senders must keep running meanwhile. One turn per command cost the
                # actor a task step per command, and a request sends three or four. A turn lasts
                # _TURN_S, or as long as the rest of the loop took since the last one (up to
                # _TURN_MAX_S): with thousands of connections the loop's other callbacks take
                # far longer than _TURN_S, and a fixed turn then left the actor a sliver of the
                # loop, its queue growing by thousands of commands a second (decision 107).
                began = now()
                until = began + min(max(_TURN_S, began - ended), _TURN_MAX_S)
                while True:
                    if cmd is _STOP:
                        return
                    self._handle_timed(cmd)
                    if queue.empty() or now() >= until:
                        break
                    _, _, cmd = queue.get_nowait()
                ended = now()
                if not queue.empty():
                    await asyncio.sleep(0)
        finally:
            self._drain()

    def _handle_timed(self, cmd: Command[Any]) -> None:
        self._handling = True
        try:
            clock = self.handling_clock
            if clock is None:
                self._handle(cmd)
                return
            t0 = clock()
            self._handle(cmd)
            spent = clock() - t0
            name = type(cmd).__name__
            if spent > self.slowest.get(name, 0.0):
                self.slowest[name] = spent
        finally:
            self._handling = False

    def _handle(self, cmd: Command[Any]) -> None:
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

    def submit(self, cmd: Command[T]) -> asyncio.Future[T]:
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
        self._enqueue(cmd)
        return fut

    def select_now(self, request: RoutingRequest) -> Selection | None:
        """The selection made at once, by the caller, when the actor is idle (nothing queued, not
        inside a handler: where the queue would have put it, first) as :meth:`send` does; else
        None, and the caller submits it. Raises what a selection raises."""
        # Idle: the actor runs, waits for a command (nothing queued: the queue's own list read,
        # Queue.empty is a Python call) and is not inside a handler; a command handled now by
        # its sender lands where the queue would have put it. (Tested inline here and in send:
        # they run for every request.)
        task = self._task
        if (self._stopping or self._handling or task is None or task.done()
                or self._queue._queue):  # type: ignore[attr-defined]
            return None
        if self.handling_clock is not None:  # timed, as a queued command is
            cmd = SelectWorker(request)
            fut: asyncio.Future[Selection] = asyncio.get_running_loop().create_future()
            cmd.future = fut
            cmd.seq = next(self._seq)
            self._queued_selections += 1  # as submit counts it (the handler counts it out)
            self._handle_timed(cmd)
            return fut.result()
        # The handler called as the actor would (no command, no future: what it raises, the
        # caller gets).
        self._handling = True
        try:
            return self._select(request, next(self._seq))
        finally:
            self._handling = False

    def send(self, cmd: Command[Any]) -> None:
        """A command nobody waits for (completions, KV events). Dropped when stopping.

        Handled at once when the actor is idle (nothing queued, not inside a handler): that is
        where the queue would have put it, and a request's three or four completions then cost no
        wake-up of the actor each. Otherwise queued behind what waits (a liveness command only
        behind other liveness commands: :attr:`Command.liveness`)."""
        if self._stopping:
            return
        cmd.seq = next(self._seq)
        task = self._task  # idle, as select_now tests it
        if self._handling or task is None or task.done() or self._queue._queue:  # type: ignore[attr-defined]
            self._enqueue(cmd)
        elif self.handling_clock is not None:
            self._handle_timed(cmd)
        else:  # as _handle does for a command nobody waits for
            self._handling = True
            try:
                self._dispatch(cmd)
            except RudderError:
                pass
            except Exception:
                log.exception("scheduler command %s failed", type(cmd).__name__)
            finally:
                self._handling = False

    def _settle_soon(self) -> None:
        """A request's command noted changed bookings, the first since the slots were last
        re-read (``Pools.defer``, called by ``Pools.booked`` once the actor runs): the slots are
        re-read at the end of this turn of the event loop, once for every command of the turn and
        off the path of the request that sent it (its bytes go first), unless a selection or
        another command reads them sooner (they settle first). The pure core driven directly
        (tests, the simulator, bench/selection.py) re-reads at once, as it always did."""
        if self._settling is None and self._loop is not None:
            self._settling = self._loop.call_soon(self._settle_due)

    def _settle_due(self) -> None:
        self._settling = None
        self.tables.settle()  # (a callback between two task steps: never inside a handler)

    def disaggregated(self, model: str) -> bool:
        """Whether the model's requests run in two phases (prefill, then decode): read by the HTTP
        side on the actor's thread while the actor is idle, as :meth:`select_now` does."""
        return self.chooser.disaggregated(model)

    def _enqueue(self, cmd: Command[Any]) -> None:
        """Into its lane: liveness (0) ahead of the rest (1), each in the order sent."""
        self._queue.put_nowait((0 if cmd.liveness else 1, cmd.seq, cmd))

    async def call(self, cmd: Command[T]) -> T:
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

    def _dispatch(self, cmd: Command[Any]) -> Any:
        match cmd:
            # A request's own commands first (a match tries its cases in order).
            case SelectWorker():
                return self._select(cmd.request, cmd.seq)
            case RequestFirstToken():
                self._first_token(cmd.request_id, cmd.ttft_ms, refresh=True)
                return None
            case RequestDone():
                if cmd.first_token:  # its slot is re-read once, below
                    self._first_token(cmd.request_id, cmd.ttft_ms, refresh=False)
                booking = self.bookings.free(cmd.request_id)
                if booking is not None:
                    now = self.clock()
                    self.tables.returns.finished(booking.key, booking.hashes, now)
                    if self.peer_sync and booking.hashes:
                        self.outbox.finish(booking.key, booking.hashes[-1], now)
                    self.tables.booked(booking.model, booking.key)
                for wid in self.timings.done(cmd.request_id, cmd.itl_ms, cmd.decode_tokens):
                    self._retime(wid)
                if cmd.reported_cached is not None:
                    self._cache_outcome(cmd.instance_id, cmd.predicted_cached, cmd.reported_cached)
                return None
        # Every other command may read the slots: as their bookings have them (Pools.settle).
        self.tables.settle()
        match cmd:
            case ApplyPolicy():
                return self._apply_policy(cmd)
            case RestorePolicy():
                restored = self.policy.restore(cmd.model, cmd.kind, cmd.answer, nonce=cmd.nonce)
                return self._policy_result(cmd.model, cmd.kind, restored, cmd.seq)
            case UseVerifyKeys():
                self.policy.use_keyring(cmd.keyring)
                return None
            case ResyncPolicy():
                forgotten = self.policy.resync()
                self._revisions.clear()
                log.warning("policy re-sync (%s): revisions %s forgotten", cmd.reason, forgotten)
                self._publish_view()
                return forgotten
            case ApplyMembership():
                return self._apply_membership(cmd.event, cmd.received_at, live=cmd.live)
            case BusHealth():
                self.discovery.bus_unhealthy(self.clock(), not cmd.can_store)
                return None
            case ApplyKvEvents():
                return self._apply_kv(cmd.events)
            case LoadKvDump():
                return self._load_dump(cmd.instance_id, cmd.reply, stale=cmd.stale, final=cmd.final)
            case TakeFitWindows():
                return self.timings.windows()
            case ApplyFits():
                for wid in self.timings.apply(cmd.results):
                    self._retime(wid)
                return None
            case TakeBookings():
                return self.outbox.take(self.bookings, cmd.since, self.clock())
            case ApplyPeerLoad():
                self._apply_peer(cmd)
                return None
            case MarkUnavailable():
                if self.discovery.mark_unreachable(cmd.instance_id):
                    log.warning("worker %s unreachable until its next heartbeat", cmd.instance_id)
                    self.tables.refresh_worker(cmd.instance_id)
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
        effective = self.policy.get(model, PolicyKind.SELECTION).effective
        params = self._params[model] = SelectionParams.from_values(effective)
        self.tables.thresholds[model] = Thresholds.from_values(
            self.policy.get(model, PolicyKind.BUSY_THRESHOLD).effective
        )
        epoch = effective.get("calibration_epoch")
        reset = model in self._epochs and self._epochs[model] != epoch
        self._epochs[model] = epoch
        for wid in self.timings.configure(model, window=params.calibration_window,
                                          min_samples=params.calibration_min_samples, reset=reset):
            self._retime(wid)
        if reset:
            log.info("model %s: calibration reset (calibration_epoch %s)", model, epoch)

    def _apply_policy(self, cmd: ApplyPolicy) -> PolicyApplied:
        result = self.policy.apply(cmd.model, cmd.kind, cmd.revision, cmd.payload, cmd.headers,
                                   previous=cmd.previous)
        return self._policy_result(cmd.model, cmd.kind, result, cmd.seq)

    def _policy_result(self, model: str, kind: PolicyKind, result: ApplyResult, seq: int) -> PolicyApplied:
        self._revisions.pop(model, None)
        if result.outcome is Outcome.ACK:
            self.stats["applied"] += 1
            self._refresh_policy(model)
            if kind is PolicyKind.BUSY_THRESHOLD:
                for slot in self._slots[model].values():
                    self.tables.refresh_busy(model, slot)
        elif result.outcome is Outcome.NACK:
            self.stats["nacked"] += 1
        if result.outcome is not Outcome.SKIP:
            log.info(
                "policy %s|%s revision %d: %s %s", model, kind.value, result.revision,
                result.outcome.value, result.detail,
            )
            self._publish_view()
        return PolicyApplied(result, seq)

    def revisions(self, model: str) -> Revisions:
        """Revision of each document kind the model's selections run with (one shared mapping
        until a policy event or a re-sync changes one)."""
        revs = self._revisions.get(model)
        if revs is None:
            revs = self._revisions[model] = Revisions({k.value: self.policy.get(model, k).revision
                                                       for k in PolicyKind})
        return revs

    def params(self, model: str) -> SelectionParams:
        return self._params[model]

    # -- membership --------------------------------------------------------------------------

    def _apply_membership(self, event: MembershipEvent, received_at: datetime | None = None, *,
                          live: bool = False) -> Change:
        change = self.discovery.apply(
            event, now=self.clock(), wall_now=self.wall(), received_at=received_at, live=live
        )
        wid = event.worker.instance_id
        if event.load and change is Change.UPDATED:
            # The worker's report counts what peers had booked there until now (router.peers).
            self.peers.supersede(wid)  # its slots are re-read below (rebuild_worker)
        if change is Change.LEFT:
            self._forget(wid, "left")
        elif change is Change.JOINED or change is Change.RESTARTED:
            if change is Change.RESTARTED:  # what the old process held died with it
                self._forget(wid, "restarted (a new process under its instance id)")
            log.info("worker %s joined (%s, %s)", wid, event.worker.model, event.worker.url)
            self._calibrate(wid)
            self._bound_index(wid)
            self.tables.rebuild_worker(wid)
            if self.use_index and self.kv_events:
                self.index.begin_dump(wid)
            self._publish_view()
        elif change is Change.UPDATED:
            self._calibrate(wid)
            self._bound_index(wid)
            self.tables.rebuild_worker(wid)
        return change

    def _forget(self, wid: int, why: str) -> None:
        self.index.remove_worker(wid)
        self.outcomes.forget(wid)
        self.timing_outcomes.forget(wid)
        self.peers.forget_worker(wid)
        dropped = self.bookings.drop_worker(wid)
        self.tables.forget(wid)
        self.timings.forget(wid, (b.request_id for b in dropped))
        log.info("worker %s %s: %d bookings dropped", wid, why, len(dropped))
        self._publish_view()

    def _tick(self) -> list[int]:
        now = self.clock()
        gone = self.discovery.expire(now)
        for wid in gone:
            self._forget(wid, "expired (no heartbeat within the TTL)")
        if self.approximate:
            self.index.expire(now)
        forgotten, changed = self.peers.expire(now)
        if forgotten:
            log.info("peer routers %s forgotten: no bookings from them for %.1fs", forgotten, self.peers.stale_s)
            self._refresh_keys(changed)
        self.tables.refresh_health(now)
        if self._live_counts(now) != self.view.live_workers:
            self._publish_view()
        return gone

    def _live_counts(self, now: float) -> dict[str, int]:
        live: dict[str, int] = dict.fromkeys(self.models, 0)
        for state in self.discovery.workers.values():
            rec = state.record
            if rec.model in live and rec.role in self.pools and self.discovery.health(state, now) is Health.LIVE:
                live[rec.model] += 1
        return live

    # -- calibration (router.calibration) ------------------------------------------------------

    def _calibrate(self, wid: int) -> None:
        """Create the worker's calibration from its advertised timing model, or update its prior."""
        state = self.discovery.get(wid)
        if state is not None:
            params = self._params[state.record.model]
            prior = (DEFAULT_TIMING if wid in self.timing_outcomes.quarantined
                     else self.caps.prior(Timing.from_engine(state.record.timing)))
            for other in self.timings.join(wid, state.record.model, prior, window=params.calibration_window,
                                           min_samples=params.calibration_min_samples):
                self._retime(other)

    def _bound_index(self, wid: int) -> None:
        """The prefix index holds at most the worker's (capped) KV capacity per rank."""
        state = self.discovery.get(wid)
        if state is not None:
            rec = state.record
            quarantined = wid in self.outcomes.quarantined
            cap = 0 if quarantined else self.caps.blocks_per_rank(rec.kv_total_blocks, rec.dp_size)
            self.index.set_capacity(wid, cap)

    def quarantined(self) -> list[tuple[str, int]]:
        """(model, instance id) of each worker whose cache claims are not believed."""
        return [(st.record.model, wid) for wid in sorted(self.outcomes.quarantined)
                if (st := self.discovery.get(wid)) is not None]

    def _cache_outcome(self, wid: int, predicted: int, reported: int) -> None:
        """A worker's answer reported ``reported`` cached tokens where the router predicted
        ``predicted``. Only claims from KV events are checked (approximate mode predicts from its
        own decisions, which no worker asserted)."""
        if not (self.use_index and self.kv_events) or self.discovery.get(wid) is None:
            return
        if self.outcomes.report(wid, predicted, reported):
            log.warning("worker %s quarantined: its cache claims are not delivered (%.0f%% of predicted "
                        "cached tokens reported); its blocks leave the prefix index", wid,
                        100 * (self.outcomes.ratio(wid) or 0.0))
            self.index.clear_worker(wid)
            self._bound_index(wid)

    def quarantine_status(self) -> list[WorkerQuarantine]:
        """Every worker whose cache claims or timing prior this router does not believe (its
        status, so ``rudder workers list`` shows it)."""
        cache, timing = self.outcomes.quarantined, self.timing_outcomes.quarantined
        return [WorkerQuarantine(model=st.record.model, instance_id=wid, cache=wid in cache, timing=wid in timing)
                for wid in sorted(cache | timing) if (st := self.discovery.get(wid)) is not None]

    def index_held(self) -> list[tuple[str, int, int]]:
        """(model, instance id, blocks the prefix index holds of it) of each known worker."""
        return [(st.record.model, wid, n) for wid, n in sorted(self.index.held().items())
                if (st := self.discovery.get(wid)) is not None]

    def in_flight(self) -> list[tuple[str, int, int]]:
        """(model, instance id, requests this router has booked on it and not yet seen done, all
        its ranks) of each known worker, idle ones included."""
        counts: dict[int, int] = {}
        for key in self.bookings.keys():
            rank = self.bookings.rank(key)
            if rank is not None:
                counts[key[0]] = counts.get(key[0], 0) + rank.requests
        return [(st.record.model, wid, counts.get(wid, 0)) for wid, st in sorted(self.discovery.workers.items())]

    def timing_quarantined(self) -> list[tuple[str, int]]:
        """(model, instance id) of each worker whose claimed timing prior is not believed."""
        return [(st.record.model, wid) for wid in sorted(self.timing_outcomes.quarantined)
                if (st := self.discovery.get(wid)) is not None]

    def _claimed_prior(self, wid: int) -> Timing | None:
        """The prior ``wid`` claimed and the router believes, or None (its own prior is in use)."""
        cal = self.timings.workers.get(wid)
        if cal is None or wid in self.timing_outcomes.quarantined:
            return None
        return cal.prior if cal.claimed else None

    def _timing_outcome(self, wid: int, obs: PrefillObservation) -> None:
        """A claimed prior against the TTFT measured: persistently slower than it predicts, and the
        worker loses it (the router's own prior, then the fit of what it measured)."""
        prior = self._claimed_prior(wid)
        if prior is None:
            return
        state = self.discovery.get(wid)
        if state is None:
            return
        peers = SamePool(self.discovery, state.record.model, state.record.role)
        if self.timing_outcomes.report(wid, obs.ttft_ms(prior), obs.measured_ms, now=self.clock(), peers=peers):
            log.warning("worker %s: its claimed timing prior is not believed (measured TTFT %.1fx what it "
                        "predicts); the router's own prior and fit are used", wid,
                        self.timing_outcomes.ratio(wid) or 0.0)
            self._calibrate(wid)
            self._retime(wid)

    # -- router replicas (router.peers) ------------------------------------------------------

    def _apply_peer(self, cmd: ApplyPeerLoad) -> None:
        """A peer's snapshot: its bookings, and the expected returns it opened and closed, so every
        replica expects each session back where its cache is, whichever replica routed its last
        turn (router.peers)."""
        now = self.clock()
        changed = self.peers.apply(cmd.router_id, boot=cmd.boot, seq=cmd.number, ranks=cmd.ranks, now=now)
        if changed is not None:  # else an older snapshot of that peer: its events were applied (or lost)
            self._refresh_keys(changed | apply_returns(self.tables.returns, cmd.finished, cmd.returned, now))

    def _refresh_keys(self, keys: Iterable[WorkerKey]) -> None:
        """Re-read the slots of these ranks (their peers' bookings changed)."""
        for key in keys:
            state = self.discovery.get(key[0])
            if state is not None:
                self.tables.refresh_slot(state.record.model, key, state, health=False)

    def _retime(self, wid: int | None) -> None:
        """A worker's timing model changed: its slots score with the new one."""
        timing = self.timings.timing(wid) if wid is not None else None
        if wid is not None and timing is not None:
            self.tables.set_timing(wid, timing)

    def calibration_status(self) -> list[WorkerCalibration]:
        """Each worker's fitted timing model and prediction error (router status, /metrics)."""
        return self.timings.status()

    def reset_calibration(self, model: str | None = None) -> int:
        """Back to the priors (every model, or one); returns how many workers were reset."""
        reset = self.timings.reset(model)
        for wid in reset:
            self._retime(wid)
        return len(reset)

    # -- KV events ---------------------------------------------------------------------------

    def _apply_kv(self, events: list[KvEvent]) -> list[int]:
        need: list[int] = []
        if not self.use_index or not self.kv_events:
            return need
        for event in events:
            known = self.discovery.get(event.instance_id)
            if known is None:
                continue  # not (or no longer) a worker of ours; its dump comes when it joins
            if self._of_another_process(event.started_at, known):
                # A dead process's late event, or the new one's before its join reached us (the
                # join asks for its dump, which holds this event).
                continue
            applied = self.index.apply(event)
            if applied in (KvApplied.GAP, KvApplied.NEW_WORKER) and self.index.begin_dump(event.instance_id):
                if applied is KvApplied.GAP:  # logged once per dump: a worker making gaps is not a log flood
                    log.warning("KV event gap from worker %s at event %d", event.instance_id, event.event_id)
                need.append(event.instance_id)
        return need

    def _load_dump(self, wid: int, reply: KvDumpReply | None, *, stale: bool = False, final: bool = False) -> bool:
        """Load a worker's dump (None: it did not come). True when another dump is to be asked
        for, the worker's events buffered until it comes: no dump came; the reply is of another
        process than the known one (a dump asked for before a restart, answered by the process
        that was there then) or ``stale`` (another dump was asked for while it was on its way);
        or events are still missing after it (lost on the way while it was pending, past the
        buffer). ``final``: no other dump will be asked for now. What can be taken is (the
        buffer replayed as it is), the answer is False, and if the index may miss events the
        worker's next event asks for a dump again."""
        known = self.discovery.get(wid)
        if known is None:
            self.index.remove_worker(wid)
            return False
        if reply is not None and self._of_another_process(reply.started_at, known):
            reply, stale = None, True
        if not final and (stale or reply is None):
            self.index.begin_dump(wid)  # (still pending, unless the worker was forgotten since)
            return True
        results = self.index.abandon_dump(wid) if reply is None else self.index.load_dump(reply)
        if reply is None or any(r in (KvApplied.GAP, KvApplied.NEW_WORKER) for r in results):
            if not final:
                self.index.begin_dump(wid)
                return True
            self.index.unsure(wid)
            log.warning("worker %s: its index may miss events after its dumps; its next event asks again", wid)
        return False

    def _of_another_process(self, started_at: datetime | None, known: WorkerState) -> bool:
        """Whether a KV event or dump stamped ``started_at`` comes from another process than the
        known one under the worker's id (counted); an unstamped one (KV schema 1) never does."""
        if started_at is None or started_at == known.record.started_at:
            return False
        self.index.other_process += 1
        return True

    def dumps_pending(self) -> list[int]:
        return [w for w in self.discovery.workers if self.index.dump_pending(w)]

    # -- selection ---------------------------------------------------------------------------

    def _select(self, req: RoutingRequest, seq: int) -> Selection:
        model = req.model
        tables = self.tables
        tables.settle()  # (what the _slots property does, inline: this runs for every request)
        if model not in tables.slots:
            raise InvalidRequest(f"model {model!r} is not served by this router", field="model")
        revisions = self.revisions(model)
        pool, pin, then_decode = self.chooser.plan(req)
        decode_tokens = self.timings.decode_tokens[model].value
        if pin is not None:
            choice = self.chooser.pinned(req, pool, pin, self.clock())
        else:
            choice = self.chooser.choose(req, tables.tables[(model, pool)], pool, self._params[model], decode_tokens)
        if choice.record is not None:  # a sampled decision (router.decisions)
            choice.record.revisions = dict(revisions)
            choice.record.router_id = self.router_id
        return self._book(req, seq, revisions, choice, pinned=pin is not None, disaggregated=then_decode,
                          decode_tokens=decode_tokens)

    def _book(
        self, req: RoutingRequest, seq: int, revisions: Revisions, choice: Choice, *, pinned: bool,
        disaggregated: bool, decode_tokens: float,
    ) -> Selection:
        slot, overlap, cost = choice.slot, choice.overlap, choice.cost
        p = req.prompt_tokens
        hit = overlap.total
        # As vLLM does (and the mock engine), the last prompt token is always computed, so a hit
        # covers at most the full blocks before it: a prompt of exactly k blocks hits k - 1.
        cached = min(hit, max(p - 1, 0) // slot.block_size) * slot.block_size
        hashes = req.hashes.get(slot.block_size, ())
        booking_id = req.request_id + PREFILL_BOOKING if disaggregated else req.request_id
        if booking_id in self.bookings:  # a request id is the client's to choose (x-request-id): one
            booking_id = self._free_booking_id(booking_id, seq)  # in flight keeps its booking
        # What the chosen worker's timing model predicts (before this request is booked there),
        # kept until the first token and the end to feed its calibration.
        params = self._params[req.model]
        table = self.tables.tables.get((req.model, slot.role))
        row = table.current_time_row(slot) if table is not None else time_row(slot)
        pred = predict_row(row, params, p, overlap, least_prefill=slot.active_prefill_tokens,
                           decode_tokens=decode_tokens, uncached_tokens=float(p - cached))
        self.timings.expect(booking_id, Pending(slot.instance_id, req.model, pred, slot.batch_tokens or 8192))
        now = self.clock()
        self.bookings.book(
            booking_id, slot.key, model=req.model, prefill_tokens=p - cached, hashes=hashes, at=now
        )
        if self.approximate and hashes:
            self.index.record(slot.key, hashes, now=now, ttl=self.approx_ttl_s)
        self.tables.booked(req.model, slot.key, rate=False)
        self.stats["selections"] += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s → %s worker %s rank %d (cost %s, overlap %d blocks, predicted TTFT %.1f "
                "ms, revisions %s)", req.request_id, slot.role.value, slot.instance_id, slot.dp_rank,
                cost, hit, pred.ttft_ms, revisions,
            )
        return Selection(
            request_id=req.request_id, model=req.model, instance_id=slot.instance_id,
            dp_rank=slot.dp_rank, url=slot.url, revisions=revisions, seq=seq, cost=cost,
            overlap_blocks=hit, cached_tokens=cached, prompt_tokens=p,
            candidates=choice.candidates, pinned=pinned, pool=slot.role, booking_id=booking_id,
            disaggregated=disaggregated, predicted_ttft_ms=pred.ttft_ms, slo_predicted_met=choice.slo_met,
        )

    def _free_booking_id(self, taken: str, seq: int) -> str:
        """A booking id not in use for a request whose id (``taken``) is: ``taken#seq``, or with a
        further count if a client named one of those too (its ids are its own to choose: a
        crafted ``x-request-id`` must not take another request's booking or its timing)."""
        booking_id = f"{taken}#{seq}"
        n = 0
        while booking_id in self.bookings:
            n += 1
            booking_id = f"{taken}#{seq}.{n}"
        return booking_id

    def _first_token(self, request_id: str, ttft_ms: float | None, *, refresh: bool) -> None:
        """A request's first token: its booking's prefill is done (its slot re-read if
        ``refresh``: else the caller re-reads it), the return it was is matched, and its TTFT
        feeds its worker's calibration."""
        booking = self.bookings.first_token(request_id)
        if booking is None:
            return
        back = self._returned(booking)
        if refresh:
            self.tables.booked(booking.model, booking.key, rate=back == booking.key)
        if ttft_ms is not None:
            found = self.timings.observation(request_id, ttft_ms)
            if found is not None:
                self._timing_outcome(*found)
                for wid in self.timings.observe_first_token(*found):
                    self._retime(wid)

    def _returned(self, booking: Booking) -> WorkerKey | None:
        """A request that got its first token: if it is the return of one that finished earlier
        (router.returns), the rank that held it expects it no more (re-read here unless it is the
        booking's own, which the caller re-reads); that rank, else None. Matched here rather than
        at selection, off the selection's path (the request's own entry counts for its holder in
        the meantime: its wait term there is about λ·D², a D of tens of ms for a cached turn)."""
        entry = self.tables.returns.arrived_entry(booking.hashes, booking.booked_at)
        if entry is None:
            return None
        back, h = entry
        if self.peer_sync:
            self.outbox.close(h)
        if back != booking.key:
            self.tables.booked(booking.model, back)
        return back

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
            live_workers=self._live_counts(self.clock()),
        )

