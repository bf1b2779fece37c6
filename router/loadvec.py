"""A scheduler's slot map kept as numpy columns too, for fleets of hundreds to thousands of ranks.

The scalar form of a cost (:mod:`router.cost`) walks the candidates in Python, which is the
quicker way for a few dozen of them but grows to milliseconds at 4096. Here the scheduler's slot
map is a :class:`LoadTable`: a dict that also keeps its slots as numpy columns, updated
incrementally (a slot whose load, health or busy flag changed is *touched* and re-read at the next
selection, so a selection reads the few rows that changed instead of every slot). The vectorised
form of a cost reads those columns (:meth:`LoadTable.columns`); the table also keeps each row's
time row (:class:`router.cost.time.TimeRow`) for the scalar time cost, and the eligible rows in
the order of their cost floors for its argmin-only scan.

Rows are kept in the slots' insertion order, the order the scalar form iterates in, so a pick
over either form's costs breaks ties over the same list with the same random draw.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Collection
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from router.cost.common import Candidate, Columns, Found, Rows, WorkerKey
from router.cost.time import TIMING_FIGURES, TimeRow, time_row, timing_figures

C = TypeVar("C", bound=Candidate)


class Selectable(NamedTuple, Generic[C]):
    """A pool's eligible candidates in row order, their time rows, positions by key and the order
    of their cost floors."""

    candidates: list[C]
    time_rows: list[TimeRow]
    positions: dict[WorkerKey, int]
    order: list[int] | None  # positions by ascending floor_ms (router.cost.time.row_costs), if kept


_MISSING: Any = object()  # pop's default: none given


class LoadTable(dict[WorkerKey, C]):
    """A scheduler's slot map (key → candidate) that also keeps its candidates as columns: block
    size, active prefill tokens, decode blocks, active requests, eligibility. Reads are a plain
    dict's; every way of adding or removing an entry keeps the columns in step, and row order is
    the dict's order (a replaced key keeps its row, a dropped key's followers move up).

    A candidate's load figures and eligibility are re-read when it was *touched*
    (:meth:`router.cost.common.Candidate.touch`, which finds this table through ``cand.table``),
    at the next selection. So whatever changes a candidate's load figures or eligibility must touch
    it (:class:`router.pools.Pools` does so in ``refresh_busy``, where every slot refresh ends, and
    in ``refresh_health`` and ``set_timing``).
    ``eligible`` says whether a candidate may be chosen (healthy, not busy).
    """

    def __init__(self, eligible: Callable[[C], bool]) -> None:
        super().__init__()
        self._eligible = eligible
        self._rows: list[C] = []
        self._row_of: dict[WorkerKey, int] = {}
        self._dirty: dict[int, C] = {}
        self._time_rows: list[TimeRow] = []  # the time cost's figures of each row, same order
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
        # The time cost's figures of each row (router.cost.time.timing_figures).
        self._timing = np.zeros((TIMING_FIGURES, cap), dtype=np.float64)  # one contiguous row per figure

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

    def pop(self, key: WorkerKey, default: Any = _MISSING) -> Any:
        if key in self:
            cand = self[key]
            del self[key]
            return cand
        if default is _MISSING:
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
            self._timing[:, row] = timing_figures(tr)
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

    def columns(self, rows: Rows | None, *, timing: bool = False) -> Columns:
        """The columns of ``rows`` (``None``: every row), in that order, for the vectorised form
        of a cost (router.cost); the time cost's figures only if ``timing``. Call
        :meth:`eligible_rows` first (it brings the columns up to date)."""
        sel: Any = slice(0, len(self._rows)) if rows is None else rows
        return Columns(self._block[sel], self._prefill[sel], self._decode[sel], self._requests[sel],
                       self._timing[:, sel] if timing else None, functools.partial(self.locate, rows))

    def locate(self, rows: Rows | None, keys: list[WorkerKey]) -> tuple[Rows, Found]:
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
