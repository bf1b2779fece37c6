"""The block cost: DESIGN §5's cost, in KV blocks (mode ``kv-blocks``). Pure.

Per candidate (one worker dp rank), with B its block size, P the prompt tokens, R = ⌈P/B⌉:

    decay  = 1 / (1 + overlap_score_credit_decay · excess / R),
             excess = (active prefill tokens - least active prefill tokens among candidates) / B
    credit = overlap_score_credit·decay·device + host_cache_hit_weight·host
             + disk_cache_hit_weight·disk + shared_cache_multiplier·shared        (in blocks)
    cost   = prefill_load_scale · max((active_prefill_tokens + P)/B - credit, 0)
             + decode_blocks + decode_active_request_weight · active_requests

:func:`costs` walks the candidates in Python, the quicker way for a few dozen of them;
:func:`vector_costs` computes the same over a load table's numpy columns (a handful of vector
operations, with the prefix credit scattered onto the few ranks that hold part of the prompt),
the quicker way for hundreds to thousands. The arithmetic is the same operation for operation and
in the same order, so the costs are bit-for-bit equal (all figures are integers far below 2**53,
and IEEE-754 float64 arithmetic is the same in numpy as in Python).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from router.cost.common import (
    NO_OVERLAP,
    Candidate,
    Columns,
    Floats,
    Overlap,
    SelectionParams,
    WorkerKey,
    located_overlaps,
)


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


def vector_costs(
    cols: Columns, params: SelectionParams, prompt_tokens: int, *,
    overlaps: Mapping[WorkerKey, Overlap],
    request_blocks: Mapping[int, int] | None = None,
    booked_shared: Mapping[WorkerKey, int] | None = None,
) -> Floats:
    """Cost of each row of ``cols``, in that order: the same numbers :func:`costs` gives for
    those candidates with the same arguments."""
    b, a, decode, requests = cols.block, cols.prefill, cols.decode, cols.requests
    m = len(b)
    if m == 0:
        return np.zeros(0, dtype=np.float64)
    p = prompt_tokens
    prefill: Floats = (a + p) / b
    if overlaps:
        pos, ov = located_overlaps(cols, overlaps)
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
                spos, keep = cols.locate([k for k, _ in items])
                vals = np.array([v for _, v in items], dtype=np.int64)[keep]
                cost[spos] = cost[spos] - vals
    return cost
