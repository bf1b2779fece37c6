"""The per-worker timing fit (router.calibration) and the time cost (router.cost.time), in both its forms.
No network."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from router.calibration import Calibration, RunningMean
from router.cost.common import NO_OVERLAP, Candidate, Overlap, SelectionParams, pick
from router.cost.time import (
    DEFAULT_TIMING,
    Timing,
    predict,
    row_costs,
    time_costs,
    time_row,
    vector_time_costs,
)
from router.loadvec import LoadTable
from router.timing_fit import EARLY_SAMPLES, PrefillObservation

TRUE = Timing(p0=33.0, p1=0.03, p2=8.4e-7, d0=11.5, d1=108.0, d2=-51.5, decode_min_ms=2.0)
BUDGET = 8192


def true_ttft(t: Timing, q: float, n: float, running: int, u: float) -> float:
    ms, steps = t.prefill_ms(q + n, BUDGET)
    return ms + (steps * t.decode_step_ms(u) if running else 0.0)


def observations(rng: random.Random, t: Timing, count: int, noise: float = 0.01) -> list[PrefillObservation]:
    out = []
    for _ in range(count):
        q = rng.choice([0, 0, rng.randrange(0, 20000)])
        n = rng.randrange(50, 9000)
        running = rng.randrange(0, 4)
        u = rng.random() * 0.6
        measured = true_ttft(t, q, n, running, u) * (1 + rng.uniform(-noise, noise))
        out.append(PrefillObservation(q, n, running, u, BUDGET, measured, predicted_ms=0.0))
    return out


def close(a: float, b: float, rel: float = 0.05) -> bool:
    return abs(a - b) <= rel * abs(b)


def fitted(cal: Calibration, rng: random.Random, n: int = 200) -> Timing:
    for u in (rng.random() * 0.8 for _ in range(n)):
        cal.observe_decode(u, TRUE.decode_step_ms(u) * (1 + rng.uniform(-0.01, 0.01)))
    for obs in observations(rng, TRUE, n):
        cal.observe_ttft(obs)
    return cal.timing


def test_fit_recovers_a_known_model_within_5_percent() -> None:
    cal = Calibration(DEFAULT_TIMING, window=256, min_samples=16)
    t = fitted(cal, random.Random(1))
    assert cal.prefill_fitted and cal.decode_fitted
    for name in ("p0", "p1", "p2", "d0", "d1", "d2"):
        assert close(getattr(t, name), getattr(TRUE, name)), (name, getattr(t, name), getattr(TRUE, name))


def test_one_slow_outlier_is_bounded() -> None:
    rng = random.Random(2)
    cal = Calibration(DEFAULT_TIMING, window=256, min_samples=16)
    fitted(cal, rng, 150)
    clean = cal.timing
    obs = observations(rng, TRUE, 1)[0]
    # Ten seconds late (a GC pause, a stuck connection): the fit barely moves.
    cal.observe_ttft(PrefillObservation(obs.queued_tokens, obs.uncached_tokens, obs.running, obs.kv_usage,
                                        BUDGET, obs.measured_ms + 10_000, 0.0))
    for obs in observations(rng, TRUE, 3):  # the next refit includes the outlier
        cal.observe_ttft(obs)
    for name in ("p0", "p1", "p2"):
        assert close(getattr(cal.timing, name), getattr(clean, name), 0.02), name
        assert close(getattr(cal.timing, name), getattr(TRUE, name)), name
    # The outlier's prediction error is counted (the error statistics are honest), the fit is not.
    mae, p90 = cal.error()
    assert mae is not None and p90 is not None and mae > 10_000 / 160


def test_prior_until_enough_samples_then_reset() -> None:
    """The prior, then (issue 16) the prior scaled to the first observations, and the full fit
    only from ``min_samples`` on."""
    rng = random.Random(3)
    prior = Timing(p0=16.5, p1=0.0152, p2=4.2e-7, d0=5.74, d1=54.01, d2=-25.74, decode_min_ms=1.0, source="mock")
    cal = Calibration(prior, window=64, min_samples=20)
    first = observations(rng, TRUE, 19)
    for obs in first[:EARLY_SAMPLES - 1]:
        cal.observe_ttft(obs)
    assert cal.timing == prior and not cal.prefill_fitted
    for obs in first[EARLY_SAMPLES - 1:]:
        cal.observe_ttft(obs)
    k = cal.timing.p1 / prior.p1  # one coefficient for the whole model, no fit of its shape
    assert not cal.prefill_fitted and cal.timing.source == "scaled" and k > 1.5
    assert cal.timing == replace(prior, p0=k * prior.p0, p1=k * prior.p1, p2=k * prior.p2, d0=k * prior.d0,
                                 d1=k * prior.d1, d2=k * prior.d2, decode_min_ms=k * prior.decode_min_ms,
                                 source="scaled")
    cal.observe_ttft(observations(rng, TRUE, 1)[0])
    assert cal.prefill_fitted and cal.timing.p1 != prior.p1 and cal.timing.p1 != k * prior.p1
    assert cal.snapshot()["prefill_samples"] == 20
    cal.reset()
    assert cal.timing == prior and cal.snapshot()["observations"] == 0 and cal.error() == (None, None)


def test_window_is_bounded_and_configurable() -> None:
    cal = Calibration(DEFAULT_TIMING, window=32, min_samples=8)
    for obs in observations(random.Random(4), TRUE, 100):
        cal.observe_ttft(obs)
    assert cal.snapshot()["prefill_samples"] == 32
    cal.configure(window=16, min_samples=20)
    assert cal.snapshot()["prefill_samples"] == 16 and not cal.prefill_fitted


def test_a_slower_worker_fits_to_a_slower_model() -> None:
    """Same prior, observations of a worker twice as slow: the fitted prefill doubles."""
    slow = Timing(TRUE.p0 * 2, TRUE.p1 * 2, TRUE.p2 * 2, TRUE.d0 * 2, TRUE.d1 * 2, TRUE.d2 * 2, 4.0)
    cal = Calibration(TRUE, window=128, min_samples=16)
    rng = random.Random(5)
    for u in (rng.random() * 0.8 for _ in range(50)):
        cal.observe_decode(u, slow.decode_step_ms(u))
    for obs in observations(rng, slow, 100, noise=0.0):
        cal.observe_ttft(obs)
    assert close(cal.timing.prefill_ms(4000, BUDGET)[0], slow.prefill_ms(4000, BUDGET)[0], 0.05)


def test_running_mean() -> None:
    m = RunningMean(window=2, initial=7.0)
    assert m.value == 7.0
    for v in (1.0, 3.0, 5.0):
        m.add(v)
    assert m.value == 4.0


# -- the time cost ------------------------------------------------------------------------------


def cand(wid: int, *, prefill: int = 0, blocks: int = 0, requests: int = 0, timing: Timing | None = None) -> Candidate:
    c = Candidate(wid, 0, 64, prefill, blocks, requests, kv_total_blocks=16384, batch_tokens=8192, timing=timing)
    return c


def test_time_cost_is_the_engine_time_to_first_token() -> None:
    params = SelectionParams(decode_slowdown_weight=0.0, prefill_interference_weight=0.0)
    idle, busy = cand(1), cand(2, prefill=8192, blocks=1000, requests=3)
    cost, ttft = time_costs([idle, busy], params, 4096, overlaps={})
    assert ttft[0] == pytest.approx(DEFAULT_TIMING.prefill_step_ms(4096))
    # 12288 tokens: one full step and one of 4096, each with a decode pass at u = 1000/16384.
    step = DEFAULT_TIMING.decode_step_ms(1000 / 16384)
    want = DEFAULT_TIMING.prefill_step_ms(8192) + DEFAULT_TIMING.prefill_step_ms(4096) + 2 * step
    assert ttft[1] == pytest.approx(want)
    assert cost == ttft


def test_cache_credit_is_prefill_time_saved_and_tiers_weigh() -> None:
    params = SelectionParams(decode_slowdown_weight=0.0, prefill_interference_weight=0.0)
    c = cand(1)
    cost, _ = time_costs([c, cand(2), cand(3)], params, 4096, overlaps={
        (1, 0): Overlap(device=40), (3, 0): Overlap(host=40)})
    assert cost[0] == pytest.approx(DEFAULT_TIMING.prefill_step_ms(4096 - 40 * 64))
    assert cost[0] < cost[2] < cost[1]
    # A whole-prompt hit still computes the last token's block (vLLM's rule).
    full, _ = time_costs([c], params, 4096, overlaps={(1, 0): Overlap(device=64)})
    assert full[0] == pytest.approx(DEFAULT_TIMING.prefill_step_ms(64))


def test_a_slower_worker_costs_more_for_the_same_work() -> None:
    slow = Timing(*(2 * v for v in (DEFAULT_TIMING.p0, DEFAULT_TIMING.p1, DEFAULT_TIMING.p2,
                                    DEFAULT_TIMING.d0, DEFAULT_TIMING.d1, DEFAULT_TIMING.d2)), 2.0)
    cost, _ = time_costs([cand(1), cand(2, timing=slow)], SelectionParams(), 2000, overlaps={})
    assert cost[1] == pytest.approx(2 * cost[0])


def test_decode_slowdown_counts_running_requests() -> None:
    params = SelectionParams(decode_slowdown_weight=1.0, prefill_interference_weight=0.0)
    lone, crowded = cand(1, blocks=500, requests=1), cand(2, blocks=500, requests=20)
    cost, ttft = time_costs([lone, crowded], params, 4096, overlaps={}, decode_tokens=32)
    assert ttft[0] == ttft[1]
    assert cost[1] - ttft[1] == pytest.approx(20 * (cost[0] - ttft[0]))
    assert cost[0] > ttft[0]


def test_predict_matches_the_loop() -> None:
    rng = random.Random(9)
    params = SelectionParams(overlap_score_credit_decay=0.5, host_cache_hit_weight=0.5)
    cands = [cand(i, prefill=rng.randrange(20000), blocks=rng.randrange(8000), requests=rng.randrange(5))
             for i in range(1, 30)]
    overlaps = {(i, 0): Overlap(device=rng.randrange(60), host=rng.randrange(5)) for i in range(1, 30, 3)}
    cost, ttft = time_costs(cands, params, 5000, overlaps=overlaps, decode_tokens=20)
    least = min(c.active_prefill_tokens for c in cands)
    for c, want_cost, want_ttft in zip(cands, cost, ttft, strict=True):
        pred = predict(c, params, 5000, overlaps.get(c.key, NO_OVERLAP), least_prefill=least, decode_tokens=20)
        assert pred.cost_ms == pytest.approx(want_cost) and pred.ttft_ms == pytest.approx(want_ttft)


def test_prefill_interference_is_the_running_requests_delay() -> None:
    """Its prefill lengthens the steps the running requests decode in: r · (prefill(Q+N) - prefill(Q))."""
    params = SelectionParams(decode_slowdown_weight=0.0, prefill_interference_weight=1.0)
    busy = cand(1, prefill=3000, blocks=500, requests=4)
    cost, ttft = time_costs([busy, cand(2)], params, 4096, overlaps={})
    own = DEFAULT_TIMING.prefill_ms(7096, 8192)[0] - DEFAULT_TIMING.prefill_ms(3000, 8192)[0]
    assert cost[0] - ttft[0] == pytest.approx(4 * own)
    assert cost[1] == ttft[1]  # nothing running there: nobody to delay
    # A cached prefix makes the interference small: the session stays where its cache is.
    cached, _ = time_costs([busy], params, 4096, overlaps={(1, 0): Overlap(device=60)})
    assert cached[0] < cost[0] / 2


# -- the time cost over kept rows: the argmin shortcut and the load table's cache -----------------


def _random_timing(rng: random.Random) -> Timing:
    # A fitted model may charge each running request a first token's and a decode step's share.
    per_request = {"running_ms": rng.choice((0.0, 0.3, 2.0)), "decode_running_ms": rng.choice((0.0, 0.05))}
    if rng.random() < 0.15:  # an advertised model whose prefill does not grow: never pruned
        return Timing(rng.uniform(-5, 5), rng.uniform(-0.01, 0.02), rng.uniform(-1e-6, 1e-6), 5.0, 50.0, -20.0, 1.0,
                      **per_request)
    k = rng.choice((0.5, 1.0, 2.0))
    return Timing(*(k * v for v in (DEFAULT_TIMING.p0, DEFAULT_TIMING.p1, DEFAULT_TIMING.p2)),
                  DEFAULT_TIMING.d0, DEFAULT_TIMING.d1, DEFAULT_TIMING.d2, 1.0, **per_request)


@pytest.mark.parametrize("seed", range(30))
def test_argmin_shortcut_finds_the_same_least_cost_and_ties(seed: int) -> None:
    """Rows pruned by their floor could not have been the least cost or tied with it: the
    shortcut's finite costs hold the same minimum and the same tie set as the full costs, with
    or without the rows kept in floor order."""
    rng = random.Random(seed)
    params = SelectionParams(prefill_interference_weight=rng.choice((0.0, 1.0, 2.5)),
                             overlap_score_credit_decay=rng.choice((0.0, 0.5)))
    timings = [_random_timing(rng) for _ in range(3)]
    cands = []
    for i in range(1, rng.randrange(2, 80)):
        # Copies of a few load figures make exact ties likely.
        cands.append(cand(i, prefill=rng.choice((0, 500, 3000, rng.randrange(20000))),
                          blocks=rng.choice((0, 400, rng.randrange(8000))),
                          requests=rng.choice((0, 2, rng.randrange(30))), timing=rng.choice(timings)))
    rows = [time_row(c) for c in cands]
    order = sorted(range(len(rows)), key=lambda i: rows[i].floor_ms)
    overlaps = {c.key: Overlap(device=rng.randrange(1, 60)) for c in rng.sample(cands, min(3, len(cands)))}
    p = rng.choice((1, 64, 4096, 9000))
    full, _ = row_costs(rows, params, p, overlaps=overlaps)
    least = min(full)
    ties = {i for i, x in enumerate(full) if x - least <= 1e-9}
    for kept_order in (order, None):
        short, ttfts = row_costs(rows, params, p, overlaps=overlaps, argmin_only=True, order=kept_order)
        assert ttfts == []
        assert min(short) == least
        assert {i for i, x in enumerate(short) if x - least <= 1e-9} == ties
        assert all(s == f or s == math.inf for s, f in zip(short, full, strict=True))
    assert pick(short, 0.0, random.Random(seed)) == pick(full, 0.0, random.Random(seed))


def test_plain_rows_cost_what_predict_says() -> None:
    rng = random.Random(3)
    params = SelectionParams(prefill_interference_weight=1.5)
    cands = [cand(i, prefill=rng.randrange(20000), blocks=rng.randrange(8000), requests=rng.randrange(5),
                  timing=_random_timing(rng)) for i in range(1, 40)]
    cost, ttft = row_costs([time_row(c) for c in cands], params, 3000, overlaps={})
    for c, want_cost, want_ttft in zip(cands, cost, ttft, strict=True):
        pred = predict(c, params, 3000, NO_OVERLAP)
        assert pred.cost_ms == pytest.approx(want_cost) and pred.ttft_ms == pytest.approx(want_ttft)


@pytest.mark.parametrize("seed", range(30))
def test_vectorised_time_costs_equal_the_loop_up_to_rounding(seed: int) -> None:
    """The numpy form over a load table's columns gives the scalar form's costs and TTFTs for the
    eligible rows, in the same order, with every term of the cost in play."""
    rng = random.Random(seed)
    sizes = (64,) if seed % 3 else (16, 64)
    params = SelectionParams(
        overlap_score_credit_decay=rng.choice((0.0, 0.5)), host_cache_hit_weight=rng.random(),
        decode_slowdown_weight=rng.choice((0.0, 1.0)), prefill_interference_weight=rng.choice((0.0, 0.1, 2.0)),
        arrival_wait_weight=rng.choice((0.0, 1.0)))
    timings = [_random_timing(rng) for _ in range(3)]
    cands = [Candidate(i, 0, rng.choice(sizes), rng.choice((0, rng.randrange(20000))), rng.randrange(8000),
                       rng.choice((0, rng.randrange(30))), kv_total_blocks=16384, batch_tokens=8192,
                       timing=rng.choice(timings), arrival_rate=rng.choice((0.0, rng.random() / 100)))
             for i in range(1, rng.randrange(2, 200))]
    table: LoadTable[Candidate] = LoadTable(lambda c: c.active_requests != 13)
    for c in cands:
        table[c.key] = c
    p = rng.choice((1, 64, 4096, 9000, rng.randrange(1, 20000)))
    overlaps = {c.key: Overlap(rng.randrange(0, 80), rng.randrange(0, 5)) for c in rng.sample(cands, len(cands) // 3)}
    shared = {c.key: rng.randrange(0, 10) for c in rng.sample(cands, len(cands) // 4)}
    request_blocks = {b: -(-p // b) for b in sizes}
    rows = table.eligible_rows()
    chosen = cands if rows is None else [cands[i] for i in rows.tolist()]
    if not chosen:
        return
    loop = time_costs(chosen, params, p, overlaps=overlaps, request_blocks=request_blocks, booked_shared=shared,
                      decode_tokens=20)
    vec = vector_time_costs(table.columns(rows, timing=True), params, p, overlaps=overlaps,
                            request_blocks=request_blocks, booked_shared=shared, decode_tokens=20)
    assert vec[0].tolist() == pytest.approx(loop[0], rel=1e-9)
    assert vec[1].tolist() == pytest.approx(loop[1], rel=1e-9)


def test_load_table_keeps_its_selectable_rows_and_floor_order_current() -> None:
    rng = random.Random(11)
    table: LoadTable[Candidate] = LoadTable(lambda c: c.active_requests < 25)
    plain: dict[tuple[int, int], Candidate] = {}
    for step in range(2000):
        op = rng.random()
        key = (rng.randrange(1, 40), 0)
        if op < 0.2:
            table[key] = plain[key] = cand(key[0], prefill=rng.randrange(9000), requests=rng.randrange(30),
                                           timing=_random_timing(rng))
        elif op < 0.3 and plain:
            key = rng.choice(list(plain))
            del table[key], plain[key]
        elif plain:
            c = plain[rng.choice(list(plain))]
            c.active_prefill_tokens = rng.randrange(9000)
            c.decode_blocks = rng.randrange(4000)
            c.active_requests = rng.randrange(30)
            if rng.random() < 0.1:
                c.timing = _random_timing(rng)
            c.touch()
        if step % 7 == 0:
            exclude = frozenset({rng.randrange(1, 40)}) if step % 21 == 0 else frozenset()
            got = table.selectable(exclude)
            want = [c for c in plain.values() if c.active_requests < 25 and c.instance_id not in exclude]
            assert got.candidates == want
            assert got.time_rows == [time_row(c) for c in want]
            assert got.positions == {c.key: i for i, c in enumerate(want)}
            if got.order is not None:
                assert sorted(got.order) == list(range(len(want)))
                floors = [got.time_rows[i].floor_ms for i in got.order]
                assert floors == sorted(floors)


def test_a_narrow_range_of_kv_usage_scales_the_prior_curve_instead_of_extrapolating() -> None:
    """Inter-token times seen only at u in [0.02, 0.08] (a lightly loaded fleet), 1.3 times the prior:
    the fit keeps the prior's shape, scaled, so it still predicts sensibly at u = 0.5 (a free
    quadratic through such data bends anywhere, down to the floor, outside the range)."""
    rng = random.Random(12)
    cal = Calibration(DEFAULT_TIMING, window=256, min_samples=16)
    for _ in range(120):
        u = rng.uniform(0.02, 0.08)
        cal.observe_decode(u, 1.3 * DEFAULT_TIMING.decode_step_ms(u) * (1 + rng.uniform(-0.2, 0.2)))
    assert cal.decode_fitted
    for u in (0.05, 0.3, 0.5, 0.9):
        assert close(cal.timing.decode_step_ms(u), 1.3 * DEFAULT_TIMING.decode_step_ms(u), 0.08), u
