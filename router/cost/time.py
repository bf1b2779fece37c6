"""The time cost: the predicted time to first token, in ms (modes ``kv``, the default, and
``kv-time``; issue 9). Pure: no I/O, no clock.

Each candidate (one worker dp rank) is scored by the time the request would take to its first
token there, in milliseconds of that worker's own timing model (:class:`Timing`, fitted per worker
by :mod:`router.calibration`), plus the time its decode costs the requests already running there:

    hit    = min(overlap_score_credit·decay·device + host_cache_hit_weight·host
                 + disk_cache_hit_weight·disk + shared_cache_multiplier·shared, ⌊(P-1)/B⌋) · B
    N      = P - hit                                  uncached tokens of this request
    Q      = active prefill tokens ahead (the larger of this router's bookings and the worker's report)
    n      = requests running there
    TTFT   = prefill(Q + N) + steps(Q + N) · decode_step(u, n) + r · n     (the last two only if n > 0)
    D      = prefill(Q + N) - prefill(Q)                  the time this request adds to the rank's work
    slow   = n · (prefill_interference_weight · D
                  + decode_slowdown_weight · (decode_step(u + R/K, n + 1) - decode_step(u, n)) · L)
    wait   = arrival_wait_weight · λ · D · (prefill(Q) + D/2)
    cost   = TTFT + slow + wait

``prefill(x)`` runs ``x`` tokens in engine steps of at most ``max_num_batched_tokens`` (M), each
costing ``p0 + p1·t + p2·t²`` for its ``t`` tokens; ``steps(x) = ⌈x/M⌉``; ``u`` is the rank's
active blocks over its KV blocks ``K``; ``decode_step(u, n) = max(d0 + d1·u + d2·u², decode_min)
+ dn·n``. ``r`` (``running_ms``) and ``dn`` (``decode_running_ms``) are what each request running
there adds to a first token and to a decode step beyond its KV (a step's per-sequence work, the
worker process's own per-request overhead): fitted per worker, 0 in every prior (decision 110).
``R`` is the request's blocks (less those already booked there); ``L`` the model's expected decode
tokens per request (observed). ``slow`` is what this request costs the requests already running
there: its prefill lengthens the steps they decode in, and its blocks (and itself, ``dn``)
lengthen every later decode step, for about ``L`` steps; a worker with nothing running pays no
such cost. Both weigh little by default (they are costs to other requests'
inter-token latency, not to anyone's TTFT). ``wait`` is what it costs the requests that will
arrive there before it is done: ``λ`` is the rank's expected arrival rate, the requests that
finished there and are expected back (:mod:`router.returns`: the next turns of the sessions whose
cache the rank holds, which cannot go elsewhere without recomputing it); one arriving while the
queue ahead runs waits ``D`` more, one arriving during ``D`` half of it on average. A long prefill
is therefore placed where few requests are expected, and a short one anywhere. The cache tiers
are credits in the same unit: a block held in a tier removes its tokens (times the tier's weight)
from the prefill, i.e. it is worth the prefill time it saves on that worker. ``decay`` is the
block cost's (DESIGN §5): ``1 / (1 + overlap_score_credit_decay · excess / R)``.

Temperature and ties are DESIGN §5's (:mod:`router.cost.common`) over these costs.

:func:`row_costs` scores a pool's rows in Python (the rows kept by its load table, with two fast
paths: the ranks holding part of the prompt scored apart from the rest, and an argmin-only scan
that skips every row whose lower bound is above the least cost so far); :func:`vector_time_costs`
computes the same over the table's numpy columns for large pools, equal up to float rounding
(a few terms are grouped differently).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np

from controlplane.protocol.events import (
    DEFAULT_DECODE_MIN_MS,
    DEFAULT_DECODE_MS,
    DEFAULT_PREFILL_MS,
    EngineTiming,
)
from router.cost.common import (
    TIE_EPS,
    Candidate,
    Columns,
    Floats,
    Overlap,
    SelectionParams,
    WorkerKey,
    located_overlaps,
)

# Decode tokens per request assumed until a model's requests have been observed.
DEFAULT_DECODE_TOKENS = 32.0


@dataclass(frozen=True, slots=True)
class Timing:
    """One worker's timing model, per engine step, in ms (see the module docstring)."""

    p0: float
    p1: float
    p2: float
    d0: float
    d1: float
    d2: float
    decode_min_ms: float = 0.0
    source: str = "default"
    running_ms: float = 0.0  # r: ms of a first token per request running on the rank (fitted)
    decode_running_ms: float = 0.0  # dn: ms of a decode step per request running on the rank (fitted)

    @classmethod
    def from_engine(cls, timing: EngineTiming | None) -> Timing:
        if timing is None:
            return DEFAULT_TIMING
        (p0, p1, p2), (d0, d1, d2) = timing.prefill_ms, timing.decode_ms
        return cls(p0, p1, p2, d0, d1, d2, timing.decode_min_ms, timing.source)

    def prefill_step_ms(self, n: float) -> float:
        """One step computing ``n`` uncached tokens (0 → 0 ms)."""
        if n <= 0:
            return 0.0
        return max(self.p0 + self.p1 * n + self.p2 * n * n, 0.0)

    def decode_step_ms(self, usage: float, running: float = 0.0) -> float:
        """One decode step at KV usage ``usage`` with ``running`` requests in it (dn each)."""
        u = min(max(usage, 0.0), 1.0)
        return max(self.d0 + self.d1 * u + self.d2 * u * u, self.decode_min_ms) + self.decode_running_ms * running

    def prefill_ms(self, tokens: float, budget: int) -> tuple[float, int]:
        """(time, steps) to compute ``tokens`` in steps of at most ``budget`` tokens."""
        if tokens <= 0:
            return 0.0, 0
        full = int(tokens // budget)
        rem = tokens - full * budget
        ms = full * self.prefill_step_ms(budget) if full else 0.0
        if rem > 0:
            ms += self.prefill_step_ms(rem)
            full += 1
        return ms, full

    def as_dict(self) -> dict[str, float | str]:
        return {"p0": self.p0, "p1": self.p1, "p2": self.p2, "d0": self.d0, "d1": self.d1,
                "d2": self.d2, "decode_min_ms": self.decode_min_ms, "running_ms": self.running_ms,
                "decode_running_ms": self.decode_running_ms, "source": self.source}


DEFAULT_TIMING = Timing(*DEFAULT_PREFILL_MS, *DEFAULT_DECODE_MS, DEFAULT_DECODE_MIN_MS, "default")


class Prediction(NamedTuple):
    """What the time cost predicts for one candidate (kept with its booking, for the fit)."""

    ttft_ms: float
    cost_ms: float
    queued_tokens: int
    uncached_tokens: float
    steps: int
    kv_usage: float
    running: int


class TimeRest(NamedTuple):
    """A row's figures only the cache credit and the decode-growth term need."""

    decode_blocks: int
    kv_blocks: int
    timing: Timing


class TimeRow(NamedTuple):
    """What the time cost needs of one candidate, computed when its load or timing model changes
    rather than at every selection (a :class:`router.loadvec.LoadTable` keeps one per row, and
    its :func:`timing_figures` as numpy columns): the request-independent parts of the module
    docstring's formula."""

    key: tuple[int, int]
    block_size: int
    queued: int  # Q: active prefill tokens ahead
    budget: int  # M: tokens per engine step
    p0: float
    p1: float
    p2: float
    full_step_ms: float  # prefill(M)
    running: int
    wait_rate: float  # λ/2, λ the rank's expected arrival rate (requests per ms, router.returns)
    decode_step_ms: float  # decode_step(u), 0 when nothing runs there
    busy_ms: float  # r · running: what the requests running there add to a first token
    ahead_ms: float  # prefill(Q)
    # A lower bound of this row's cost for a request of P uncached tokens, when every prefill token
    # costs at least p1 (p0, p1, p2 ≥ 0: every fitted model, the defaults):
    # floor_ms + floor_slope · P · (1 + prefill_interference_weight · running) (the arrival-wait
    # term is ≥ 0), with floor_ms = prefill(Q) + decode_step(u) + r · running and floor_slope = p1;
    # else -inf, 0.
    floor_ms: float
    floor_slope: float
    rest: TimeRest


def time_row(c: Candidate) -> TimeRow:
    t = c.timing or DEFAULT_TIMING
    m = c.batch_tokens or 8192
    kv = c.kv_total_blocks or 1
    q = c.active_prefill_tokens
    step = t.decode_step_ms(c.decode_blocks / kv, c.active_requests) if c.active_requests else 0.0
    busy = t.running_ms * c.active_requests
    full = t.prefill_step_ms(m)
    ahead = t.prefill_ms(q, m)[0]
    grows = t.p0 >= 0.0 and t.p1 >= 0.0 and t.p2 >= 0.0 and busy >= 0.0
    return TimeRow(c.key, c.block_size, q, m, t.p0, t.p1, t.p2, full, c.active_requests,
                   c.arrival_rate / 2, step, busy, ahead, ahead + step + busy if grows else -math.inf,
                   t.p1 if grows else 0.0, TimeRest(c.decode_blocks, kv, t))


def time_costs(
    candidates: Sequence[Candidate], params: SelectionParams, prompt_tokens: int, *,
    overlaps: Mapping[tuple[int, int], Overlap],
    request_blocks: Mapping[int, int] | None = None,
    booked_shared: Mapping[tuple[int, int], int] | None = None,
    decode_tokens: float = DEFAULT_DECODE_TOKENS,
) -> tuple[list[float], list[float]]:
    """(cost, predicted TTFT) of each candidate, in ms, same order."""
    return row_costs([time_row(c) for c in candidates], params, prompt_tokens, overlaps=overlaps,
                     request_blocks=request_blocks, booked_shared=booked_shared, decode_tokens=decode_tokens)


def row_costs(
    rows: Sequence[TimeRow], params: SelectionParams, prompt_tokens: int, *,
    overlaps: Mapping[tuple[int, int], Overlap],
    request_blocks: Mapping[int, int] | None = None,
    booked_shared: Mapping[tuple[int, int], int] | None = None,
    decode_tokens: float = DEFAULT_DECODE_TOKENS,
    positions: Mapping[tuple[int, int], int] | None = None,
    argmin_only: bool = False, order: Sequence[int] | None = None,
) -> tuple[list[float], list[float]]:
    """:func:`time_costs` over precomputed rows; ``positions`` is each row's index by key and
    ``order`` the row indexes by ascending ``floor_ms``, if the caller keeps them.

    ``argmin_only`` is for a pick at temperature 0 without an objective, which reads only the
    least cost and its ties: a row whose lower bound (``floor_ms``, ``floor_slope``) is above the
    least cost found so far is not scored (its cost is +inf), and the TTFT list is left empty.

    The rows that hold part of the prompt are scored first, with their credit (by
    :func:`predict_row` for every row when the decode-growth term is on); every other row by
    :func:`_plain_cost`."""
    if not rows:
        return [], []
    p = prompt_tokens
    if p <= 0:
        zeros = [0.0] * len(rows)
        return zeros, [] if argmin_only else list(zeros)
    least_prefill = min(r.queued for r in rows) if params.overlap_score_credit_decay else 0
    again: Sequence[int] = ()
    if params.decode_slowdown_weight:
        again = range(len(rows))
        argmin_only = False  # (a row's decode-growth term is not under its floor)
    elif overlaps:
        at = positions if positions is not None else {r.key: i for i, r in enumerate(rows)}
        again = [i for i in map(at.get, overlaps) if i is not None]
    inter_w = params.prefill_interference_weight
    wait_w = params.arrival_wait_weight
    exact = []
    for i in again:
        row = rows[i]
        if params.decode_slowdown_weight:
            pred = predict_row(
                row, params, p, overlaps.get(row.key), least_prefill=least_prefill,
                request_blocks=request_blocks.get(row.block_size) if request_blocks else None,
                booked_shared=booked_shared.get(row.key, 0) if booked_shared else 0, decode_tokens=decode_tokens)
            exact.append((pred.cost_ms, pred.ttft_ms))
        else:
            n = _uncached(row, params, p, overlaps[row.key], least_prefill,
                          request_blocks.get(row.block_size) if request_blocks else None)
            exact.append(_plain_cost(row, n, inter_w, wait_w))
    costs: list[float]
    ttfts: list[float] = []
    if argmin_only:
        # Rows in ascending floor (``order``, if the caller keeps it): past the first floor above
        # the least cost so far, no row can be the least or tie with it.
        bound = min(exact)[0] + TIE_EPS if exact else math.inf  # (the least cost: tuples order by it first)
        costs = [math.inf] * len(rows)
        pw = p * inter_w
        for i in (range(len(rows)) if order is None else order):
            row = rows[i]
            floor = row.floor_ms
            if floor > bound and order is not None:
                break
            if floor + row.floor_slope * (p + pw * row.running) > bound:
                continue
            cost = costs[i] = _plain_cost(row, p, inter_w, wait_w)[0]
            if cost + TIE_EPS < bound:
                bound = cost + TIE_EPS
        for i, (cost, _) in zip(again, exact, strict=True):
            costs[i] = cost
        return costs, ttfts
    costs = []
    add_cost, add_ttft = costs.append, ttfts.append
    for row in rows:
        cost, ttft = _plain_cost(row, p, inter_w, wait_w)
        add_cost(cost)
        add_ttft(ttft)
    for i, (cost, ttft) in zip(again, exact, strict=True):
        costs[i], ttfts[i] = cost, ttft
    return costs, ttfts


def _uncached(row: TimeRow, params: SelectionParams, p: int, ov: Overlap, least_prefill: int,
              request_blocks: int | None) -> float:
    """N: the tokens of a prompt of ``p`` a row still computes, less its cache credit."""
    b, q = row.block_size, row.queued
    credit = params.overlap_score_credit * ov.device
    if params.overlap_score_credit_decay:
        r = -(-p // b) if request_blocks is None else request_blocks
        credit = credit / (1.0 + params.overlap_score_credit_decay * ((q - least_prefill) / b) / max(r, 1))
    if ov.host or ov.disk or ov.shared:
        credit += (params.host_cache_hit_weight * ov.host + params.disk_cache_hit_weight * ov.disk
                   + params.shared_cache_multiplier * ov.shared)
    cap = (p - 1 if p > 0 else 0) // b
    return p - (credit if credit < cap else cap) * b


def _plain_cost(row: TimeRow, p: float, inter_w: float, wait_w: float) -> tuple[float, float]:
    """(cost, TTFT) of a row computing ``p`` ≥ 1 of the request's tokens (all of them where it
    holds nothing of the prompt): :func:`predict_row` without the decode-growth term, written for
    speed (integer token counts where it holds nothing)."""
    _key, _b, q, m, p0, p1, p2, step_full, n_req, wait_rate, step, busy, ahead, _floor, _slope, _rest = row
    x = q + p
    steps: float
    if x <= m:
        part = p0 + x * (p1 + p2 * x)
        prefill = part if part > 0.0 else 0.0
        steps = 1.0
    else:
        steps = x // m
        rem = x - steps * m
        prefill = steps * step_full
        if rem:
            part = p0 + rem * (p1 + p2 * rem)
            if part > 0.0:
                prefill += part
            steps += 1
    added = prefill - ahead
    wait = wait_w * wait_rate * added * (added + ahead + ahead)
    if not n_req:
        return prefill + wait, prefill
    ttft = prefill + steps * step + busy
    return ttft + n_req * inter_w * added + wait, ttft


def predict_row(
    row: TimeRow, params: SelectionParams, prompt_tokens: int, ov: Overlap | None, *,
    least_prefill: int = 0, request_blocks: int | None = None, booked_shared: int = 0,
    decode_tokens: float = DEFAULT_DECODE_TOKENS, uncached_tokens: float | None = None,
) -> Prediction:
    """The time cost of one candidate's row (the module docstring's formula): ``request_blocks``
    is R at its block size, ``booked_shared`` the blocks of the request already booked there.
    ``uncached_tokens`` replaces the prediction's own count of tokens to compute (``P - hit``) in
    the result only."""
    _key, b, q, m, _p0, _p1, _p2, _full, n_req, _wait, step, _busy, _ahead, _floor, _slope, rest = row
    p = prompt_tokens
    u = rest.decode_blocks / rest.kv_blocks
    if p <= 0:
        return Prediction(0.0, 0.0, q, 0.0 if uncached_tokens is None else uncached_tokens, 0, u, n_req)
    n: float = float(p)
    if ov is not None and ov.total:
        n = _uncached(row, params, p, ov, least_prefill, request_blocks)
    cost, ttft = _plain_cost(row, n, params.prefill_interference_weight, params.arrival_wait_weight)
    if n_req and params.decode_slowdown_weight:
        r = -(-p // b) if request_blocks is None else request_blocks
        grown = rest.timing.decode_step_ms((rest.decode_blocks + max(r - booked_shared, 0)) / rest.kv_blocks, n_req + 1)
        if grown > step:
            cost += n_req * params.decode_slowdown_weight * (grown - step) * decode_tokens
    steps = -int(-(q + n) // m)
    return Prediction(ttft, cost, q, n if uncached_tokens is None else uncached_tokens, steps, u, n_req)


def predict(
    c: Candidate, params: SelectionParams, prompt_tokens: int, ov: Overlap, *,
    least_prefill: int = 0, request_blocks: int | None = None, booked_shared: int = 0,
    decode_tokens: float = DEFAULT_DECODE_TOKENS, uncached_tokens: float | None = None,
) -> Prediction:
    """:func:`predict_row` of a candidate."""
    return predict_row(time_row(c), params, prompt_tokens, ov, least_prefill=least_prefill,
                       request_blocks=request_blocks, booked_shared=booked_shared,
                       decode_tokens=decode_tokens, uncached_tokens=uncached_tokens)



def timing_figures(tr: TimeRow) -> tuple[float, ...]:
    """A row's figures as :func:`vector_time_costs` reads them (a load table keeps them as
    :class:`router.cost.common.Columns` ``timing``, one array per figure), in this order: KV blocks,
    step budget M, p0, p1, p2, d0, d1, d2, decode_min_ms, prefill(M), prefill(Q), decode_step(u), λ/2,
    r · running, dn."""
    t = tr.rest.timing
    return (tr.rest.kv_blocks, tr.budget, tr.p0, tr.p1, tr.p2, t.d0, t.d1, t.d2,
            t.decode_min_ms, tr.full_step_ms, tr.ahead_ms, tr.decode_step_ms, tr.wait_rate, tr.busy_ms,
            t.decode_running_ms)


TIMING_FIGURES = 15  # len(timing_figures(row))


def vector_time_costs(
    cols: Columns, params: SelectionParams, prompt_tokens: int, *,
    overlaps: Mapping[WorkerKey, Overlap],
    request_blocks: Mapping[int, int] | None = None,
    booked_shared: Mapping[WorkerKey, int] | None = None,
    decode_tokens: float = DEFAULT_DECODE_TOKENS,
) -> tuple[Floats, Floats]:
    """(cost, predicted TTFT) in ms of each row of ``cols``, as :func:`time_costs` computes them
    for those candidates (equal up to float rounding). Raises ValueError on columns without the
    time cost's figures."""
    b = cols.block
    m_rows = len(b)
    if m_rows == 0:
        empty = np.zeros(0, dtype=np.float64)
        return empty, empty
    a, decode, requests = cols.prefill, cols.decode, cols.requests
    t = cols.timing
    if t is None:
        raise ValueError("the time cost needs the table's timing columns")
    kv, budget = t[0], t[1]
    p0, p1, p2 = t[2], t[3], t[4]
    step_full, ahead, step = t[9], t[10], t[11]
    p = prompt_tokens
    x = cast(Floats, a + float(p))
    if overlaps:
        pos, ov = located_overlaps(cols, overlaps)
        if len(pos):
            bp = b[pos]
            credit = params.overlap_score_credit * ov[:, 0]
            if params.overlap_score_credit_decay:
                r = np.maximum(1, -(-p // bp))
                excess = (a[pos] - a.min()) / bp
                credit = credit / (1.0 + params.overlap_score_credit_decay * excess / r)
            credit = (credit + params.host_cache_hit_weight * ov[:, 1]
                      + params.disk_cache_hit_weight * ov[:, 2] + params.shared_cache_multiplier * ov[:, 3])
            limit = (p - 1) // bp if p > 0 else np.zeros_like(bp)
            x[pos] = x[pos] - np.minimum(credit, limit) * bp
    full = np.floor_divide(x, budget)
    rem = x - full * budget
    # x > 0 always for a prompt of ≥ 1 token (the last one is never a hit); rem = 0 adds
    # max(p0, 0) · 0 below only when p0 ≤ 0, so the where on rem > 0 is kept.
    part = np.maximum(p0 + rem * (p1 + p2 * rem), 0.0)
    has_rem = rem > 0
    prefill = full * step_full + np.where(has_rem, part, 0.0)
    steps = full + has_rem
    ttft = prefill + steps * step + t[13]  # step and r · running are 0 on a rank that runs nothing
    cost = ttft
    added = prefill - ahead
    if params.arrival_wait_weight:
        cost = cost + (params.arrival_wait_weight * t[12]) * (added * (added + 2.0 * ahead))
    slow_w = params.decode_slowdown_weight
    inter_w = params.prefill_interference_weight
    if inter_w or slow_w:
        active = requests > 0
        if not bool(active.any()):
            return cost, ttft
        extra = inter_w * added if inter_w else np.zeros(m_rows)
        if slow_w:
            d0, d1, d2, dmin = t[5], t[6], t[7], t[8]
            if request_blocks and len(request_blocks) == 1:
                (only,) = request_blocks.values()
                r_all: Any = np.full(m_rows, only, dtype=np.int64)
            else:
                r_all = -(-p // b)
                if request_blocks:
                    for size, count in request_blocks.items():
                        r_all = np.where(b == size, count, r_all)
            if booked_shared:
                items = [(k, v) for k, v in booked_shared.items() if v]
                if items:
                    spos, keep = cols.locate([k for k, _ in items])
                    vals = np.array([v for _, v in items], dtype=np.int64)[keep]
                    r_all = r_all.copy()
                    r_all[spos] = r_all[spos] - vals
            v = np.minimum((decode + np.maximum(r_all, 0)) / kv, 1.0)
            grown = np.maximum(d0 + d1 * v + d2 * v * v, dmin) + t[14] * (requests + 1)
            extra = extra + np.where(grown > step, slow_w * (grown - step) * decode_tokens, 0.0)
        cost = cost + requests * extra  # requests = 0: no one to slow down
    return cost, ttft
