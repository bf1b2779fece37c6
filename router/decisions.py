"""Why did this request go there? A router's sampled record of its selection decisions.

A decision is recorded for a fraction of the selections (``RUDDER_DECISION_SAMPLE``; the check is
one float comparison when it is 0, and one random draw otherwise, from a random source of its
own so the tie-breaking draws of the selection stay what they were). A record holds every
candidate the cost scored (up to :data:`MAX_CANDIDATES`: the chosen one and the cheapest others)
with each term of the time cost (router.cost.time), which add up to the candidate's cost:

    cost = queued_prefill_ms      prefill(Q): the prefill already queued there
         + prefill_ms             D: this request's prefill of its uncached tokens
         + decode_ms              the decode pass of the steps it waits (ranks running requests)
         + busy_ms                r · running: what the requests running there add (fitted)
         + interference_ms        what its prefill costs the requests running there
         + decode_growth_ms       what its blocks cost their decode steps (decode_slowdown_weight)
         + arrival_wait_ms        what it costs the requests expected back there
    cache_credit_ms               the prefill time its cached prefix saves (already taken off)

then the chosen worker and why (``lowest_cost``, ``tie``, ``objective``, ``explicit_target``,
``busy_filter``, ``temperature_draw``, or the comparison ``mode``), and, when the request ends,
the measured TTFT and the cached tokens the worker reported. Records are kept in a bounded log
(``RUDDER_DECISION_RECORDS``), oldest dropped first; the control plane reads them over the bus
(``GET /decisions/{request_id}``, ``rudder explain``). Pure: no I/O; the clock is passed in.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from router.cost.common import Overlap, SelectionParams
from router.cost.time import TimeRow, predict_row

MAX_CANDIDATES = 64  # candidates kept per record: the chosen one and the cheapest others
TERMS = ("queued_prefill_ms", "prefill_ms", "decode_ms", "busy_ms", "interference_ms", "decode_growth_ms",
         "arrival_wait_ms")


class Why(enum.StrEnum):
    LOWEST_COST = "lowest_cost"
    TIE = "tie"  # the least cost was shared: a uniform draw among them
    OBJECTIVE = "objective"  # a TTFT objective: most cached among those predicted to meet it
    EXPLICIT_TARGET = "explicit_target"
    BUSY_FILTER = "busy_filter"  # ranks over their busy threshold were not candidates
    TEMPERATURE_DRAW = "temperature_draw"  # router_temperature > 0: sampled, not the least
    MODE = "mode"  # a comparison mode (round_robin, random, least_loaded): no cost


@dataclass(slots=True)
class CandidateTerms:
    """One candidate as the cost saw it (time-cost terms None under the block cost)."""

    instance_id: int
    dp_rank: int
    cost_ms: float
    overlap_blocks: int
    cached_tokens: float
    uncached_tokens: float
    queued_tokens: int
    running: int
    ttft_ms: float | None = None
    queued_prefill_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    busy_ms: float | None = None  # the requests running there (the fit's r · running)
    interference_ms: float | None = None
    decode_growth_ms: float | None = None
    arrival_wait_ms: float | None = None
    cache_credit_ms: float | None = None
    chosen: bool = False


def time_terms(row: TimeRow, params: SelectionParams, prompt_tokens: int, ov: Overlap, *,
               least_prefill: int, request_blocks: int | None, booked_shared: int,
               decode_tokens: float) -> CandidateTerms:
    """The time cost of one row, term by term (router.cost.time's formula, computed apart from
    it: the terms' sum is the candidate's cost up to float rounding)."""
    p = prompt_tokens
    pred = predict_row(row, params, p, ov if ov.total else None, least_prefill=least_prefill,
                       request_blocks=request_blocks, booked_shared=booked_shared,
                       decode_tokens=decode_tokens)
    t, m, q, running = row.rest.timing, row.budget, row.queued, row.running
    n = pred.uncached_tokens
    ahead = row.ahead_ms
    prefill_all = t.prefill_ms(q + n, m)[0]
    added = prefill_all - ahead
    steps = -int(-(q + n) // m) if q + n > 0 else 0
    decode = steps * row.decode_step_ms if running else 0.0
    interference = running * params.prefill_interference_weight * added if running else 0.0
    wait = params.arrival_wait_weight * row.wait_rate * added * (added + 2.0 * ahead)
    growth = 0.0
    if running and params.decode_slowdown_weight:
        r = -(-p // row.block_size) if request_blocks is None else request_blocks
        rest = row.rest
        grown = t.decode_step_ms((rest.decode_blocks + max(r - booked_shared, 0)) / rest.kv_blocks, running + 1)
        if grown > row.decode_step_ms:
            growth = running * params.decode_slowdown_weight * (grown - row.decode_step_ms) * decode_tokens
    return CandidateTerms(
        instance_id=row.key[0], dp_rank=row.key[1], cost_ms=pred.cost_ms, overlap_blocks=ov.total,
        cached_tokens=p - n, uncached_tokens=n, queued_tokens=q, running=running, ttft_ms=pred.ttft_ms,
        queued_prefill_ms=ahead, prefill_ms=added, decode_ms=decode, busy_ms=row.busy_ms, interference_ms=interference,
        decode_growth_ms=growth, arrival_wait_ms=wait,
        cache_credit_ms=t.prefill_ms(q + p, m)[0] - prefill_all,
    )


@dataclass(slots=True)
class DecisionRecord:
    request_id: str
    model: str
    at: float  # epoch seconds
    pool: str
    mode: str
    why: list[str]
    instance_id: int
    dp_rank: int
    cost_ms: float | None  # the chosen worker's cost as the selection computed it
    prompt_tokens: int
    candidates_total: int
    candidates: list[CandidateTerms] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)  # instance ids left out as busy
    temperature: float = 0.0
    ttft_slo_ms: float | None = None
    revisions: dict[str, int] = field(default_factory=dict)
    router_id: str = ""
    # When the request ends (None until then, or when the worker did not say):
    measured_ttft_ms: float | None = None  # request sent to the worker → its first token
    reported_cached_tokens: int | None = None
    status: str | None = None

    @property
    def chosen(self) -> CandidateTerms | None:
        return next((c for c in self.candidates if c.chosen), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def figures(record: DecisionRecord) -> dict[str, Any]:
    """What a routed request's select span carries of its sampled decision (flat attributes)."""
    out: dict[str, Any] = {"why": ",".join(record.why), "candidates_total": record.candidates_total,
                           "cost_ms": record.cost_ms}
    chosen = record.chosen
    if chosen is not None:
        for name in (*TERMS, "cache_credit_ms", "ttft_ms", "cached_tokens", "overlap_blocks"):
            out[name] = getattr(chosen, name)
    return out


