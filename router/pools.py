"""The scheduler's pools and load tables: one persistent :class:`Slot` per (worker, dp rank).

For speed at thousands of workers each (worker, dp rank) has one slot (a
:class:`~router.cost.common.Candidate`), updated in place when its load, bookings, health, busy flag
or timing model change, so a selection only scans the eligible slots once. Each (model, worker
role) pool is a :class:`~router.loadvec.LoadTable` that mirrors its slots as numpy columns.

Owned by the scheduler actor (never touched from another task). Pure: the clock is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NoReturn

from controlplane.protocol.errors import Overloaded, ServiceUnavailable
from controlplane.protocol.events import WorkerRole
from router.bookings import Bookings
from router.busy import Thresholds, rank_busy
from router.cost.common import Candidate
from router.cost.time import Timing
from router.discovery import Discovery, Health, WorkerState
from router.index import WorkerKey
from router.loadvec import LoadTable, Selectable
from router.peers import PeerLoads
from router.returns import Returns


class Slot(Candidate):
    """A candidate kept between selections, with what eligibility needs."""

    __slots__ = ("busy", "healthy", "role", "url")

    def __init__(self, state: WorkerState, dp_rank: int, timing: Timing | None = None) -> None:
        rec = state.record
        super().__init__(rec.instance_id, dp_rank, rec.block_size, 0, 0, 0,
                         kv_total_blocks=rec.kv_total_blocks,
                         batch_tokens=rec.max_num_batched_tokens, timing=timing)
        self.busy = False
        self.healthy = True
        self.url = rec.url
        self.role = rec.role


def selectable(slot: Slot) -> bool:
    """Whether a slot may be chosen by a selection that names no target."""
    return slot.healthy and not slot.busy


class Pools:
    """Every slot of every served model, by model and by (model, role) pool."""

    def __init__(
        self, *, models: Sequence[str], roles: Iterable[WorkerRole], discovery: Discovery,
        bookings: Bookings, clock: Callable[[], float], timing: Callable[[int], Timing | None],
        peers: PeerLoads | None = None,
    ) -> None:
        self.roles = frozenset(roles)
        self.discovery = discovery
        self.bookings = bookings
        self.peers = peers if peers is not None else PeerLoads(stale_s=1.0)  # other replicas' bookings (router.peers)
        self.clock = clock
        self.timing = timing  # worker id → its current timing model (the calibration's)
        self.returns = Returns()  # requests expected back on each rank (the time cost's λ)
        self.slots: dict[str, dict[WorkerKey, Slot]] = {m: {} for m in models}  # every pool
        self.tables: dict[tuple[str, WorkerRole], LoadTable[Slot]] = {
            (m, p): LoadTable(selectable) for m in models for p in self.roles
        }
        self.thresholds: dict[str, Thresholds] = {}
        # With ``defer`` (the scheduler's actor runs), slots whose bookings changed since they
        # were last re-read ((model, key) → whether their returns' rate changed too), re-read
        # once by :meth:`settle`: a request's commands change its slot's bookings two or three
        # times between two selections, and each re-read cost as much as the change itself.
        # ``defer`` is called when the first of them is noted (none was pending): the actor
        # then settles them at the end of its turn of the event loop.
        self.defer: Callable[[], None] | None = None
        self._unsettled: dict[tuple[str, WorkerKey], bool] = {}

    def table(self, model: str, role: WorkerRole) -> LoadTable[Slot]:
        return self.tables[(model, role)]

    def of_worker(self, wid: int) -> list[Slot]:
        state = self.discovery.get(wid)
        if state is None:
            return []
        slots = self.slots.get(state.record.model, {})
        return [s for k, s in slots.items() if k[0] == wid]

    def forget(self, wid: int) -> None:
        self.returns.forget(k for slots in self.slots.values() for k in slots if k[0] == wid)
        for slots in (*self.slots.values(), *self.tables.values()):
            for key in [k for k in slots if k[0] == wid]:
                del slots[key]

    def rebuild_worker(self, wid: int) -> None:
        """Make the worker's slots match its record (dp ranks, role, block size, URL)."""
        state = self.discovery.get(wid)
        if state is None:
            return
        rec = state.record
        model, role = rec.model, rec.role
        if role not in self.roles:
            return
        slots = self.slots[model]
        pool = self.tables[(model, role)]
        size = rec.dp_size
        for key in [k for k in slots if k[0] == wid and (k[1] >= size or slots[k].role is not role)]:
            self.tables[(model, slots[key].role)].pop(key, None)
            del slots[key]
        timing = self.timing(wid)
        for rank in range(size):
            slot = slots.get((wid, rank))
            if (slot is None or slot.block_size != rec.block_size
                    or slot.kv_total_blocks != rec.kv_total_blocks
                    or slot.batch_tokens != rec.max_num_batched_tokens):
                slot = slots[(wid, rank)] = pool[(wid, rank)] = Slot(state, rank, timing)
            slot.url = rec.url
            slot.timing = timing
            self.refresh_slot(model, (wid, rank), state)

    def set_timing(self, wid: int, timing: Timing) -> None:
        for slot in self.of_worker(wid):
            slot.timing = timing
            slot.touch()

    def refresh_worker(self, wid: int) -> None:
        state = self.discovery.get(wid)
        if state is not None:
            for rank in range(state.record.dp_size):
                self.refresh_slot(state.record.model, (wid, rank), state)

    def booked(self, model: str, key: WorkerKey, *, rate: bool = True) -> None:
        """The slot's bookings changed (and with ``rate``, its expected returns): it is re-read
        (:meth:`refresh_slot`, its health aside) at once, or with ``defer`` at the next
        :meth:`settle` (``defer`` called if it is the first slot noted since the last)."""
        defer = self.defer
        if defer is None:
            self.refresh_slot(model, key, health=False, rate=rate)
            return
        k = (model, key)
        unsettled = self._unsettled
        if not unsettled:
            defer()
        if rate or k not in unsettled:
            unsettled[k] = rate or unsettled.get(k, False)

    def settle(self) -> None:
        """Re-read every slot whose bookings changed since :meth:`booked` noted it: before a
        selection, and before anything else reads the slots (the scheduler's commands but a
        request's own)."""
        unsettled = self._unsettled
        if unsettled:
            self._unsettled = {}
            for (model, key), rate in unsettled.items():
                self.refresh_slot(model, key, health=False, rate=rate)

    def refresh_slot(self, model: str, key: WorkerKey, state: WorkerState | None = None, *,
                     health: bool = True, rate: bool = True) -> None:
        """Re-read a slot's load figures (the larger of the bookings, this router's and its peers',
        and the worker's last report: router.peers) and busy flag, with ``health`` its health and
        with ``rate`` its expected returns' rate. A request's own commands change neither its
        worker's health nor, but for the returns it opens and closes, the rate: they leave them
        out (:meth:`refresh_health` re-reads both every tick)."""
        slot = self.slots[model].get(key)
        if slot is None:
            return
        if state is None:
            state = self.discovery.get(key[0])
            if state is None:
                return
        reported = state.load.get(key[1])
        booked = self.bookings.rank(key)
        prefill, blocks, requests = (
            (booked.prefill_tokens, len(booked.blocks), booked.requests) if booked else (0, 0, 0))
        peer = self.peers.total(key)
        if peer is not None:
            prefill, blocks, requests = (prefill + peer.prefill_tokens, blocks + peer.blocks,
                                         requests + peer.requests)
        if reported is not None:  # the larger of each (compared inline: three calls a refresh fewer)
            if reported.active_prefill_tokens > prefill:
                prefill = reported.active_prefill_tokens
            if reported.active_decode_blocks > blocks:
                blocks = reported.active_decode_blocks
            if reported.running + reported.waiting > requests:
                requests = reported.running + reported.waiting
        slot.active_prefill_tokens, slot.decode_blocks, slot.active_requests = prefill, blocks, requests
        if health or rate:
            now = self.clock()
            if health:
                slot.healthy = self.discovery.health(state, now) is Health.LIVE
            if rate:
                slot.arrival_rate = self.returns.rate(key, now)
        self.refresh_busy(model, slot, state)

    def refresh_busy(self, model: str, slot: Slot, state: WorkerState | None = None) -> None:
        slot.touch()  # its load figures or flags change: its pool's LoadTable re-reads it
        th = self.thresholds[model]
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

    def refresh_health(self, now: float) -> None:
        for slots in self.slots.values():
            for slot in slots.values():
                state = self.discovery.get(slot.instance_id)
                if state is not None:
                    healthy = self.discovery.health(state, now) is Health.LIVE
                    rate = self.returns.rate(slot.key, now)
                    if healthy != slot.healthy or rate != slot.arrival_rate:  # else nothing to re-read
                        slot.healthy, slot.arrival_rate = healthy, rate
                        slot.touch()

    # -- what a selection asks of the pools --------------------------------------------------

    def eligible(self, model: str, table: LoadTable[Slot], pool: WorkerRole,
                 exclude: frozenset[int]) -> Selectable[Slot]:
        """The slots a selection without a target may choose, in row order, with their time rows
        (shared with the table: not to be modified). Raises as :meth:`none_eligible` when there
        is none."""
        eligible = table.selectable(exclude)
        if not eligible.candidates:
            self.none_eligible(model, table, pool, exclude)
        return eligible

    def none_eligible(self, model: str, table: LoadTable[Slot], pool: WorkerRole,
                      exclude: frozenset[int]) -> NoReturn:
        """Raises the error that fits a pool with no eligible rank: Overloaded (all busy) or
        ServiceUnavailable (none reachable)."""
        where = "" if pool is WorkerRole.AGGREGATED else f" in the {pool.value} pool"
        if any(s.healthy and s.instance_id not in exclude for s in table.values()):
            raise Overloaded(f"every worker of model {model}{where} is busy", model=model)
        raise ServiceUnavailable(f"no worker available for model {model}{where}", retry_after=1)

    def booked_shared(self, hashes: Mapping[int, Sequence[int]],
                      slots: Mapping[WorkerKey, Slot]) -> dict[WorkerKey, int]:
        """Blocks of the request (its chain hashes by block size) already booked on each rank for
        other requests. Bookings hold whole prompts' chain hashes, and a chain hash names its whole
        prefix, so the request's booked blocks on a rank are a leading run: counted up to the
        first one that is not there."""
        shared: dict[WorkerKey, int] = {}
        for key in self.bookings.keys():
            rank = self.bookings.rank(key)
            slot = slots.get(key)
            if rank is None or slot is None:
                continue
            blocks = rank.blocks
            n = 0
            for h in hashes.get(slot.block_size, ()):
                if h not in blocks:
                    break
                n += 1
            shared[key] = n
        return shared
