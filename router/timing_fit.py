"""The timing model's fits (issue 9, issue 16): pure functions over a copied window of one
worker's observations, so they can run anywhere (inline, or in a thread off the scheduler actor:
router.fitting). Pure: no I/O, no clock; the numpy work of calibration is here and only here.
:mod:`router.calibration` keeps each worker's observations and the model in use.

Every worker starts from a prior (:class:`router.cost.time.Timing`: the timing model its membership
record advertises, or the default) and the router fits it online from what it observes of that
worker's finished requests:

- **prefill**: for each request, the prefill tokens queued ahead of it at selection (``Q``), its
  own uncached tokens (``N``), whether the rank was running requests, its KV usage, and the
  measured time from sending the request to its first token. With ``x = Q + N`` run in steps of at
  most ``M`` tokens (``k`` steps, ``Σn²`` over their sizes), the model is

      TTFT ≈ p0·k + p1·x + p2·Σn² + k·decode_step(u)·[running] + r·running

  linear in (p0, p1, p2, r) once the decode term (from the decode fit) is subtracted. ``r`` is
  what each request already running there adds beyond the decode pass (a step's per-sequence
  work, the worker process's per-request overhead; 0 in every prior): without it, TTFTs that grow
  with the requests running were fitted as a large ``p0``, an idle worker looked as slow as a busy
  one and a busy one as quick as an idle one, and the cheapest worker drew bursts (decision 110);
- **decode**: each streamed request's mean inter-token time against the KV usage it ran at and
  the requests running there when it was sent (``n``):
  ``ITL ≈ d0 + d1·u + d2·u² + dn·n`` when the observed usage spans ``DECODE_SHAPE_SPAN`` or more,
  else ``ITL ≈ k·prior(u) + dn·n`` (a narrow range tells the curve's level, not its shape), with
  ``dn ≥ 0`` (0 in every prior): a step's per-sequence work, which a curve over KV usage alone
  put into its level, so that a worker measured busy looked slow when idle (decision 110).

Both fits are robust and bounded: the last ``window`` observations only, Huber-weighted
iteratively reweighted least squares (a slow outlier's pull is capped at 1.345 robust standard
deviations), a light ridge toward the prior (columns scaled, so a narrow range of N or u leaves the
unidentified coefficients at the prior instead of anywhere), and no negative prefill coefficient.

Until ``min_samples`` observations are in, the prior is used **scaled** (issue 16): from
``EARLY_SAMPLES`` observations on (the first), one coefficient per part, the median ratio of what
was measured to what the prior predicts for the same features, clamped to ``SCALE_RANGE``,
multiplies the prior's coefficients (source ``"scaled"``). A worker that advertises a generic prior
(every vLLM worker does, whatever its GPU) is thus scored at its own speed from its first request
on, not after ``min_samples`` of them. A ratio within ``SCALE_KEEP`` of 1 keeps the prior as it
is: a few observations of a worker whose prior is its own timing scatter around 1 by up to ≈ 25 %
(the model counts a queue ahead as not started), and scaling a true prior by that scatter only
moves the first placements. While the decode part has fewer than ``EARLY_SAMPLES`` observations
of its own, it is scaled with the prefill's ratio (a slower GPU is slower at both); once it has,
the prefill's ratio is taken after its decode term.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from router.cost.time import Timing

Floats = npt.NDArray[np.float64]

_HUBER = 1.345
_PRIOR_OBSERVATIONS = 0.01  # the ridge toward the prior weighs as much as this many observations
_IRLS_ITERATIONS = 10
# KV usage must span at least this much for the decode curve's shape to be fitted; below it only
# its level is (the prior's curve, scaled).
DECODE_SHAPE_SPAN = 0.25
# Observations from which a part's prior is scaled to them (below min_samples); the bounds of
# that scale (a ratio outside them is a broken measurement more likely than a GPU); and the band
# around 1 within which the prior is kept as it is. Chosen on bench/routing_sim.py (decisions 81).
EARLY_SAMPLES = 1
SCALE_RANGE = (0.01, 100.0)
SCALE_KEEP = 1.25


DecodeObservation = tuple[float, float, float]  # (KV usage, mean inter-token ms, requests running)


def fit_with_running(x: Floats, running: Floats, y: Floats, prior: Floats, prior_running: float, *,
                     nonnegative: bool) -> Floats:
    """:func:`robust_fit` of ``y ≈ [x, running]·θ``; where the requests running come out adding
    nothing (their coefficient ≤ 0), the fit of ``x`` alone with that coefficient 0, as if the
    column did not exist (more requests never make a step quicker, and an active set pinned with
    the column can differ from the one without it)."""
    theta = robust_fit(np.column_stack([x, running]), y, np.append(prior, prior_running), nonnegative=nonnegative)
    if theta[-1] <= 0.0:
        theta = np.append(robust_fit(x, y, prior, nonnegative=nonnegative), 0.0)
    return theta


class PrefillObservation(NamedTuple):
    """One request's first token: what the router knew at selection and what it measured. (A
    tuple: made for every first token, where a frozen dataclass's constructor sets each field
    through ``object.__setattr__``.)"""

    queued_tokens: float
    uncached_tokens: float
    running: int
    kv_usage: float
    budget: int
    measured_ms: float
    predicted_ms: float

    def ttft_ms(self, timing: Timing) -> float:
        """What ``timing`` predicts for this request's first token (the fit's linear model)."""
        steps, tokens, squares, decode_steps, running = self.features()
        return (timing.p0 * steps + timing.p1 * tokens + timing.p2 * squares + timing.running_ms * running
                + decode_steps * timing.decode_step_ms(self.kv_usage, running))

    def features(self) -> tuple[float, float, float, float, float]:
        """(steps, tokens, Σ step tokens², steps with a decode pass, requests running)."""
        x = max(self.queued_tokens + self.uncached_tokens, 0.0)
        if x <= 0:
            return 0.0, 0.0, 0.0, 0.0, 0.0
        m = self.budget
        full = int(x // m)
        rem = x - full * m
        steps = full + (1 if rem > 0 else 0)
        return (float(steps), x, full * float(m) * m + rem * rem, float(steps if self.running else 0),
                float(self.running))


def robust_fit(x: Floats, y: Floats, prior: Floats, *, nonnegative: bool) -> Floats:
    """Huber IRLS of ``y ≈ x·θ`` with a light ridge toward ``prior``; returns θ.

    With ``nonnegative``, a coefficient that comes out negative is pinned at 0 and the others are
    fitted again (an active set of at most as many rounds as columns)."""
    n, k = x.shape
    free = np.ones(k, dtype=bool)
    theta = prior.astype(np.float64).copy()
    for _ in range(k):
        cols = np.flatnonzero(free)
        if len(cols) == 0:
            break
        sub = x[:, cols]
        scale = np.sqrt(np.mean(sub * sub, axis=0))
        scale[scale <= 0] = 1.0
        z = sub / scale
        phi_prior = prior[cols] * scale
        w = np.ones(n)
        phi = phi_prior.copy()
        for _ in range(_IRLS_ITERATIONS):
            zw = z * w[:, None]
            a = z.T @ zw
            lam = _PRIOR_OBSERVATIONS * float(np.trace(a)) / (len(cols) * n) + 1e-12
            a = a + lam * np.eye(len(cols))
            b = zw.T @ y + lam * phi_prior
            phi = np.linalg.solve(a, b)
            r = y - z @ phi
            mad = float(np.median(np.abs(r - np.median(r))))
            s = max(1.4826 * mad, 1e-6 * (float(np.mean(np.abs(y))) + 1e-9))
            a_r = np.abs(r)
            w_new = np.where(a_r <= _HUBER * s, 1.0, _HUBER * s / np.maximum(a_r, 1e-300))
            if np.allclose(w_new, w, rtol=0, atol=1e-6):
                w = w_new
                break
            w = w_new
        theta = np.zeros(k)
        theta[cols] = phi / scale
        theta[~free] = 0.0
        if not nonnegative or (theta[cols] >= 0).all():
            return theta
        free[cols[theta[cols] < 0]] = False
    return theta


@dataclass(frozen=True, slots=True)
class FitWindow:
    """What one refit of a worker's timing model needs, copied out of its :class:`Calibration`
    (immutable, so a fit can run anywhere: inline, or in a thread off the scheduler actor).
    ``decode`` / ``prefill`` are None for a part not refitted this time."""

    instance_id: int
    generation: int  # the calibration's generation when copied: a result of an older one is dropped
    prior: Timing
    timing: Timing  # the model in use (a prefill-only refit subtracts its decode term)
    min_samples: int
    decode_fitted: bool
    prefill_fitted: bool
    decode: tuple[DecodeObservation, ...] | None
    prefill: tuple[PrefillObservation, ...] | None
    decode_samples: int = 0  # observations held (copied or not): has a part data of its own?
    prefill_samples: int = 0
    lent: float = 1.0  # the pool's scale, used while the prefill has no data of its own


@dataclass(frozen=True, slots=True)
class FitResult:
    instance_id: int
    generation: int
    timing: Timing
    decode_fitted: bool
    prefill_fitted: bool
    own: bool = False  # scored from observations of its own TTFTs (else the prior, or the pool's scale)
    lent: float = 1.0  # the pool's scale it was computed with (FitWindow.lent)


def fit(window: FitWindow) -> FitResult:
    """Refit what ``window`` holds: the decode curve first (the prefill fit subtracts its
    decode term), then the prefill coefficients. Pure; the numpy work is here and only here."""
    t, decode_fitted, prefill_fitted = window.timing, window.decode_fitted, window.prefill_fitted
    early = early_samples(window.min_samples)
    if window.decode is not None:
        t, decode_fitted = _fit_decode(window.prior, t, window.decode, window.min_samples)
    if window.prefill is not None:
        t, prefill_fitted = _fit_prefill(window.prior, t, window.prefill, window.min_samples,
                                         decode_own=window.decode_samples >= early, lent=window.lent)
    own = window.prefill_samples >= early
    source = source_of(window.prior, t, fitted=decode_fitted or prefill_fitted, pooled=not own and window.lent != 1.0)
    return FitResult(window.instance_id, window.generation, replace(t, source=source), decode_fitted,
                     prefill_fitted, own, window.lent)


def source_of(prior: Timing, t: Timing, *, fitted: bool, pooled: bool) -> str:
    """"fitted" once a part is; else, when it differs from the prior, "pooled" (its prefill at the
    pool's scale) or "scaled" (to its own observations); else the prior's."""
    if fitted:
        return "fitted"
    if replace(t, source=prior.source) == prior:
        return prior.source
    return "pooled" if pooled else "scaled"


def early_samples(min_samples: int) -> int:
    """Observations from which a part's prior is scaled (never more than ``min_samples``)."""
    return min(EARLY_SAMPLES, min_samples)


def scale_ratio(measured: Iterable[float], predicted: Iterable[float]) -> float:
    """The median of measured / predicted over the pairs with a positive prediction, clamped to
    ``SCALE_RANGE``; 1 when there is none or when it is within ``SCALE_KEEP`` of 1. Robust to a
    slow outlier from three pairs on."""
    ratios = [m / p for m, p in zip(measured, predicted, strict=True) if p > 0]
    return _bounded(statistics.median(ratios)) if ratios else 1.0


def _bounded(k: float) -> float:
    lo, hi = SCALE_RANGE
    k = min(max(k, lo), hi)
    return 1.0 if 1.0 / SCALE_KEEP < k < SCALE_KEEP else k


def pool_scale(scales: Iterable[float]) -> float:
    """The scale lent to a pool's workers that have no TTFT of their own: the median of the
    others' (bounded as :func:`scale_ratio`), 1 when none has one."""
    values = list(scales)
    return _bounded(statistics.median(values)) if values else 1.0


def scaled_decode(prior: Timing, t: Timing, k: float) -> Timing:
    return replace(t, d0=k * prior.d0, d1=k * prior.d1, d2=k * prior.d2, decode_min_ms=k * prior.decode_min_ms,
                   decode_running_ms=k * prior.decode_running_ms)


def _fit_decode(prior: Timing, t: Timing, obs: tuple[DecodeObservation, ...], min_samples: int,
                ) -> tuple[Timing, bool]:
    if len(obs) < min_samples:
        if len(obs) < early_samples(min_samples):
            return scaled_decode(prior, t, 1.0), False
        k = scale_ratio((y for _, y, _ in obs), (prior.decode_step_ms(u, n) for u, _, n in obs))
        return scaled_decode(prior, t, k), False
    data = np.array(obs, dtype=np.float64)
    u, y, n = data[:, 0], data[:, 1], data[:, 2]
    coefs = np.array([prior.d0, prior.d1, prior.d2])
    if float(u.max() - u.min()) >= DECODE_SHAPE_SPAN:
        x = np.column_stack([np.ones_like(u), u, u * u])
        d0, d1, d2, dn = (float(v) for v in fit_with_running(x, n, y, coefs, prior.decode_running_ms,
                                                             nonnegative=False))
    else:
        # A narrow range of KV usage identifies the level of the curve, not its shape: the
        # prior's curve is scaled to the observations (one robust coefficient) instead of a
        # quadratic that would extrapolate anywhere outside the range.
        shape = np.maximum(coefs[0] + coefs[1] * u + coefs[2] * u * u, prior.decode_min_ms)
        k, dn = (float(v) for v in fit_with_running(shape[:, None], n, y, np.ones(1), prior.decode_running_ms,
                                                    nonnegative=True))
        d0, d1, d2 = (float(v) for v in k * coefs)
    return replace(t, d0=d0, d1=d1, d2=d2, decode_min_ms=prior.decode_min_ms, decode_running_ms=dn), True


def _prior_prefill_ms(prior: Timing, o: PrefillObservation) -> float:
    steps, x, sq, _, running = o.features()
    return prior.p0 * steps + prior.p1 * x + prior.p2 * sq + prior.running_ms * running


def scaled_prefill(prior: Timing, t: Timing, k: float) -> Timing:
    return replace(t, p0=k * prior.p0, p1=k * prior.p1, p2=k * prior.p2, running_ms=k * prior.running_ms)


def _fit_prefill(prior: Timing, t: Timing, obs: tuple[PrefillObservation, ...], min_samples: int, *,
                 decode_own: bool, lent: float = 1.0) -> tuple[Timing, bool]:
    """``decode_own``: the decode part has observations of its own (fitted or scaled to them);
    else it is the prior's, scaled here with the prefill's ratio once there are enough TTFTs, and
    with the pool's (``lent``) before."""
    early = early_samples(min_samples)
    if len(obs) < early:
        t = t if decode_own else scaled_decode(prior, t, lent)
        return scaled_prefill(prior, t, lent), False
    if not decode_own:
        k = scale_ratio((o.measured_ms for o in obs), (
            _prior_prefill_ms(prior, o) + o.features()[3] * prior.decode_step_ms(o.kv_usage, o.running) for o in obs))
        t = scaled_decode(prior, t, k)
        if len(obs) < min_samples:
            return scaled_prefill(prior, t, k), False
    elif len(obs) < min_samples:
        k = scale_ratio((o.measured_ms - o.features()[3] * t.decode_step_ms(o.kv_usage, o.running) for o in obs),
                        (_prior_prefill_ms(prior, o) for o in obs))
        return scaled_prefill(prior, t, k), False
    f = np.array([o.features() for o in obs], dtype=np.float64)
    decode = np.array([t.decode_step_ms(o.kv_usage, o.running) for o in obs])
    y = np.array([o.measured_ms for o in obs]) - f[:, 3] * decode
    coefs = np.array([prior.p0, prior.p1, prior.p2])
    p0, p1, p2, r = (float(v) for v in fit_with_running(f[:, :3], f[:, 4], y, coefs, prior.running_ms,
                                                        nonnegative=True))
    return replace(t, p0=p0, p1=p1, p2=p2, running_ms=r), True
