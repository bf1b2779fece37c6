"""What both costs share: their inputs (a :class:`Candidate`, its :class:`Overlap`, the
:class:`SelectionParams`, a load table's :class:`Columns`) and the pick over their output.

The pick is DESIGN §5's: temperature 0 picks the least cost, ties (costs within ``TIE_EPS``)
uniformly at random; T > 0 samples with p ∝ exp(-(c - c_min) / ((c_max - c_min)·T)) (all equal →
uniform). :func:`pick` reads a list, :func:`pick_index` an array: the same tie list and the same
random draw, so both forms of a cost choose alike. A TTFT objective's pick is
:func:`consolidate`. The random source is passed in, so tests and benchmarks are reproducible.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from controlplane.protocol.policy import SELECTION_PARAMETERS, Number

if TYPE_CHECKING:
    from router.cost.time import Timing

TIE_EPS = 1e-9  # costs closer than this are a tie (every pick)

WorkerKey = tuple[int, int]  # (instance_id, dp_rank)
Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Rows = npt.NDArray[np.intp]
Found = npt.NDArray[np.bool_]


class Overlap(NamedTuple):
    """Blocks of the request's prefix a candidate holds, by storage tier."""

    device: int = 0
    host: int = 0
    disk: int = 0
    shared: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk + self.shared


NO_OVERLAP = Overlap()


@dataclass(frozen=True, slots=True)
class SelectionParams:
    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.0
    decode_active_request_weight: float = 0.0
    router_temperature: float = 0.0
    # The time cost's (router.cost.time) and its calibration's (router.calibration).
    decode_slowdown_weight: float = 0.0
    prefill_interference_weight: float = 0.1
    arrival_wait_weight: float = 1.0
    calibration_window: int = 256
    calibration_min_samples: int = 16
    ttft_slo_reject: bool = False
    calibration_epoch: int = 0

    @classmethod
    def from_values(cls, values: Mapping[str, Number | None]) -> SelectionParams:
        """Build from effective values; a ``None`` falls back to the parameter's default."""
        kwargs: dict[str, Any] = {}
        for name, spec in SELECTION_PARAMETERS.items():
            value = values.get(name)
            if value is None:
                value = spec.default if spec.default is not None else 0.0
            kwargs[name] = int(value) if spec.integer else float(value)
        kwargs["ttft_slo_reject"] = bool(kwargs.get("ttft_slo_reject", 0))
        return cls(**kwargs)


@dataclass(slots=True)
class Candidate:
    """One worker dp rank as the costs see it. Load figures are already the larger of this
    router's bookings and the worker's last report. ``decode_blocks`` is the rank's distinct
    active blocks; the block cost adds the request's own blocks when told how many there are."""

    instance_id: int
    dp_rank: int
    block_size: int
    active_prefill_tokens: int
    decode_blocks: int
    active_requests: int
    overlap: Overlap = NO_OVERLAP
    # What the time cost (router.cost.time) needs besides the load figures: the rank's KV blocks,
    # its step budget (max_num_batched_tokens) and its worker's timing model (None: the default).
    kv_total_blocks: int = 0
    batch_tokens: int = 0
    timing: Timing | None = None
    arrival_rate: float = 0.0  # requests per ms expected back at this rank (router.returns: the time cost's λ)
    key: tuple[int, int] = field(init=False)
    # The router.loadvec.LoadTable mirroring this candidate, if any (it sets this).
    table: Touchable | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.key = (self.instance_id, self.dp_rank)

    def touch(self) -> None:
        """Say that the load figures or eligibility changed, so a table mirroring this candidate
        re-reads it before the next selection. Cheap: the re-read is deferred."""
        table = self.table
        if table is not None:
            table.touch(self)


class Touchable(Protocol):
    def touch(self, cand: Candidate, /) -> None: ...


class Columns(NamedTuple):
    """Some rows of a :class:`router.loadvec.LoadTable` as numpy columns, in row order: what the
    vectorised form of a cost reads (the table writes them, the costs only read)."""

    block: Ints  # block size
    prefill: Ints  # active prefill tokens
    decode: Ints  # decode blocks
    requests: Ints  # active requests
    # The time cost's figures, one array per entry of router.cost.time.timing_figures
    # (None unless asked for: the block cost does not read them).
    timing: Floats | None
    # Positions (within these rows) of the given keys that are there, and which keys those were.
    locate: Callable[[list[WorkerKey]], tuple[Rows, Found]]


def located_overlaps(cols: Columns, overlaps: Mapping[WorkerKey, Overlap]) -> tuple[Rows, Ints]:
    """Positions of the ranks that hold part of the prompt (within ``cols``), and their overlaps as
    an array of (device, host, disk, shared) rows, same order."""
    pos, keep = cols.locate(list(overlaps))
    flat = np.fromiter(
        itertools.chain.from_iterable(overlaps.values()), dtype=np.int64, count=4 * len(overlaps)
    )
    return pos, flat.reshape(-1, 4)[keep]


def pick(cost: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index of the chosen candidate. Raises ValueError on an empty sequence."""
    if not cost:
        raise ValueError("no candidates")
    c_min = min(cost)
    if temperature <= 0.0:
        first = cost.index(c_min)
        if min(min(cost[:first], default=math.inf), min(cost[first + 1:], default=math.inf)) - c_min > TIE_EPS:
            return first  # (the usual case, found in C)
        ties = [i for i, c in enumerate(cost) if c - c_min <= TIE_EPS]
        return ties[rng.randrange(len(ties))]
    c_max = max(cost)
    span = c_max - c_min
    if span <= TIE_EPS:
        return rng.randrange(len(cost))
    denom = span * temperature
    weights = [math.exp(-(c - c_min) / denom) for c in cost]
    return sample(weights, rng)


def probabilities(cost: Sequence[float], temperature: float) -> list[float]:
    """The distribution :func:`pick` samples from when T > 0 (for tests and docs)."""
    c_min, c_max = min(cost), max(cost)
    span = c_max - c_min
    if span <= TIE_EPS:
        return [1.0 / len(cost)] * len(cost)
    weights = [math.exp(-(c - c_min) / (span * temperature)) for c in cost]
    total = sum(weights)
    return [w / total for w in weights]


def sample(weights: Sequence[float], rng: random.Random) -> int:
    total = sum(weights)
    x = rng.random() * total
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if x < acc:
            return i
    return len(weights) - 1


def pick_index(cost: Floats, temperature: float, rng: random.Random) -> int:
    """:func:`pick` over an array: argmin with ties broken uniformly (the same draw over the same
    tie list), or at T > 0 sampling with p ∝ exp(-(c - c_min)/((c_max - c_min)·T)); the weights
    come from ``numpy.exp`` instead of ``math.exp``, which can differ in the last bit: same
    distribution. Raises ValueError on an empty array."""
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


def consolidate(cost: Floats, meet: npt.NDArray[np.bool_], hits: Floats, rng: random.Random) -> int:
    """A TTFT objective's pick (issue 9): among the candidates predicted to meet it (``meet``, at
    least one), those with the most cached blocks (``hits``), and among them the least cost, ties
    uniformly at random (DESIGN §5's tie-break)."""
    best_hit = hits[meet].max()
    masked = np.where(meet & (hits >= best_hit), cost, np.inf)
    ties = np.flatnonzero(masked - masked.min() <= 1e-9)
    return int(ties[0]) if len(ties) == 1 else int(ties[rng.randrange(len(ties))])
