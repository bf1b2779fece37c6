"""Per-worker calibration of the time cost's timing model (issue 9). Pure: no I/O, no clock.

Every worker starts from a prior (:class:`router.cost.time.Timing`: the timing model its membership
record advertises, or the default) and the router fits it online from what it observes of that
worker's finished requests:

- **prefill**: for each request, the prefill tokens queued ahead of it at selection (``Q``), its
  own uncached tokens (``N``), whether the rank was running requests, its KV usage, and the
  measured time from sending the request to its first token. With ``x = Q + N`` run in steps of at
  most ``M`` tokens (``k`` steps, ``Σn²`` over their sizes), the model is

      TTFT ≈ p0·k + p1·x + p2·Σn² + k·decode_step(u)·[running]

  linear in (p0, p1, p2) once the decode term (from the decode fit) is subtracted;
- **decode**: each streamed request's mean inter-token time against the KV usage it ran at:
  ``ITL ≈ d0 + d1·u + d2·u²`` when the observed usage spans ``DECODE_SHAPE_SPAN`` or more, else
  ``ITL ≈ k·prior(u)`` (a narrow range tells the curve's level, not its shape).

Both fits are robust and bounded: the last ``window`` observations only, Huber-weighted
iteratively reweighted least squares (a slow outlier's pull is capped at 1.345 robust standard
deviations), a light ridge toward the prior (columns scaled, so a narrow range of N or u leaves the
unidentified coefficients at the prior instead of anywhere), and no negative prefill coefficient.
Until ``min_samples`` observations are in, the prior is used. The error of each TTFT prediction the
router made (with the model in use at the time) is kept over the same window: mean absolute and p90.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from controlplane.protocol.events import WorkerCalibration
from router.cost.time import DEFAULT_DECODE_TOKENS, Prediction, Timing

Floats = npt.NDArray[np.float64]

_HUBER = 1.345
_PRIOR_OBSERVATIONS = 0.01  # the ridge toward the prior weighs as much as this many observations
_IRLS_ITERATIONS = 10
REFIT_EVERY = 4  # observations between two refits (a fit costs tens of microseconds)
# KV usage must span at least this much for the decode curve's shape to be fitted; below it only
# its level is (the prior's curve, scaled).
DECODE_SHAPE_SPAN = 0.25


@dataclass(frozen=True, slots=True)
class PrefillObservation:
    """One request's first token: what the router knew at selection and what it measured."""

    queued_tokens: float
    uncached_tokens: float
    running: int
    kv_usage: float
    budget: int
    measured_ms: float
    predicted_ms: float

    def features(self) -> tuple[float, float, float, float]:
        """(steps, tokens, Σ step tokens², steps with a decode pass)."""
        x = max(self.queued_tokens + self.uncached_tokens, 0.0)
        if x <= 0:
            return 0.0, 0.0, 0.0, 0.0
        m = self.budget
        full = int(x // m)
        rem = x - full * m
        steps = full + (1 if rem > 0 else 0)
        return float(steps), x, full * float(m) * m + rem * rem, float(steps if self.running else 0)


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


class Calibration:
    """One worker's timing model: prior, observations, fitted coefficients, prediction error."""

    def __init__(self, prior: Timing, *, window: int = 256, min_samples: int = 16) -> None:
        self.prior = prior
        self.window = window
        self.min_samples = min_samples
        self._prefill: deque[PrefillObservation] = deque(maxlen=window)
        self._decode: deque[tuple[float, float]] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self._decode_since_fit = 0
        self.timing = prior
        self.prefill_fitted = False
        self.decode_fitted = False
        self.observations = 0

    # -- settings and reset ----------------------------------------------------------------------

    def configure(self, *, window: int, min_samples: int) -> None:
        """Apply new policy values; keeps the newest observations that fit the new window."""
        if window != self.window:
            self.window = window
            self._prefill = deque(self._prefill, maxlen=window)
            self._decode = deque(self._decode, maxlen=window)
            self._errors = deque(self._errors, maxlen=window)
        if min_samples != self.min_samples:
            self.min_samples = min_samples
            self._refit_prefill()
            self._refit_decode()

    def set_prior(self, prior: Timing) -> None:
        """The worker advertised another timing model (it restarted with other settings)."""
        if prior == self.prior:
            return
        self.prior = prior
        self._refit_decode()
        self._refit_prefill()

    def reset(self) -> None:
        """Forget every observation: back to the prior."""
        self._prefill.clear()
        self._decode.clear()
        self._errors.clear()
        self.timing = self.prior
        self.prefill_fitted = self.decode_fitted = False
        self._since_fit = self._decode_since_fit = 0
        self.observations = 0

    # -- observations ----------------------------------------------------------------------------

    def observe_ttft(self, obs: PrefillObservation) -> None:
        if not (math.isfinite(obs.measured_ms) and obs.measured_ms >= 0):
            return
        self._prefill.append(obs)
        self._errors.append(abs(obs.predicted_ms - obs.measured_ms))
        self.observations += 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or len(self._prefill) == self.min_samples:
            self._refit_prefill()

    def observe_decode(self, kv_usage: float, itl_ms: float) -> None:
        if not (math.isfinite(itl_ms) and itl_ms >= 0 and math.isfinite(kv_usage)):
            return
        self._decode.append((min(max(kv_usage, 0.0), 1.0), itl_ms))
        self._decode_since_fit += 1
        if self._decode_since_fit >= REFIT_EVERY or len(self._decode) == self.min_samples:
            self._refit_decode()
            self._refit_prefill()  # its decode term changed

    # -- fits ------------------------------------------------------------------------------------

    def _refit_decode(self) -> None:
        self._decode_since_fit = 0
        t = self.timing
        if len(self._decode) < self.min_samples:
            self.decode_fitted = False
            self.timing = replace(t, d0=self.prior.d0, d1=self.prior.d1, d2=self.prior.d2)
            return
        data = np.array(self._decode, dtype=np.float64)
        u, y = data[:, 0], data[:, 1]
        prior = np.array([self.prior.d0, self.prior.d1, self.prior.d2])
        if float(u.max() - u.min()) >= DECODE_SHAPE_SPAN:
            x = np.column_stack([np.ones_like(u), u, u * u])
            d0, d1, d2 = (float(v) for v in robust_fit(x, y, prior, nonnegative=False))
        else:
            # A narrow range of KV usage identifies the level of the curve, not its shape: the
            # prior's curve is scaled to the observations (one robust coefficient) instead of a
            # quadratic that would extrapolate anywhere outside the range.
            shape = np.maximum(prior[0] + prior[1] * u + prior[2] * u * u, self.prior.decode_min_ms)
            k = float(robust_fit(shape[:, None], y, np.ones(1), nonnegative=True)[0])
            d0, d1, d2 = (float(v) for v in k * prior)
        self.timing = replace(t, d0=d0, d1=d1, d2=d2, source="fitted")
        self.decode_fitted = True

    def _refit_prefill(self) -> None:
        self._since_fit = 0
        t = self.timing
        if len(self._prefill) < self.min_samples:
            self.prefill_fitted = False
            self.timing = replace(t, p0=self.prior.p0, p1=self.prior.p1, p2=self.prior.p2,
                                  source=t.source if self.decode_fitted else self.prior.source)
            return
        rows = [o.features() for o in self._prefill]
        f = np.array(rows, dtype=np.float64)
        decode = np.array([t.decode_step_ms(o.kv_usage) for o in self._prefill])
        y = np.array([o.measured_ms for o in self._prefill]) - f[:, 3] * decode
        prior = np.array([self.prior.p0, self.prior.p1, self.prior.p2])
        p0, p1, p2 = (float(v) for v in robust_fit(f[:, :3], y, prior, nonnegative=True))
        self.timing = replace(t, p0=p0, p1=p1, p2=p2, source="fitted")
        self.prefill_fitted = True

    # -- reporting -------------------------------------------------------------------------------

    def error(self) -> tuple[float | None, float | None]:
        """(mean absolute, p90 absolute) error of the TTFT predictions in the window, in ms."""
        if not self._errors:
            return None, None
        errs = sorted(self._errors)
        p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)]
        return sum(errs) / len(errs), p90

    def snapshot(self) -> dict[str, Any]:
        mae, p90 = self.error()
        return {
            "timing": self.timing.as_dict(), "prior": self.prior.as_dict(),
            "prefill_fitted": self.prefill_fitted, "decode_fitted": self.decode_fitted,
            "prefill_samples": len(self._prefill), "decode_samples": len(self._decode),
            "observations": self.observations, "ttft_mae_ms": mae, "ttft_p90_error_ms": p90,
        }


