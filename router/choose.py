"""Where a selection goes (DESIGN §5): its pool, then the rank its explicit target names or the
routing mode's choice among the pool's eligible ranks.

An aggregated router selects in the aggregated pool, or, for a model whose snapshot holds
prefill and decode workers, in the prefill pool first (a decode selection follows); a prefill or
decode router in its own pool only. A target (pin) is never rerouted (:mod:`router.targets`).

``kv``, ``kv-time`` and ``kv-blocks`` score every eligible rank of the pool with the mode's cost
(:mod:`router.cost`: which cost each mode means is ``RoutingMode.cost``) and pick; a request with
a TTFT objective is scored with the time cost too, for its predicted TTFT, and picked among the
ranks predicted to meet it. ``round_robin``, ``random`` and ``least_loaded`` are comparison modes:
load only, no cache credit.

A pool of fewer than :data:`VECTOR_MIN_CANDIDATES` ranks is scored by the scalar form of its cost
over the rows its load table keeps; a larger one by the vectorised form over the table's numpy
columns. The same candidates in the same order either way, so ties break with the same random
draw.

Owned by the scheduler actor (router.scheduler), which books the choice and passes in what
changes with policy and calibration. Pure: no I/O, the clock is passed in.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from controlplane.protocol.errors import Overloaded, RudderError
from controlplane.protocol.events import RouterRole, WorkerRole
from router.commands import Phase, RoutingRequest
from router.cost.blocks import costs, vector_costs
from router.cost.common import (
    NO_OVERLAP,
    Candidate,
    Overlap,
    SelectionParams,
    WorkerKey,
    consolidate,
    pick,
    pick_index,
)
from router.cost.time import row_costs, vector_time_costs
from router.discovery import Discovery, WorkerState
from router.index import PrefixIndex
from router.loadvec import LoadTable
from router.pools import Pools, Slot
from router.settings import RoutingMode
from router.targets import Pin, pool_of, prefill_not_allowed, resolve_pin

# Below this many ranks the scalar form of a cost is as fast or faster (measured with
# bench/selection.py on 2 cores: equal at ~100, numpy ahead from 128, 4x ahead at 4096).
VECTOR_MIN_CANDIDATES = 96


class Choice(NamedTuple):
    """The chosen rank, what it holds of the prompt, its cost (None in a comparison mode), how
    many ranks were candidates, and whether it is predicted to meet the request's TTFT objective
    (None without one)."""

    slot: Slot
    overlap: Overlap
    cost: float | None
    candidates: int
    slo_met: bool | None


@dataclass(slots=True)
class Scored:
    """One selection's candidates and what the cost said of them."""

    slots: Sequence[Slot]  # the eligible slots, in row order (scalar form; () for the vectorised)
    rows: Any  # numpy rows into the table, or None (every row / the list itself)
    table: LoadTable[Slot] | None  # the table whose columns were scored (vectorised form), else None
    overlaps: dict[WorkerKey, Overlap]
    cost: Any  # list[float] or numpy array
    ttft: Any  # list[float] or numpy array or None (block cost without an objective)

    def slot(self, i: int) -> Slot:
        """The candidate at index ``i`` of :attr:`cost`."""
        if self.table is None:
            return self.slots[i]
        return self.table.row(i if self.rows is None else int(self.rows[i]))


