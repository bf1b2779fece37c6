"""The cost function of DESIGN §5 over numpy columns, for fleets of hundreds to thousands of ranks.

:func:`router.selection.costs` walks the candidates in Python, which is the quicker way for a few
dozen of them but grows to milliseconds at 4096. Here the scheduler's slot map is a
:class:`LoadTable`: a dict that also keeps its slots as numpy columns, updated incrementally (a slot
whose load, health or busy flag changed is *touched* and re-read at the next selection, so a
selection reads the few rows that changed instead of every slot). The cost is then a handful of
vector operations, with the prefix credit scattered onto the few ranks that hold part of the prompt
(every other rank has no credit: its cost is load only).

The arithmetic is the same as :func:`router.selection.costs`, operation for operation and in the
same order, so the costs are bit-for-bit equal (all figures are integers far below 2**53, and
IEEE-754 float64 arithmetic is the same in numpy as in Python). Rows are kept in the slots' insertion
order, the order the scalar path iterates in, so :func:`pick_index` breaks ties over the same list
with the same random draw as :func:`router.selection.pick`. At T > 0 the weights come from
``numpy.exp`` instead of ``math.exp``, which can differ in the last bit: same distribution.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Collection, Mapping
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from router.cost import DEFAULT_DECODE_TOKENS, TimeRow, time_row
from router.selection import TIE_EPS, Candidate, Overlap, SelectionParams

WorkerKey = tuple[int, int]
C = TypeVar("C", bound=Candidate)
Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Rows = npt.NDArray[np.intp]

# Below this many ranks the scalar loop of router.selection is as fast or faster (measured with
# bench/selection.py on 2 cores: equal at ~100, numpy ahead from 128, 4x ahead at 4096).
VECTOR_MIN_CANDIDATES = 96




class Selectable(NamedTuple, Generic[C]):
    """A pool's eligible candidates in row order, their time rows, positions by key and the order
    of their cost floors."""

    candidates: list[C]
    time_rows: list[TimeRow]
    positions: dict[WorkerKey, int]
    order: list[int] | None  # positions by ascending floor_ms (router.cost.row_costs), if kept


class LoadTable(dict[WorkerKey, C]):
    """A scheduler's slot map (key → candidate) that also keeps its candidates as columns: block
    size, active prefill tokens, decode blocks, active requests, eligibility. Reads are a plain
    dict's; every way of adding or removing an entry keeps the columns in step, and row order is
    the dict's order (a replaced key keeps its row, a dropped key's followers move up).

    A candidate's load figures and eligibility are re-read when it was *touched*
    (:meth:`router.selection.Candidate.touch`, which finds this table through ``cand.table``),
    at the next selection. So whatever changes a candidate's load figures or eligibility must touch
    it (the scheduler does so in ``_refresh_busy``, where every slot refresh ends, and in ``_tick``).
    ``eligible`` says whether a candidate may be chosen (healthy, not busy).
    """

    def __init__(self, eligible: Callable[[C], bool]) -> None:
        super().__init__()
        self._eligible = eligible
        self._rows: list[C] = []
        self._row_of: dict[WorkerKey, int] = {}
        self._dirty: dict[int, C] = {}
        self._time_rows: list[TimeRow] = []  # router.cost's figures of each row, same order
        self._oks: list[bool] = []  # each row's eligibility (the numpy column's source)
        self._stale: set[int] = set()  # rows re-read since their numpy columns were written
        # (eligible candidates, their time rows) until a row is written, added or removed.
        # The eligible candidates until a row is added, removed or changes eligibility (a changed
        # row's time row is replaced in place, found by its row).
        self._selectable: Selectable[C] | None = None
        self._pos_of_row: dict[int, int] = {}
        self._floors: list[float] = []  # the floors of self._selectable.order, in that order
        self._alloc(16)

    def _alloc(self, cap: int) -> None:
        self._block = np.ones(cap, dtype=np.int64)
        self._prefill = np.zeros(cap, dtype=np.int64)
        self._decode = np.zeros(cap, dtype=np.int64)
        self._requests = np.zeros(cap, dtype=np.int64)
        self._instance = np.zeros(cap, dtype=np.uint64)
        self._ok = np.zeros(cap, dtype=np.bool_)
        # The time cost's (router.cost): KV blocks, step budget, timing coefficients per row.
        self._timing = np.zeros((13, cap), dtype=np.float64)  # one contiguous row per figure

    def _columns(self) -> tuple[npt.NDArray[Any], ...]:
        return (self._block, self._prefill, self._decode, self._requests, self._instance, self._ok,
                self._timing)

    def row(self, row: int) -> C:
        return self._rows[row]

    # -- the dict's mutations ------------------------------------------------------------------

    def __setitem__(self, key: WorkerKey, cand: C) -> None:
        if key != cand.key:
            raise ValueError(f"slot {cand.key} stored under key {key}")
        row = self._row_of.get(key)
        if row is None:
            row = len(self._rows)
            if row == len(self._block):
                old = self._columns()
                self._alloc(2 * row)
                for new_col, old_col in zip(self._columns(), old, strict=True):
                    new_col[..., :row] = old_col
            self._rows.append(cand)
            self._time_rows.append(time_row(cand))
            self._oks.append(False)
            self._row_of[key] = row
        else:
            self._forget(self._rows[row])
            self._rows[row] = cand
        super().__setitem__(key, cand)
        cand.table = self
        self._selectable = None
        self._block[row] = cand.block_size
        self._instance[row] = cand.instance_id
        self._write(row, cand)

    def __delitem__(self, key: WorkerKey) -> None:
        super().__delitem__(key)  # KeyError first, like a dict
        self._sync()  # before the rows below move up
        row = self._row_of.pop(key)
        self._forget(self._rows.pop(row))
        del self._time_rows[row]
        del self._oks[row]
        self._selectable = None
        n = len(self._rows)
        for col in self._columns():
            col[..., row:n] = col[..., row + 1:n + 1]
        for i in range(row, n):
            self._row_of[self._rows[i].key] = i

    _MISSING: Any = object()

    def pop(self, key: WorkerKey, default: Any = _MISSING) -> Any:
        if key in self:
            cand = self[key]
            del self[key]
            return cand
        if default is self._MISSING:
            raise KeyError(key)
        return default

    def popitem(self) -> tuple[WorkerKey, C]:
        if not self:
            raise KeyError("popitem(): table is empty")
        key = next(reversed(self.keys()))
        return key, self.pop(key)

    def setdefault(self, key: WorkerKey, default: C) -> C:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, cand in dict(*args, **kwargs).items():
            self[key] = cand

    def clear(self) -> None:
        for cand in self._rows:
            self._forget(cand)
        super().clear()
        self._rows.clear()
        self._time_rows.clear()
        self._oks.clear()
        self._stale.clear()
        self._row_of.clear()
        self._dirty.clear()
        self._selectable = None

    def __ior__(self, other: Any) -> LoadTable[C]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def _forget(self, cand: C) -> None:
        self._dirty.pop(id(cand), None)
        if cand.table is self:
            cand.table = None

    # -- load figures --------------------------------------------------------------------------

    def touch(self, cand: Candidate, /) -> None:
        """Note that a candidate's load or eligibility changed; re-read at the next selection."""
        self._dirty[id(cand)] = cand  # type: ignore[assignment]

    def flush(self) -> None:
        """Re-read every touched candidate still in the table."""
        if not self._dirty:
            return
        row_of = self._row_of
        rows = self._rows
        for cand in self._dirty.values():
            row = row_of.get(cand.key)
            if row is not None and rows[row] is cand:
                self._write(row, cand)
        self._dirty.clear()

    def _write(self, row: int, cand: C) -> None:
        """Re-read one row for the scalar path now; its numpy columns at the next :meth:`_sync`
        (a small pool never reads them)."""
        ok = self._eligible(cand)
        was = self._oks[row]
        self._oks[row] = ok
        # The time cost's figures that depend on this row alone, computed when it changes rather
        # than at every selection: a full step's prefill, the prefill queued ahead, the decode step.
        tr = self._time_rows[row] = time_row(cand)
        self._stale.add(row)
        cached = self._selectable
        if cached is not None:
            if ok != was:
                self._selectable = None
            elif ok:
                pos = self._pos_of_row[row]
                trows = cached.time_rows
                old_floor = trows[pos].floor_ms
                trows[pos] = tr
                order = cached.order
                if order is not None and tr.floor_ms != old_floor:
                    floors = self._floors  # order's floors, ascending
                    at = order.index(pos)
                    del order[at], floors[at]
                    at = bisect.bisect_right(floors, tr.floor_ms)
                    order.insert(at, pos)
                    floors.insert(at, tr.floor_ms)

    def current_time_row(self, cand: C) -> TimeRow:
        """A candidate's current time row (brings touched rows up to date first)."""
        self.flush()
        row = self._row_of.get(cand.key)
        return self._time_rows[row] if row is not None and self._rows[row] is cand else time_row(cand)

    def _sync(self) -> None:
        """Bring the numpy columns of re-read rows up to date."""
        rows, time_rows = self._rows, self._time_rows
        for row in self._stale:
            cand, tr = rows[row], time_rows[row]
            self._prefill[row] = cand.active_prefill_tokens
            self._decode[row] = cand.decode_blocks
            self._requests[row] = cand.active_requests
            self._ok[row] = self._oks[row]
            t = tr.rest.timing
            self._timing[:, row] = (tr.rest.kv_blocks, tr.budget, tr.p0, tr.p1, tr.p2, t.d0, t.d1, t.d2,
                                 t.decode_min_ms, tr.full_step_ms, tr.ahead_ms, tr.decode_step_ms, tr.wait_rate)
        self._stale.clear()

    # -- selection -----------------------------------------------------------------------------

    def selectable(self, exclude: Collection[int] = ()) -> Selectable[C]:
        """The candidates that may be chosen, in row order, with their time rows (the scalar
        path's input) and positions by key; kept between selections until a row is added,
        removed or changes eligibility. Brings touched rows up to date first. Shared: not to be
        modified."""
        self.flush()
        cached = self._selectable
        if cached is None:
            picked = [i for i, flag in enumerate(self._oks) if flag]
            rows = self._rows
            trows = [self._time_rows[i] for i in picked]
            order = sorted(range(len(picked)), key=lambda i: trows[i].floor_ms)
            self._floors = [trows[i].floor_ms for i in order]
            cached = self._selectable = Selectable(
                [rows[i] for i in picked], trows, {rows[i].key: pos for pos, i in enumerate(picked)}, order)
            self._pos_of_row = {i: pos for pos, i in enumerate(picked)}
        if not exclude:
            return cached
        keep = [i for i, c in enumerate(cached.candidates) if c.instance_id not in exclude]
        cands = [cached.candidates[i] for i in keep]
        return Selectable(cands, [cached.time_rows[i] for i in keep], {c.key: i for i, c in enumerate(cands)},
                          None)

    def eligible_rows(self, exclude: Collection[int] = ()) -> Rows | None:
        """Rows that may be chosen, ascending; ``None`` means every row (the usual case).
        Brings touched rows up to date first."""
        self.flush()
        self._sync()
        n = len(self._rows)
        ok = self._ok[:n]
        if exclude:
            ids = np.fromiter((i for i in exclude), dtype=np.uint64, count=len(exclude))
            ok = ok & ~np.isin(self._instance[:n], ids)
        if bool(ok.all()):
            return None
        return np.flatnonzero(ok)

    def costs(
        self, rows: Rows | None, params: SelectionParams, prompt_tokens: int, *,
        overlaps: Mapping[WorkerKey, Overlap],
        request_blocks: Mapping[int, int] | None = None,
        booked_shared: Mapping[WorkerKey, int] | None = None,
    ) -> Floats:
        """Cost of each row in ``rows`` (``None``: every row), in that order; the same numbers
        :func:`router.selection.costs` gives for those candidates with the same arguments.
        Call :meth:`eligible_rows` first."""
        n = len(self._rows)
        if rows is None:
            b, a = self._block[:n], self._prefill[:n]
            decode, requests = self._decode[:n], self._requests[:n]
        else:
            b, a = self._block[rows], self._prefill[rows]
            decode, requests = self._decode[rows], self._requests[rows]
        m = len(b)
        if m == 0:
            return np.zeros(0, dtype=np.float64)
        p = prompt_tokens
        prefill: Floats = (a + p) / b
        if overlaps:
            pos, ov = self._positions(rows, overlaps)
            if len(pos):
                decay_w = params.overlap_score_credit_decay
                dev, host, disk, shared = ov[:, 0], ov[:, 1], ov[:, 2], ov[:, 3]
                if decay_w:
                    bp = b[pos]
                    r = np.maximum(1, -(-p // bp))
                    excess = (a[pos] - a.min()) / bp
                    decay = 1.0 / (1.0 + decay_w * excess / r)
                    credit = params.overlap_score_credit * decay * dev
                else:
                    credit = params.overlap_score_credit * dev
                credit = (
                    credit + params.host_cache_hit_weight * host + params.disk_cache_hit_weight * disk
                    + params.shared_cache_multiplier * shared
                )
                prefill[pos] = prefill[pos] - credit
        cost: Floats = params.prefill_load_scale * np.where(prefill > 0.0, prefill, 0.0) + decode
        if params.decode_active_request_weight:
            cost = cost + params.decode_active_request_weight * requests
        if request_blocks:
            if len(request_blocks) == 1:
                (only,) = request_blocks.values()
                cost = cost + only
            else:
                sizes = np.unique(b)
                if len(sizes) == 1:
                    size = int(sizes[0])
                    cost = cost + request_blocks.get(size, -(-p // size))
                else:
                    extra = np.empty(m, dtype=np.int64)
                    for size in sizes.tolist():
                        extra[b == size] = request_blocks.get(size, -(-p // size))
                    cost = cost + extra
            if booked_shared:
                items = [(k, v) for k, v in booked_shared.items() if v]
                if items:
                    spos, keep = self.locate(rows, [k for k, _ in items])
                    vals = np.array([v for _, v in items], dtype=np.int64)[keep]
                    cost[spos] = cost[spos] - vals
        return cost

    def time_costs(
        self, rows: Rows | None, params: SelectionParams, prompt_tokens: int, *,
        overlaps: Mapping[WorkerKey, Overlap],
        request_blocks: Mapping[int, int] | None = None,
        booked_shared: Mapping[WorkerKey, int] | None = None,
        decode_tokens: float = DEFAULT_DECODE_TOKENS,
    ) -> tuple[Floats, Floats]:
        """(cost, predicted TTFT) in ms of each row, as :func:`router.cost.time_costs` computes
        them for those candidates (equal up to float rounding). Call :meth:`eligible_rows` first."""
        n = len(self._rows)
        sel: Any = slice(0, n) if rows is None else rows
        b = self._block[sel]
        m_rows = len(b)
        if m_rows == 0:
            empty = np.zeros(0, dtype=np.float64)
            return empty, empty
        a, decode, requests = self._prefill[sel], self._decode[sel], self._requests[sel]
        t = self._timing[:, sel]
        kv, budget = t[0], t[1]
        p0, p1, p2 = t[2], t[3], t[4]
        step_full, ahead, step = t[9], t[10], t[11]
        p = prompt_tokens
        x: Floats = a + float(p)
        if overlaps:
            pos, ov = self._positions(rows, overlaps)
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
        ttft = prefill + steps * step  # step is 0 on a rank that runs nothing
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
                        spos, keep = self.locate(rows, [k for k, _ in items])
                        vals = np.array([v for _, v in items], dtype=np.int64)[keep]
                        r_all = r_all.copy()
                        r_all[spos] = r_all[spos] - vals
                v = np.minimum((decode + np.maximum(r_all, 0)) / kv, 1.0)
                grown = np.maximum(d0 + d1 * v + d2 * v * v, dmin)
                extra = extra + np.where(grown > step, slow_w * (grown - step) * decode_tokens, 0.0)
            cost = cost + requests * extra  # requests = 0: no one to slow down
        return cost, ttft

    def locate(self, rows: Rows | None, keys: list[WorkerKey]) -> tuple[Rows, npt.NDArray[np.bool_]]:
        """Positions (within ``rows``) of the keys that are there, and which keys those were."""
        row_of = self._row_of
        found = np.array([row_of.get(k, -1) for k in keys], dtype=np.intp)
        keep = found >= 0
        if rows is None:
            return found[keep], keep
        at = np.searchsorted(rows, found)
        inside = at < len(rows)
        inside[inside] = rows[at[inside]] == found[inside]
        keep &= inside
        return at[keep], keep

    def _positions(self, rows: Rows | None, overlaps: Mapping[WorkerKey, Overlap]) -> tuple[Rows, Ints]:
        pos, keep = self.locate(rows, list(overlaps))
        flat = np.fromiter(
            itertools.chain.from_iterable(overlaps.values()), dtype=np.int64, count=4 * len(overlaps)
        )
        return pos, flat.reshape(-1, 4)[keep]


def pick_index(cost: Floats, temperature: float, rng: random.Random) -> int:
    """:func:`router.selection.pick` over an array: argmin with ties broken uniformly (the same draw
    over the same tie list), or at T > 0 sampling with p ∝ exp(-(c - c_min)/((c_max - c_min)·T)).
    Raises ValueError on an empty array."""
    n = len(cost)
    if n == 0:
        raise ValueError("no candidates")
    c_min = cost.min()
    if temperature <= 0.0:
        ties = np.flatnonzero(cost - c_min <= TIE_EPS)
        return int(ties[0]) if len(ties) == 1 else int(ties[rng.randrange(len(ties))])
    span = float(cost.max() - c_min)
    if span <= TIE_EPS:
        return rng.randrange(n)
    acc = np.cumsum(np.exp(-(cost - c_min) / (span * temperature)))
    x = rng.random() * float(acc[-1])
    return min(int(np.searchsorted(acc, x, side="right")), n - 1)
