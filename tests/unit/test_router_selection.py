"""The cost function, temperature sampling and tie-breaking of DESIGN §5."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from router.selection import (
    Candidate,
    Overlap,
    RoundRobin,
    SelectionParams,
    costs,
    least_loaded,
    pick,
    probabilities,
)


def _cand(i: int, *, decode: int, device: int = 0, prefill: int = 0, requests: int = 0) -> Candidate:
    return Candidate(i, 0, 16, prefill, decode, requests, Overlap(device=device))


def test_worked_example_costs_18_10_11_picks_the_second() -> None:
    # credit 1.0, raw prefill 10 blocks each (P = 160 tokens, B = 16), overlaps 2/5/8,
    # decode blocks 10/5/9 → costs 18/10/11 → the second worker.
    cands = [_cand(1, decode=10, device=2), _cand(2, decode=5, device=5), _cand(3, decode=9, device=8)]
    params = SelectionParams(overlap_score_credit=1.0)
    c = costs(cands, params, 160)
    assert c == [18.0, 10.0, 11.0]
    assert pick(c, 0.0, random.Random(0)) == 1


def test_request_blocks_are_added_to_decode_blocks_less_shared_bookings() -> None:
    cands = [_cand(1, decode=10), _cand(2, decode=10)]
    c = costs(cands, SelectionParams(), 160, request_blocks={16: 10}, booked_shared={(2, 0): 4})
    assert c == [30.0, 26.0]


def test_credit_decay_shrinks_credit_of_loaded_workers() -> None:
    params = SelectionParams(overlap_score_credit=1.0, overlap_score_credit_decay=1.0)
    # Worker 2 has 160 more active prefill tokens (10 blocks) than the least; R = 10 →
    # decay = 1 / (1 + 1·10/10) = 0.5 → its credit of 8 blocks counts 4.
    cands = [_cand(1, decode=0), _cand(2, decode=0, device=8, prefill=160)]
    c = costs(cands, params, 160)
    assert c[0] == 10.0
    assert c[1] == pytest.approx((160 + 160) / 16 - 4)


def test_cache_tier_weights_and_load_scale() -> None:
    params = SelectionParams(
        overlap_score_credit=1.0, host_cache_hit_weight=0.5, disk_cache_hit_weight=0.25,
        shared_cache_multiplier=0.1, prefill_load_scale=2.0, decode_active_request_weight=3.0,
    )
    cand = Candidate(1, 0, 16, 0, 1, 2, Overlap(device=1, host=2, disk=4, shared=10))
    # credit = 1 + 1 + 1 + 1 = 4; prefill = 10 - 4 = 6; cost = 2·6 + 1 + 3·2
    assert costs([cand], params, 160) == [19.0]


def test_prefill_term_is_never_negative() -> None:
    cand = Candidate(1, 0, 16, 0, 3, 0, Overlap(device=50))
    assert costs([cand], SelectionParams(), 160) == [3.0]


def test_ties_at_temperature_zero_are_broken_uniformly() -> None:
    rng = random.Random(7)
    counts = Counter(pick([5.0, 3.0, 3.0, 3.0, 9.0], 0.0, rng) for _ in range(30_000))
    assert set(counts) == {1, 2, 3}
    for i in (1, 2, 3):
        assert counts[i] == pytest.approx(10_000, rel=0.05)


def test_temperature_sampling_matches_the_boltzmann_distribution() -> None:
    cost = [10.0, 12.0, 15.0, 20.0]
    t = 0.7
    expected = [math.exp(-(c - 10.0) / (10.0 * t)) for c in cost]
    total = sum(expected)
    expected = [e / total for e in expected]
    assert probabilities(cost, t) == pytest.approx(expected)
    rng = random.Random(12345)
    n = 40_000
    counts = Counter(pick(cost, t, rng) for _ in range(n))
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(expected))
    assert chi2 < 16.27  # χ²(3 dof) at p = 0.001
    # and it is not the argmin-only distribution
    assert counts[3] > 0.05 * n


def test_temperature_with_equal_costs_is_uniform() -> None:
    rng = random.Random(3)
    counts = Counter(pick([4.0, 4.0, 4.0], 2.0, rng) for _ in range(30_000))
    for i in range(3):
        assert counts[i] == pytest.approx(10_000, rel=0.05)


def test_pick_empty_raises() -> None:
    with pytest.raises(ValueError):
        pick([], 0.0, random.Random())


def test_params_from_values_falls_back_to_defaults() -> None:
    p = SelectionParams.from_values({"router_temperature": 0.5, "host_cache_hit_weight": None})
    assert p.router_temperature == 0.5
    assert p.host_cache_hit_weight == 0.75


def test_round_robin_cycles_by_instance_id() -> None:
    cands = [_cand(3, decode=0), _cand(1, decode=0), _cand(2, decode=0)]
    rr = RoundRobin()
    chosen = [cands[rr.pick(cands)].instance_id for _ in range(6)]
    assert chosen == [1, 2, 3, 1, 2, 3]


def test_least_loaded_ignores_cache() -> None:
    cands = [_cand(1, decode=5, device=100), _cand(2, decode=4)]
    assert least_loaded(cands, random.Random(0)) == 1