class Chooser:
    """A scheduler's choice of a pool and a rank. Owns the round-robin positions and the TTFT
    objective's counters (per model); reads the scheduler's pools, discovery snapshot and prefix
    index (None when the mode or the router's role reads no cache)."""

    def __init__(self, *, mode: RoutingMode, role: RouterRole, models: Sequence[str], pools: Pools,
                 discovery: Discovery, index: PrefixIndex | None, rng: random.Random) -> None:
        self.mode = mode
        self.cost_mode = mode.cost  # KV_BLOCKS, KV_TIME or None (load-only)
        self.role = role
        self.pool = pool_of(role)
        self.pools = pools
        self.discovery = discovery
        self.index = index
        self.rng = rng
        self.round_robin = {m: RoundRobin() for m in models}
        self.slo = {m: {"requests": 0, "predicted_met": 0, "rejected": 0} for m in models}

    def disaggregated(self, model: str) -> bool:
        """The model's snapshot holds prefill and decode workers (and this router runs both)."""
        tables = self.pools.tables
        return bool(
            self.role is RouterRole.AGGREGATED
            and tables[(model, WorkerRole.PREFILL)] and tables[(model, WorkerRole.DECODE)]
        )

    def plan(self, req: RoutingRequest) -> tuple[WorkerRole, Pin | None, bool]:
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
        tables = self.pools.tables
        if not tables[(req.model, WorkerRole.AGGREGATED)] and tables[(req.model, WorkerRole.DECODE)]:
            # Decode workers and no prefill worker: they prefill locally (as vLLM does without
            # remote KV), so they serve whole requests rather than none.
            return WorkerRole.DECODE, decode_pin, False
        return WorkerRole.AGGREGATED, decode_pin, False

    def pinned(self, req: RoutingRequest, pool: WorkerRole, pin: Pin, now: float) -> Choice:
        """The rank a target names in ``pool``. Raises as :func:`router.targets.resolve_pin`."""
        model = req.model
        slots = self.pools.slots[model]

        def busy(state: WorkerState, rank: int) -> bool:
            slot = slots.get((state.instance_id, rank))
            return slot is not None and slot.busy

        state, rank = resolve_pin(pin, self.discovery, model=model, pool=pool, now=now, rank_busy=busy)
        slot = slots.get((state.instance_id, rank))
        if slot is None:  # role mismatch is caught by resolve_pin; this is a bug
            raise RudderError(f"no slot for pinned worker {state.instance_id} rank {rank}")
        overlap = NO_OVERLAP
        hashes = req.hashes.get(slot.block_size, ())
        if self.index is not None and hashes:
            overlap = self.index.overlaps(hashes).get(slot.key, NO_OVERLAP)
        return Choice(slot, overlap, None, 1, None)

    def choose(self, req: RoutingRequest, table: LoadTable[Slot], pool: WorkerRole, params: SelectionParams,
               decode_tokens: float) -> Choice:
        """The rank the mode chooses in ``table`` (the request's pool). Raises Overloaded or
        ServiceUnavailable when no rank is eligible (router.pools), Overloaded when none is
        predicted to meet the request's TTFT objective and ``ttft_slo_reject`` is set."""
        if self.cost_mode is None:
            eligible = self.pools.eligible(req.model, table, pool, req.exclude).candidates
            if self.mode is RoutingMode.ROUND_ROBIN:
                i = self.round_robin[req.model].pick(eligible)
            elif self.mode is RoutingMode.RANDOM:
                i = self.rng.randrange(len(eligible))
            else:
                i = least_loaded(eligible, self.rng)
            return Choice(eligible[i], NO_OVERLAP, None, len(eligible), None)
        scored = self.score(req, table, pool, params, decode_tokens)
        i, met = self.pick(req, scored, params)
        chosen = scored.slot(i)
        return Choice(chosen, scored.overlaps.get(chosen.key, NO_OVERLAP), float(scored.cost[i]),
                      len(scored.cost), met)

    def score(self, req: RoutingRequest, table: LoadTable[Slot], pool: WorkerRole, params: SelectionParams,
              decode_tokens: float) -> Scored:
        """The KV-aware cost of every eligible rank: the scalar form for a small pool, the
        vectorised one (numpy columns) for a large one; the same candidates in the same order
        either way, so ties break with the same random draw."""
        p = req.prompt_tokens
        vector = len(table) >= VECTOR_MIN_CANDIDATES
        rows: Any = None
        slots: Sequence[Slot]
        if vector:
            rows = table.eligible_rows(req.exclude)
            if (len(table) if rows is None else len(rows)) == 0:
                self.pools.none_eligible(req.model, table, pool, req.exclude)
            slots = table.row(0 if rows is None else int(rows[0])),  # only its block size is read
        else:
            chosen_from = self.pools.eligible(req.model, table, pool, req.exclude)
            slots = chosen_from.candidates
        overlaps: dict[WorkerKey, Overlap] = {}
        if self.index is not None:
            for hashes in req.hashes.values():
                if hashes:
                    overlaps.update(self.index.overlaps(hashes))
        size = slots[0].block_size
        request_blocks = {bs: -(-p // bs) for bs in req.hashes} or {size: -(-p // size)}
        timed = self.cost_mode is RoutingMode.KV_TIME or req.ttft_slo_ms is not None
        # Blocks of the request already booked on each rank: the block cost's distinct decode
        # blocks, and the time cost's decode-growth term only.
        shared = (self.pools.booked_shared(req.hashes, table)
                  if self.cost_mode is not RoutingMode.KV_TIME or params.decode_slowdown_weight else {})
        cost: Any
        tcost: Any = None
        ttft: Any = None
        if vector:
            cols = table.columns(rows, timing=timed)
            if timed:
                tcost, ttft = vector_time_costs(cols, params, p, overlaps=overlaps, request_blocks=request_blocks,
                                                booked_shared=shared, decode_tokens=decode_tokens)
            cost = tcost if self.cost_mode is RoutingMode.KV_TIME else vector_costs(
                cols, params, p, overlaps=overlaps, request_blocks=request_blocks, booked_shared=shared)
            return Scored((), rows, table, overlaps, cost, ttft)
        if timed:
            tcost, ttft = row_costs(chosen_from.time_rows, params, p, overlaps=overlaps,
                                    request_blocks=request_blocks, booked_shared=shared,
                                    decode_tokens=decode_tokens, positions=chosen_from.positions,
                                    argmin_only=req.ttft_slo_ms is None and params.router_temperature <= 0.0,
                                    order=chosen_from.order)
        cost = tcost if self.cost_mode is RoutingMode.KV_TIME else costs(
            slots, params, p, overlaps=overlaps, request_blocks=request_blocks, booked_shared=shared)
        return Scored(slots, None, None, overlaps, cost, ttft)

    def pick(self, req: RoutingRequest, scored: Scored, params: SelectionParams) -> tuple[int, bool | None]:
        """Index of the chosen candidate, and whether it is predicted to meet the request's TTFT
        objective (None without one). With an objective: among the candidates predicted to meet
        it, the one with the most cached tokens, then the least cost (ties at random); none → the
        overload status if ``ttft_slo_reject``, else the usual pick (best effort)."""
        temperature = params.router_temperature
        slo = req.ttft_slo_ms
        if slo is None:
            if scored.table is not None:
                return pick_index(scored.cost, temperature, self.rng), None
            return pick(scored.cost, temperature, self.rng), None
        stats = self.slo[req.model]
        stats["requests"] += 1
        cost = np.asarray(scored.cost, dtype=np.float64)
        meet = np.asarray(scored.ttft, dtype=np.float64) <= slo
        if not bool(meet.any()):
            if params.ttft_slo_reject:
                stats["rejected"] += 1
                best = float(np.min(scored.ttft))
                raise Overloaded(
                    f"no worker of model {req.model} is predicted to meet the TTFT objective of "
                    f"{slo:g} ms (best predicted {best:.0f} ms)", model=req.model,
                )
            if scored.table is None:
                return pick(scored.cost, temperature, self.rng), False
            return pick_index(cost, temperature, self.rng), False
        stats["predicted_met"] += 1
        hits = np.zeros(len(cost))
        if scored.overlaps:
            keys = list(scored.overlaps)
            if scored.table is not None:
                pos, keep = scored.table.locate(scored.rows, keys)
                keys = [k for k, kept in zip(keys, keep.tolist(), strict=True) if kept]
            else:
                where = {s.key: i for i, s in enumerate(scored.slots)}
                pairs = [(where[k], k) for k in keys if k in where]
                pos = np.array([i for i, _ in pairs], dtype=np.intp)
                keys = [k for _, k in pairs]
            hits[pos] = [scored.overlaps[k].total for k in keys]
        return consolidate(cost, meet, hits, self.rng), True


# -- the comparison modes ----------------------------------------------------------------------


def least_loaded(candidates: Sequence[Candidate], rng: random.Random) -> int:
    """The candidate with the least load in blocks (queued prefill + active decode blocks), then
    fewest requests; ties uniformly at random. No cache credit."""
    if not candidates:
        raise ValueError("no candidates")
    loads = [
        (c.active_prefill_tokens / c.block_size + c.decode_blocks, c.active_requests)
        for c in candidates
    ]
    best = min(loads)
    ties = [i for i, load in enumerate(loads) if load == best]
    return ties[rng.randrange(len(ties))]


class RoundRobin:
    """The next candidate after the last one chosen, by instance id order."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    def pick(self, candidates: Sequence[Candidate]) -> int:
        if not candidates:
            raise ValueError("no candidates")
        order = sorted(range(len(candidates)), key=lambda i: (candidates[i].instance_id, candidates[i].dp_rank))
        if self._last is not None:
            for i in order:
                c = candidates[i]
                if (c.instance_id, c.dp_rank) > self._last:
                    self._last = (c.instance_id, c.dp_rank)
                    return i
        first = order[0]
        self._last = (candidates[first].instance_id, candidates[first].dp_rank)
        return first
