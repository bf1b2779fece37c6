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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from controlplane.protocol.errors import Overloaded, RudderError
from controlplane.protocol.events import RouterRole, WorkerRole
from router.commands import Phase, RoutingRequest
from router.cost.blocks import costs, vector_costs
from router.cost.common import (
    NO_OVERLAP,
    TIE_EPS,
    Candidate,
    Overlap,
    SelectionParams,
    WorkerKey,
    consolidate,
    pick,
    pick_index,
)
from router.cost.time import row_costs, vector_time_costs
from router.decisions import MAX_CANDIDATES, CandidateTerms, DecisionLog, DecisionRecord, Why, time_terms
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
    record: DecisionRecord | None = None  # when this decision was sampled (router.decisions)


@dataclass(slots=True)
class Scored:
    """One selection's candidates and what the cost said of them."""

    slots: Sequence[Slot]  # the eligible slots, in row order (scalar form; () for the vectorised)
    rows: Any  # numpy rows into the table, or None (every row / the list itself)
    table: LoadTable[Slot] | None  # the table whose columns were scored (vectorised form), else None
    overlaps: dict[WorkerKey, Overlap]
    cost: Any  # list[float] or numpy array
    ttft: Any  # list[float] or numpy array or None (block cost without an objective)
    # What the cost was given, kept for a sampled decision's record (router.decisions).
    request_blocks: Mapping[int, int] | None = None
    shared: Mapping[WorkerKey, int] | None = None

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
                 discovery: Discovery, index: PrefixIndex | None, rng: random.Random,
                 decisions: DecisionLog | None = None, wall: Callable[[], float] = time.time) -> None:
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
        self.decisions = decisions  # sampled records of the decisions (None: none kept)
        self.wall = wall

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
        record = None
        if self.decisions is not None and self.decisions.sample > 0.0 and self.decisions.sampled():
            record = self._record(req, pool, slot, None, 1, [Why.EXPLICIT_TARGET], [])
        return Choice(slot, overlap, None, 1, None, record)

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
            record = None
            if self.decisions is not None and self.decisions.sample > 0.0 and self.decisions.sampled():
                record = self._record(req, pool, eligible[i], None, len(eligible), [Why.MODE], [])
            return Choice(eligible[i], NO_OVERLAP, None, len(eligible), None, record)
        scored = self.score(req, table, pool, params, decode_tokens)
        i, met = self.pick(req, scored, params)
        chosen = scored.slot(i)
        record = None
        if self.decisions is not None and self.decisions.sample > 0.0 and self.decisions.sampled():
            record = self._explain(req, table, pool, params, decode_tokens, scored, i)
        return Choice(chosen, scored.overlaps.get(chosen.key, NO_OVERLAP), float(scored.cost[i]),
                      len(scored.cost), met, record)

    # -- sampled decisions (router.decisions): off the path unless sampled ---------------------

    def _record(self, req: RoutingRequest, pool: WorkerRole, slot: Slot, cost: float | None, total: int,
                why: list[Why], candidates: list[CandidateTerms]) -> DecisionRecord:
        assert self.decisions is not None
        record = DecisionRecord(
            request_id=req.request_id, model=req.model, at=self.wall(), pool=pool.value,
            mode=self.mode.value, why=[w.value for w in why], instance_id=slot.instance_id,
            dp_rank=slot.dp_rank, cost_ms=cost, prompt_tokens=req.prompt_tokens,
            candidates_total=total, candidates=candidates, ttft_slo_ms=req.ttft_slo_ms,
        )
        self.decisions.add(record)
        return record

    def _explain(self, req: RoutingRequest, table: LoadTable[Slot], pool: WorkerRole, params: SelectionParams,
                 decode_tokens: float, scored: Scored, i: int) -> DecisionRecord:
        """The record of a scored decision: every candidate's terms, the chosen one, and why."""
        p = req.prompt_tokens
        n = len(scored.cost)
        slots = [scored.slot(j) for j in range(n)]
        costs = [float(c) for c in scored.cost]
        blocks = scored.request_blocks or {}
        shared = scored.shared or {}
        terms: list[CandidateTerms] = []
        if self.cost_mode is RoutingMode.KV_TIME:
            rows = [table.current_time_row(s) for s in slots]
            least = min(r.queued for r in rows) if params.overlap_score_credit_decay else 0
            for s, row in zip(slots, rows, strict=True):
                terms.append(time_terms(row, params, p, scored.overlaps.get(s.key, NO_OVERLAP), least_prefill=least,
                                        request_blocks=blocks.get(s.block_size), booked_shared=shared.get(s.key, 0),
                                        decode_tokens=decode_tokens))
        else:
            for s, cost in zip(slots, costs, strict=True):
                hit = scored.overlaps.get(s.key, NO_OVERLAP).total
                cached = min(hit, max(p - 1, 0) // s.block_size) * s.block_size
                terms.append(CandidateTerms(
                    instance_id=s.instance_id, dp_rank=s.dp_rank, cost_ms=cost, overlap_blocks=hit,
                    cached_tokens=cached, uncached_tokens=p - cached, queued_tokens=s.active_prefill_tokens,
                    running=s.active_requests))
        terms[i].chosen = True
        others = [j for j in sorted(range(n), key=lambda j: terms[j].cost_ms) if j != i][:MAX_CANDIDATES - 1]
        kept = [terms[j] for j in sorted([*others, i], key=lambda j: terms[j].cost_ms)]
        why: list[Why] = []
        if req.ttft_slo_ms is not None:
            why.append(Why.OBJECTIVE)
        elif params.router_temperature > 0.0:
            why.append(Why.TEMPERATURE_DRAW)
        else:
            least_cost = min(costs)
            why.append(Why.TIE if sum(c <= least_cost + TIE_EPS for c in costs) > 1 else Why.LOWEST_COST)
        busy = sorted({s.instance_id for s in table.values() if s.busy})
        if busy:
            why.append(Why.BUSY_FILTER)
        record = self._record(req, pool, slots[i], costs[i], n, why, kept)
        record.busy = busy
        record.temperature = params.router_temperature
        return record

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
        else:  # (Pools.eligible, inline: this runs for every request)
            chosen_from = table.selectable(req.exclude)
            if not chosen_from.candidates:
                self.pools.none_eligible(req.model, table, pool, req.exclude)
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
            return Scored((), rows, table, overlaps, cost, ttft, request_blocks, shared)
        if timed:
            tcost, ttft = row_costs(chosen_from.time_rows, params, p, overlaps=overlaps,
                                    request_blocks=request_blocks, booked_shared=shared,
                                    decode_tokens=decode_tokens, positions=chosen_from.positions,
                                    argmin_only=req.ttft_slo_ms is None and params.router_temperature <= 0.0,
                                    order=chosen_from.order)
        cost = tcost if self.cost_mode is RoutingMode.KV_TIME else costs(
            slots, params, p, overlaps=overlaps, request_blocks=request_blocks, booked_shared=shared)
        return Scored(slots, None, None, overlaps, cost, ttft, request_blocks, shared)

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