class RunningMean:
    """Mean of the last ``window`` values (the expected decode tokens of a model's requests)."""

    def __init__(self, window: int = 256, initial: float = DEFAULT_DECODE_TOKENS) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self.initial = initial

    def add(self, value: float) -> None:
        if len(self._values) == self._values.maxlen:
            self._sum -= self._values[0]
        self._values.append(value)
        self._sum += value

    @property
    def value(self) -> float:
        return self._sum / len(self._values) if self._values else self.initial


class Pending(NamedTuple):
    """What the router predicted for a booked request, kept until its first token and its end."""

    instance_id: int
    model: str
    prediction: Prediction
    budget: int  # the worker's step budget (max_num_batched_tokens)


class Calibrations:
    """One router's calibrations: one per worker, the predictions awaiting their outcome, and each
    model's decode tokens per request. Methods that change a worker's timing model return its id,
    so the caller can re-read the slots that score with it."""

    def __init__(self, models: Iterable[str]) -> None:
        self.workers: dict[int, Calibration] = {}
        self._model: dict[int, str] = {}
        self._pending: dict[str, Pending] = {}
        self.decode_tokens = {m: RunningMean() for m in models}

    def timing(self, wid: int) -> Timing | None:
        cal = self.workers.get(wid)
        return cal.timing if cal is not None else None

    def join(self, wid: int, model: str, prior: Timing, *, window: int, min_samples: int) -> None:
        """A worker joined or re-announced itself: create its calibration or update its prior."""
        cal = self.workers.get(wid)
        if cal is None:
            self.workers[wid] = Calibration(prior, window=window, min_samples=min_samples)
            self._model[wid] = model
        else:
            cal.set_prior(prior)

    def forget(self, wid: int, booking_ids: Iterable[str] = ()) -> None:
        self.workers.pop(wid, None)
        self._model.pop(wid, None)
        for b in booking_ids:
            self._pending.pop(b, None)

    def configure(self, model: str, *, window: int, min_samples: int, reset: bool) -> list[int]:
        changed = []
        for wid, cal in self.workers.items():
            if self._model.get(wid) == model:
                cal.configure(window=window, min_samples=min_samples)
                if reset:
                    cal.reset()
                changed.append(wid)
        return changed

    def reset(self, model: str | None = None) -> list[int]:
        """Back to the priors (every model, or one); returns the workers reset."""
        out = []
        for wid, cal in self.workers.items():
            if model is None or self._model.get(wid) == model:
                cal.reset()
                out.append(wid)
        return out

    # -- observations ----------------------------------------------------------------------------

    def expect(self, booking_id: str, pending: Pending) -> None:
        self._pending[booking_id] = pending

    def first_token(self, booking_id: str, ttft_ms: float) -> int | None:
        pending = self._pending.get(booking_id)
        cal = self.workers.get(pending.instance_id) if pending is not None else None
        if pending is None or cal is None:
            return None
        pred = pending.prediction
        before = cal.timing
        cal.observe_ttft(PrefillObservation(
            queued_tokens=pred.queued_tokens, uncached_tokens=pred.uncached_tokens, running=pred.running,
            kv_usage=pred.kv_usage, budget=pending.budget, measured_ms=ttft_ms, predicted_ms=pred.ttft_ms,
        ))
        return pending.instance_id if cal.timing != before else None

    def done(self, booking_id: str, itl_ms: float | None, decode_tokens: int | None) -> int | None:
        pending = self._pending.pop(booking_id, None)
        if pending is None:
            return None
        if decode_tokens is not None and decode_tokens > 0 and pending.model in self.decode_tokens:
            self.decode_tokens[pending.model].add(float(decode_tokens))
        cal = self.workers.get(pending.instance_id)
        if cal is None or itl_ms is None:
            return None
        before = cal.timing
        cal.observe_decode(pending.prediction.kv_usage, itl_ms)
        return pending.instance_id if cal.timing != before else None

    def status(self) -> list[WorkerCalibration]:
        out: list[WorkerCalibration] = []
        for wid, cal in sorted(self.workers.items()):
            snap = cal.snapshot()
            t = cal.timing
            out.append(WorkerCalibration(
                model=self._model.get(wid, ""), instance_id=wid, source=t.source,
                prefill_ms=(t.p0, t.p1, t.p2), decode_ms=(t.d0, t.d1, t.d2),
                prefill_fitted=cal.prefill_fitted, decode_fitted=cal.decode_fitted,
                prefill_samples=snap["prefill_samples"], decode_samples=snap["decode_samples"],
                ttft_mae_ms=snap["ttft_mae_ms"], ttft_p90_error_ms=snap["ttft_p90_error_ms"],
            ))
        return out
