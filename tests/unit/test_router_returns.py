"""router.returns: the requests each rank expects back (the time cost's λ). Pure, no network."""

from __future__ import annotations

import math
import random

import pytest

from router import returns as mod
from router.returns import Returns

A, B = (1, 0), (2, 0)


def posterior(p: float, tau: float, age: float) -> float:
    """π(a): the chance that an entry still open at age a comes back (the module docstring)."""
    e = p * math.exp(-age / tau)
    return e / (1 - p + e)


def test_a_finished_request_is_expected_back_at_its_posterior_rate() -> None:
    r = Returns()
    r.finished(A, [11, 12, 13], 100.0)
    tau = mod.PRIOR_DELAY_S
    p = (mod.PRIOR_FRACTION * mod.PRIOR_WEIGHT) / (mod.PRIOR_WEIGHT + 1)  # the finish counts
    assert r.fraction == pytest.approx(p)
    assert r.rate(A, 100.0) == pytest.approx(p / (tau * 1000))
    later = 100.0 + 2 * tau
    assert r.rate(A, later) == pytest.approx(posterior(p, tau, 2 * tau) / (tau * 1000))
    assert r.rate(A, later) > p * math.exp(-2) / (tau * 1000)  # above the unconditional density
    assert r.rate(B, 100.0) == 0.0


def test_a_return_closes_its_entry_and_teaches_the_delay_and_the_fraction() -> None:
    r = Returns()
    r.finished(A, [11, 12, 13], 100.0)
    r.finished(A, [21, 22], 100.0)
    # The next turn of the first: the earlier prompt's blocks, then its own.
    assert r.arrived([11, 12, 13, 14, 15], 101.0) == A
    assert len(r) == 1
    assert r.delay_s < mod.PRIOR_DELAY_S  # one return after 1 s
    assert r.rate(A, 101.0) == pytest.approx(posterior(r.fraction, r.delay_s, 1.0) / (r.delay_s * 1000))
    f = r.fraction
    assert f > (mod.PRIOR_FRACTION * mod.PRIOR_WEIGHT) / (mod.PRIOR_WEIGHT + 2)
    assert r.arrived([11, 12, 13, 14, 15], 102.0) is None  # closed already
    assert r.arrived([99, 12], 102.0) is None  # another conversation: a different chain
    assert r.fraction == pytest.approx(f, rel=1e-2)


def test_the_delay_is_learnt_from_the_returns_seen() -> None:
    r = Returns()
    for i in range(300):
        r.finished(A, [i], float(i))
        assert r.arrived([i, 10_000 + i], i + 2.0) == A
    assert r.delay_s == pytest.approx(2.0, rel=0.02)
    assert r.fraction > 0.95


def test_traffic_that_never_comes_back_expects_nothing() -> None:
    r = Returns()
    for i in range(400):
        r.finished(A, [i], i * 0.5)
    assert r.fraction < 0.05
    assert r.rate(A, 200.0) < 0.05 * len(r) / (mod.PRIOR_DELAY_S * 1000)  # < 5 % of "all back"
    assert len(r) <= mod.HORIZON_DELAYS * mod.PRIOR_DELAY_S / 0.5 + 1  # old entries dropped


def test_each_rank_expects_the_sum_of_its_open_entries_posteriors() -> None:
    """Random finishes on two ranks, 70 % of them back after a random delay: at any time, each
    rank's rate is Σ π(age)/τ over its entries still open, computed naively."""
    rng = random.Random(3)
    r = Returns()
    waiting: dict[int, tuple[tuple[int, int], float]] = {}  # not (yet) back
    due: dict[int, float] = {}  # those that will come back, and when
    now = 0.0
    for h in range(400):
        then = now + rng.expovariate(2.0)
        for k, at in sorted(((k, at) for k, at in due.items() if at <= then), key=lambda kv: kv[1]):
            now = at
            assert r.arrived([k, 1], now) == waiting.pop(k)[0]
            del due[k]
        now = then
        key = A if rng.random() < 0.6 else B
        r.finished(key, [10_000 + h], now)
        waiting[10_000 + h] = (key, now)
        if rng.random() < 0.7:
            due[10_000 + h] = now + rng.expovariate(1 / 3.0)
        if h % 37 == 0:
            p, tau = r.fraction, r.delay_s
            for rank in (A, B):
                naive = sum(posterior(p, tau, now - at) for k, at in waiting.values()
                            if k == rank and now - at <= mod.HORIZON_DELAYS * tau)
                assert r.rate(rank, now) == pytest.approx(naive / (tau * 1000), rel=1e-9)
    assert r.delay_s == pytest.approx(3.0, rel=0.3)
    assert r.fraction == pytest.approx(0.7, abs=0.1)


