"""A calibration that tells a worker's load from its speed, and forgets what its pool has moved
past (decision 110). No network.

Two ways a per-worker fit kept the time cost from spreading a load: TTFTs that grow with the
requests running were fitted as a slower worker (one measured busy looked slow when idle, and one
measured idle looked quick when busy), and a worker that a fit made look slow was not chosen, so
never measured again: its window kept the burst it was fitted in."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from controlplane.protocol.events import MembershipEvent
from router.calibration import EXPIRE_WINDOWS, SWEEP_EVERY, Calibration, Calibrations
from router.commands import ApplyMembership, LoadKvDump, RequestDone, RequestFirstToken, SelectWorker
from router.cost.time import DEFAULT_TIMING, Timing
from router.metrics import RouterMetrics
from router.scheduler import Scheduler
from router.timing_fit import PrefillObservation
from tests.unit.test_router_fits import BUDGET, join_event, req, sched

# A worker whose first tokens and decode steps take longer with each request running there.
LOADED = replace(DEFAULT_TIMING, running_ms=1.5, decode_running_ms=0.2)


def ttft(t: Timing, q: float, n: float, running: int, u: float) -> float:
    return PrefillObservation(q, n, running, u, BUDGET, 0.0, 0.0).ttft_ms(t)


def observe(cal: Calibration | Calibrations, rng: random.Random, count: int, running: tuple[int, int], *,
            truth: Timing = LOADED, wid: int = 1) -> None:
    """``count`` finished requests sent while ``running`` (a range) requests ran there."""
    for _ in range(count):
        q = rng.choice([0, 0, rng.randrange(0, 8000)])
        n = rng.randrange(50, 6000)
        run = rng.randrange(*running)
        u = rng.random() * 0.5
        obs = PrefillObservation(q, n, run, u, BUDGET, ttft(truth, q, n, run, u) * rng.uniform(0.99, 1.01), 0.0)
        itl = truth.decode_step_ms(u, run) * rng.uniform(0.99, 1.01)
        if isinstance(cal, Calibrations):
            cal.observe_first_token(wid, obs)
        else:
            cal.observe_ttft(obs)
            cal.observe_decode(u, itl, running=run)


def test_a_fit_learns_what_each_running_request_adds_to_a_first_token_and_a_decode_step() -> None:
    cal = Calibration(DEFAULT_TIMING, window=256, min_samples=16)
    observe(cal, random.Random(1), 256, (0, 60))
    t = cal.timing
    assert cal.prefill_fitted and cal.decode_fitted
    assert t.running_ms == pytest.approx(LOADED.running_ms, rel=0.1)
    assert t.decode_running_ms == pytest.approx(LOADED.decode_running_ms, rel=0.1)
    for name in ("p0", "p1", "d0"):  # the worker's own speed is not mistaken for its load
        assert getattr(t, name) == pytest.approx(getattr(LOADED, name), rel=0.1), name
    # A worker whose load costs nothing is fitted so.
    flat = Calibration(DEFAULT_TIMING, window=256, min_samples=16)
    observe(flat, random.Random(2), 256, (0, 60), truth=DEFAULT_TIMING)
    assert flat.timing.running_ms < 0.02 and flat.timing.decode_running_ms < 0.002


def test_a_worker_measured_busy_is_predicted_as_quick_as_its_twin_when_both_are_idle() -> None:
    """Twin workers: one measured through a burst (40-60 requests running), one only quiet (0-5).
    Idle, both are predicted what the truth says; fitted without the running requests, the one
    measured busy was predicted several times slower idle, and an idle worker lost every selection
    to a busy one."""
    rng = random.Random(3)
    busy, quiet = (Calibration(DEFAULT_TIMING, window=128, min_samples=16) for _ in range(2))
    observe(busy, rng, 64, (0, 6))
    observe(busy, rng, 64, (40, 60))
    observe(quiet, rng, 128, (0, 6))
    for q, n in ((0, 300), (2000, 1000), (0, 6000)):
        want = ttft(LOADED, q, n, 0, 0.1)
        assert ttft(busy.timing, q, n, 0, 0.1) == pytest.approx(want, rel=0.1), (q, n)
        assert ttft(quiet.timing, q, n, 0, 0.1) == pytest.approx(want, rel=0.1), (q, n)
        # ... and busy, the quiet one's fit still charges the requests running there.
        assert ttft(quiet.timing, q, n, 50, 0.1) == pytest.approx(ttft(LOADED, q, n, 50, 0.1), rel=0.1), (q, n)


def test_a_workers_observations_expire_once_its_pool_has_moved_on_without_it() -> None:
    window = 32
    cals = Calibrations(["m"])
    for wid in (1, 2):
        cals.join(wid, "m", DEFAULT_TIMING, window=window, min_samples=8)
    rng = random.Random(4)
    # Worker 1 is fitted through a burst its features do not explain (four times its speed).
    observe(cals, rng, window, (0, 1), truth=replace(DEFAULT_TIMING, p0=4 * DEFAULT_TIMING.p0,
                                                      p1=4 * DEFAULT_TIMING.p1), wid=1)
    slow = cals.workers[1].timing
    assert cals.workers[1].prefill_fitted and slow.p1 > 3 * DEFAULT_TIMING.p1
    # Then its pool serves on without it: its fit holds while the pool has seen fewer than
    # EXPIRE_WINDOWS windows per worker since ...
    horizon = EXPIRE_WINDOWS * window * 2
    seen = window
    changed: list[int] = []
    quick = PrefillObservation(0, 500, 0, 0.1, BUDGET, ttft(DEFAULT_TIMING, 0, 500, 0, 0.1), 0.0)
    while seen + 1 - horizon <= window:  # worker 1's last observation is still inside the horizon
        changed += cals.observe_first_token(2, quick)
        seen += 1
        assert cals.workers[1].timing == slow, seen
    # ... and goes back to its prior at the next sweep past it (times its pool's scale, 1 here:
    # worker 2 runs at its prior's speed); worker 2, measured meanwhile, keeps its fit.
    for _ in range(SWEEP_EVERY):
        changed += cals.observe_first_token(2, quick)
    assert cals.workers[1].timing == DEFAULT_TIMING and not cals.workers[1].own
    assert 1 in changed and cals.expired == 1
    assert cals.workers[2].prefill_fitted


def test_the_scheduler_chooses_again_a_worker_a_burst_made_look_slow() -> None:
    """Through the pure core: worker 1's fit says it is four times slower than it is; every request
    goes to worker 2 (each finishes before the next, so load never tips it back) until the pool has
    served two windows per worker without worker 1; then it is scored with its prior, and chosen."""
    s: Scheduler = sched(background=False, calibration_window=32, calibration_min_samples=8)
    for wid in (1, 2):
        event: MembershipEvent = join_event(wid)
        s._dispatch(ApplyMembership(event))
        s._dispatch(LoadKvDump(wid, None, final=True))
    rng = random.Random(5)
    observe(s.timings, rng, 32, (0, 1), wid=1,
            truth=replace(DEFAULT_TIMING, p0=4 * DEFAULT_TIMING.p0, p1=4 * DEFAULT_TIMING.p1))
    s._retime(1)
    chosen = []
    for i in range(400):
        sel = s._dispatch(SelectWorker(req(i, rng), seq=i))
        chosen.append(sel.instance_id)
        s._dispatch(RequestFirstToken(sel.booking_id, ttft_ms=DEFAULT_TIMING.prefill_ms(sel.prompt_tokens, BUDGET)[0]))
        s._dispatch(RequestDone(sel.booking_id, itl_ms=DEFAULT_TIMING.decode_step_ms(0.0), decode_tokens=20))
    back = chosen.index(1)
    assert EXPIRE_WINDOWS * 32 * 2 - 32 <= back <= EXPIRE_WINDOWS * 32 * 2 + SWEEP_EVERY, back
    assert chosen[back:].count(1) > 50  # and it takes its share from then on


def test_metrics_show_the_per_request_coefficients_and_count_the_expiries() -> None:
    cals = Calibrations(["m"])
    cals.join(1, "m", DEFAULT_TIMING, window=64, min_samples=8)
    observe(cals, random.Random(6), 64, (0, 60), wid=1)
    metrics = RouterMetrics()
    metrics.set_calibration(cals.status(), 2)
    metrics.set_calibration(cals.status(), 3)
    text = metrics.render().decode()
    r = cals.workers[1].timing.running_ms
    assert r > 0
    assert f'rudder_router_timing_coefficient{{coefficient="r",instance_id="1",model="m"}} {r}' in text
    assert 'rudder_router_timing_coefficient{coefficient="dn",instance_id="1",model="m"}' in text
    assert "rudder_router_calibration_expiries_total 3.0" in text
