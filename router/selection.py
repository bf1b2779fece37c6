"""Worker selection: the cost function of DESIGN §5 and the comparison modes. Pure.

Per candidate (one worker dp rank), with B its block size, P the prompt tokens, R = ⌈P/B⌉:

    decay  = 1 / (1 + overlap_score_credit_decay · excess / R),
             excess = (active prefill tokens - least active prefill tokens among candidates) / B
    credit = overlap_score_credit·decay·device + host_cache_hit_weight·host
             + disk_cache_hit_weight·disk + shared_cache_multiplier·shared        (in blocks)
    cost   = prefill_load_scale · max((active_prefill_tokens + P)/B - credit, 0)
             + decode_blocks + decode_active_request_weight · active_requests

Temperature 0 picks the argmin, ties uniformly at random; T > 0 samples with
p ∝ exp(-(c - c_min) / ((c_max - c_min)·T)) (all equal → uniform). The random source is passed
in, so tests and benchmarks are reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from controlplane.protocol.policy import SELECTION_PARAMETERS, Number

if TYPE_CHECKING:
    from router.cost import Timing

TIE_EPS = 1e-9  # costs closer than this are a tie (every pick)


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
    # The time cost's (router.cost) and its calibration's (router.calibration).
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
    """One worker dp rank as the cost function sees it. Load figures are already the larger of
    this router's bookings and the worker's last report. ``decode_blocks`` is the rank's distinct
    active blocks; :func:`costs` adds the request's own blocks when told how many there are."""

    instance_id: int
    dp_rank: int
    block_size: int
    active_prefill_tokens: int
    decode_blocks: int
    active_requests: int
    overlap: Overlap = NO_OVERLAP
    # What the time cost (router.cost) needs besides the load figures: the rank's KV blocks, its
    # step budget (max_num_batched_tokens) and its worker's timing model (None: the default).
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


def costs(
    candidates: Sequence[Candidate], params: SelectionParams, prompt_tokens: int, *,
    overlaps: Mapping[tuple[int, int], Overlap] | None = None,
    request_blocks: Mapping[int, int] | None = None,
    booked_shared: Mapping[tuple[int, int], int] | None = None,
) -> list[float]:
    """Cost of each candidate (same order).

    ``overlaps`` (by candidate key) replaces each candidate's own ``overlap`` when given.
    ``request_blocks`` (block size -> R) adds the request's blocks to each candidate's decode
    blocks, less ``booked_shared`` (those already active on it for another booked request), so
    the decode term counts distinct blocks. The loop is written for speed: it runs over every
    candidate of every selection.
    """
    if not candidates:
        return []
    credit_w = params.overlap_score_credit
    decay_w = params.overlap_score_credit_decay
    host_w = params.host_cache_hit_weight
    disk_w = params.disk_cache_hit_weight
    shared_w = params.shared_cache_multiplier
    scale = params.prefill_load_scale
    req_w = params.decode_active_request_weight
    least_prefill = min(c.active_prefill_tokens for c in candidates) if decay_w else 0
    ov_get = overlaps.get if overlaps else None
    p = prompt_tokens
    out: list[float] = []
    append = out.append
    for c in candidates:
        b = c.block_size
        if ov_get is not None:
            ov = ov_get(c.key, NO_OVERLAP)
        elif overlaps is None:
            ov = c.overlap
        else:
            ov = NO_OVERLAP
        if ov is NO_OVERLAP:
            prefill = (c.active_prefill_tokens + p) / b
        else:
            decay = 1.0
            if decay_w:
                r = max(1, -(-p // b))
                excess = (c.active_prefill_tokens - least_prefill) / b
                decay = 1.0 / (1.0 + decay_w * excess / r)
            prefill = (c.active_prefill_tokens + p) / b - (
                credit_w * decay * ov.device + host_w * ov.host + disk_w * ov.disk
                + shared_w * ov.shared
            )
        cost = scale * (prefill if prefill > 0.0 else 0.0) + c.decode_blocks
        if req_w:
            cost += req_w * c.active_requests
        append(cost)
    if request_blocks:
        # One block size (the usual case): add a constant. The router hashes the prompt for every
        # block size of the model's workers, so a single entry means a single size.
        sizes = {c.block_size for c in candidates} if len(request_blocks) != 1 else None
        if sizes is None or len(sizes) == 1:
            (only,) = request_blocks.values() if sizes is None else (
                request_blocks.get(next(iter(sizes)), -(-p // next(iter(sizes)))),
            )
            out = [x + only for x in out]
        else:
            out = [
                x + request_blocks.get(c.block_size, -(-p // c.block_size))
                for x, c in zip(out, candidates, strict=True)
            ]
        if booked_shared:
            for i, c in enumerate(candidates):
                n = booked_shared.get(c.key)
                if n:
                    out[i] -= n
    return out


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


def least_loaded(candidates: Sequence[Candidate], rng: random.Random) -> int:
    """Comparison mode: the candidate with the least load in blocks (queued prefill + active
    decode blocks), then fewest requests; ties uniformly at random. No cache credit."""
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
    """Comparison mode: the next candidate after the last one chosen, by instance id order."""

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