class DecisionLog:
    """The sampled records of one router, newest kept (``capacity`` requests)."""

    def __init__(self, *, sample: float, capacity: int, rng: random.Random | None = None) -> None:
        self.sample = sample
        self.capacity = capacity
        self._rng = rng or random.Random()
        self._records: OrderedDict[str, list[DecisionRecord]] = OrderedDict()

    def sampled(self) -> bool:
        """Whether to record this selection (call only when ``sample`` > 0: the cheap check)."""
        return self.sample >= 1.0 or self._rng.random() < self.sample

    def add(self, record: DecisionRecord) -> None:
        records = self._records.get(record.request_id)
        if records is None:
            self._records[record.request_id] = [record]
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        else:
            records.append(record)  # a retry, or the decode phase of a disaggregated request

    def last(self, request_id: str, instance_id: int) -> DecisionRecord | None:
        """The newest record of the request that chose ``instance_id``."""
        for record in reversed(self._records.get(request_id, ())):
            if record.instance_id == instance_id:
                return record
        return None

    def get(self, request_id: str) -> list[DecisionRecord]:
        return list(self._records.get(request_id, ()))

    def finish(self, request_id: str, instance_id: int, *, ttft_ms: float | None,
               cached_tokens: int | None, status: str) -> DecisionRecord | None:
        """Fill in how the request went on ``instance_id``; returns its record (None when the
        request was not sampled). Once per record."""
        for record in reversed(self._records.get(request_id, ())):
            if record.instance_id == instance_id and record.status is None:
                record.measured_ttft_ms = ttft_ms
                record.reported_cached_tokens = cached_tokens
                record.status = status
                return record
        return None