def test_a_rate_is_kept_for_a_sixteenth_of_the_delay_and_follows_its_ranks_entries_meanwhile() -> None:
    r = Returns()
    r.finished(A, [1], 0.0)
    first = r.rate(A, 0.1)
    kept = 0.1 + mod.PRIOR_DELAY_S / 32
    assert r.rate(A, kept) == first  # kept
    r.finished(A, [2], kept)  # a new entry counts at once, at π(0) = p
    with_new = r.rate(A, kept)
    assert with_new == pytest.approx(first + r.fraction / (r.delay_s * 1000), rel=1e-12)
    assert r.arrived([2], kept) == A  # and a closed one is taken away at once
    assert r.rate(A, kept) == pytest.approx(first, rel=1e-12)
    later = 0.1 + mod.PRIOR_DELAY_S / 8  # recomputed, exact (the return moved p and τ meanwhile)
    assert r.rate(A, later) == pytest.approx(posterior(r.fraction, r.delay_s, later) / (r.delay_s * 1000))


def test_a_rank_that_leaves_expects_nothing_its_sessions_may_return_elsewhere() -> None:
    r = Returns()
    r.finished(A, [1, 2], 0.0)
    r.forget([A])
    assert r.rate(A, 0.0) == 0.0
    assert r.arrived([1, 2, 3], 1.0) == A  # the entry closes (the caller finds no slot for it)


def test_the_open_entries_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mod, "MAX_OPEN", 16)
    r = Returns()
    for i in range(100):
        r.finished(A if i % 2 else B, [i], 0.0)
    assert len(r) == 16
    expected = 8 * r.fraction / (mod.PRIOR_DELAY_S * 1000)  # 8 of the kept 16 on each rank, age 0
    assert r.rate(A, 0.0) == pytest.approx(expected)
    assert r.rate(B, 0.0) == pytest.approx(expected)


def test_an_entry_left_open_for_hours_expects_nothing_and_does_not_overflow() -> None:
    """The horizon is enforced when requests finish; a rank idle for hours still answers."""
    r = Returns()
    r.finished(A, [1], 0.0)
    assert r.rate(A, 4 * 3600.0) == 0.0


def test_a_kept_rate_follows_entries_opened_and_closed_between_its_recomputations() -> None:
    """Finishes every few ms on two ranks, half of them back after ~2 s (so τ/16, how long a rate
    is kept, spans dozens of finishes), the rate read after each: the kept rate plus what each
    entry opened or closed since adds or takes away stays within the drift of τ/16 of the exact
    sum, and a read past τ/16 is exact again. Recomputing at every change instead cost
    O(entries) at every request's end."""
    rng = random.Random(5)
    r = Returns()
    waiting: dict[int, tuple[tuple[int, int], float]] = {}
    due: dict[int, float] = {}
    now = 0.0
    worst = 0.0
    for h in range(3000):
        then = now + rng.expovariate(300.0)  # ~300 finishes a second
        for k, at in sorted(((k, at) for k, at in due.items() if at <= then), key=lambda kv: kv[1]):
            now = at
            assert r.arrived([k], now) == waiting.pop(k)[0]
            del due[k]
        now = then
        key = A if rng.random() < 0.5 else B
        r.finished(key, [h], now)
        waiting[h] = (key, now)
        if rng.random() < 0.5:
            due[h] = now + rng.expovariate(1 / 2.0)
        if h < 1000:  # p and τ settle first
            continue
        p, tau = r.fraction, r.delay_s
        for rank in (A, B):
            naive = sum(posterior(p, tau, now - at) for k, at in waiting.values()
                        if k == rank and now - at <= mod.HORIZON_DELAYS * tau) / (tau * 1000)
            got = r.rate(rank, now)
            worst = max(worst, abs(got - naive) / naive)
    assert r.delay_s / 16 > 20 / 300  # a kept rate spans dozens of finishes
    # In τ/16 an entry's π moves by up to 1 - e^(-1/16) (6.1 %) of itself, and p and τ move with
    # every finish and return (a rate recomputed at every change was exact).
    assert worst < 0.1, worst
    # Past τ/16 without a read, the next read recomputes: exact again.
    later = now + r.delay_s / 8
    p, tau = r.fraction, r.delay_s
    naive = sum(posterior(p, tau, later - at) for k, at in waiting.values()
                if k == A and later - at <= mod.HORIZON_DELAYS * tau) / (tau * 1000)
    assert r.rate(A, later) == pytest.approx(naive, rel=1e-9)
