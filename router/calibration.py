"""Per-worker calibration of the time cost's timing model (issue 9). Pure: no I/O, no clock.

Every worker starts from a prior (:class:`router.cost.time.Timing`: the timing model its membership
record advertises, or the default) and the router fits it online from what it observes of that
worker's finished requests (the model and its fits: :mod:`router.timing_fit`): a scaled prior
from the first observation, the full fit from ``min_samples`` on. A worker with no TTFT of its
own is scored with its pool's scale (:class:`Calibrations`).

The error of each TTFT prediction the router made (with the model in use at the time) is kept over
the same window: mean absolute and p90.

A worker's observations expire once its pool has moved on without it (decision 110): each is
stamped with its model's count of first tokens, and one older than ``EXPIRE_WINDOWS`` windows per
worker of the model (the span a window covers when each worker draws its share) is dropped, and
the worker refitted from what is left, back to its prior (or the pool's scale) when nothing is.
Without it a fit taken in a burst (every TTFT long, so the fit says every prefill is) kept a worker
from being chosen, and so from being measured again: the other workers took all the traffic.

A fit costs milliseconds (numpy medians and solves over the window), so a router never runs one on
its scheduler actor (issue 16): recording an observation is O(1); :class:`router.fitting.Fitter`
copies the due windows (:meth:`Calibrations.windows`), fits them in a thread at a bounded rate and
hands the results back (:meth:`Calibrations.apply`). The pure core's tests and the simulator fit
inline instead, with the same code at the same observation counts (``inline=True``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, NamedTuple

from controlplane.protocol.events import WorkerCalibration
from router.cost.time import DEFAULT_DECODE_TOKENS, DEFAULT_TIMING, Prediction, Timing
from router.timing_fit import (
    DecodeObservation,
    FitResult,
    FitWindow,
    PrefillObservation,
    early_samples,
    fit,
    pool_scale,
    scaled_decode,
    scaled_prefill,
    source_of,
)

REFIT_EVERY = 4  # observations between two refits (inline; off the actor, at most one per round)
# A worker's observations expire when its model's pool has seen this many windows per worker of
# first tokens since (decision 110); the pool is swept every SWEEP_EVERY of its first tokens.
EXPIRE_WINDOWS = 2
SWEEP_EVERY = 64
SCALE_REFERENCE_TOKENS = 2048.0  # a worker's scale, to lend to its pool: its step of this many tokens


def _claimed(prior: Timing) -> bool:
    """Whether a prior is a worker's own claim: anything but the generic default (whatever its
    source says). Computed when the prior is set, not on each first token."""
    return replace(prior, source=DEFAULT_TIMING.source) != DEFAULT_TIMING


class Calibration:
    """One worker's timing model: prior, observations, fitted coefficients, prediction error.

    Two ways to keep it fitted, same fitting code (:func:`fit`) at the same observations:

    - ``inline`` (the default; the pure core's tests and ``bench/routing_sim.py``): ``observe_*``
      record and refit when due: at each observation until the full fit (the scaled prior),
      then every ``REFIT_EVERY``;
    - not inline (a router process): ``observe_*`` only record (O(1)); :meth:`window` copies
      what is due, :func:`fit` runs elsewhere, :meth:`apply` takes the result back. Work with no
      fit in it (back to the prior with no observation; the pool's scale, :meth:`lend`) is done
      at once.
    """

    def __init__(self, prior: Timing, *, window: int = 256, min_samples: int = 16, inline: bool = True) -> None:
        self.prior = prior
        self.claimed = _claimed(prior)
        self.window_size = window
        self.min_samples = min_samples
        self.inline = inline
        self._prefill: deque[PrefillObservation] = deque(maxlen=window)
        self._decode: deque[DecodeObservation] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=window)
        # When each observation was made, in the pool's count of first tokens (Calibrations): kept
        # beside the observations, not paired with them, so a window's copy stays tuple(deque).
        self._prefill_at: deque[int] = deque(maxlen=window)
        self._decode_at: deque[int] = deque(maxlen=window)
        self._since_fit = 0
        self._decode_since_fit = 0
        self._stale = False  # settings or prior changed: both parts are due (not inline)
        self.generation = 0
        self.timing = prior
        self.prefill_fitted = False
        self.decode_fitted = False
        self.own = False  # scored from its own TTFTs (see FitResult.own)
        self.lent = 1.0  # the pool's scale while not own (Calibrations)
        self.observations = 0

    # -- settings and reset ----------------------------------------------------------------------

    def configure(self, *, window: int, min_samples: int) -> None:
        """Apply new policy values; keeps the newest observations that fit the new window."""
        if window != self.window_size:
            self.window_size = window
            self._prefill = deque(self._prefill, maxlen=window)
            self._decode = deque(self._decode, maxlen=window)
            self._errors = deque(self._errors, maxlen=window)
            self._prefill_at = deque(self._prefill_at, maxlen=window)
            self._decode_at = deque(self._decode_at, maxlen=window)
        if min_samples != self.min_samples:
            self.min_samples = min_samples
            self._refit_all()

    def set_prior(self, prior: Timing) -> None:
        """The worker advertised another timing model (it restarted with other settings)."""
        if prior == self.prior:
            return
        self.prior = prior
        self.claimed = _claimed(prior)
        self._refit_all()

    def reset(self) -> None:
        """Forget every observation: back to the prior."""
        self._prefill.clear()
        self._decode.clear()
        self._errors.clear()
        self._prefill_at.clear()
        self._decode_at.clear()
        self.timing = self.prior
        self.prefill_fitted = self.decode_fitted = self.own = False
        self.lent = 1.0
        self._since_fit = self._decode_since_fit = 0
        self._stale = False
        self.generation += 1
        self.observations = 0

    # -- observations ----------------------------------------------------------------------------

    def observe_ttft(self, obs: PrefillObservation, *, at: int = 0) -> None:
        """``at``: when, in the pool's count of first tokens (see :meth:`expire`)."""
        if not (math.isfinite(obs.measured_ms) and obs.measured_ms >= 0):
            return
        self._prefill.append(obs)
        self._prefill_at.append(at)
        self._errors.append(abs(obs.predicted_ms - obs.measured_ms))
        self.observations += 1
        self._since_fit += 1
        if self.inline and self._prefill_due():
            self._refit(decode=False, prefill=True)

    def observe_decode(self, kv_usage: float, itl_ms: float, *, running: int = 0, at: int = 0) -> None:
        """``running``: the requests running there when this one was sent."""
        if not (math.isfinite(itl_ms) and itl_ms >= 0 and math.isfinite(kv_usage)):
            return
        self._decode.append((min(max(kv_usage, 0.0), 1.0), itl_ms, float(max(running, 0))))
        self._decode_at.append(at)
        self._decode_since_fit += 1
        if self.inline and self._decode_due():
            self._refit(decode=True, prefill=True)  # the prefill's decode term changed

    def expire(self, before: int) -> bool:
        """Drop the observations made before ``before`` (the pool's count of first tokens) and
        refit from the rest, as after new settings (:meth:`_refit_all`: at once if inline or if
        too few are left for a fit, back to the prior; else by the next window). True if any
        were dropped. O(dropped)."""
        dropped = False
        for obs, at in ((self._prefill, self._prefill_at), (self._decode, self._decode_at)):
            while at and at[0] < before:
                at.popleft()
                obs.popleft()
                dropped = True
        if dropped:
            self._refit_all()
        return dropped

    # -- fits ------------------------------------------------------------------------------------

    def _refit(self, *, decode: bool, prefill: bool) -> None:
        self.apply(fit(self.window(decode=decode, prefill=prefill)))

    def _refit_all(self) -> None:
        """Settings or prior changed: refit both parts, now if inline or if it needs no numpy
        (neither part has ``min_samples`` observations: both go back to the prior), else at the
        next :meth:`window`. A fit in flight is of the old settings: its result is dropped."""
        self.generation += 1
        early = early_samples(self.min_samples)
        if self.inline or (len(self._decode) < early and len(self._prefill) < early):
            self._refit(decode=True, prefill=True)
        else:
            self._stale = True

    def _decode_due(self) -> bool:
        """New decode observations to refit: every ``REFIT_EVERY``, and each one from
        ``EARLY_SAMPLES`` until the full fit (while scaled, every observation moves the scale)."""
        return self._decode_since_fit > 0 and (self._decode_since_fit >= REFIT_EVERY or (
            not self.decode_fitted and len(self._decode) >= early_samples(self.min_samples)))

    def _prefill_due(self) -> bool:
        return self._since_fit > 0 and (self._since_fit >= REFIT_EVERY or (
            not self.prefill_fitted and len(self._prefill) >= early_samples(self.min_samples)))

    def due(self) -> tuple[bool, bool]:
        """(decode, prefill): the parts a background fit should refit now. A decode refit takes
        the prefill with it (its decode term changed), as inline."""
        decode = self._stale or self._decode_due()
        return decode, decode or self._prefill_due()

    def window(self, instance_id: int = 0, *, decode: bool, prefill: bool) -> FitWindow:
        """Copy what a refit of these parts needs (O(window)); their observations since the last
        fit count from zero again."""
        if decode:
            self._decode_since_fit = 0
        if prefill:
            self._since_fit = 0
        if decode and prefill:
            self._stale = False
        return FitWindow(
            instance_id=instance_id, generation=self.generation, prior=self.prior, timing=self.timing,
            min_samples=self.min_samples, decode_fitted=self.decode_fitted, prefill_fitted=self.prefill_fitted,
            decode=tuple(self._decode) if decode else None, prefill=tuple(self._prefill) if prefill else None,
            decode_samples=len(self._decode), prefill_samples=len(self._prefill), lent=self.lent,
        )

    def apply(self, result: FitResult) -> bool:
        """Take a fit's result; False (ignored) if it is of an older generation (a reset, a new
        prior or new settings came after its window was copied)."""
        if result.generation != self.generation:
            return False
        self.timing = result.timing
        self.decode_fitted = result.decode_fitted
        self.prefill_fitted = result.prefill_fitted
        self.own = result.own
        if not self.own and result.lent != self.lent:  # lent another scale since its window was copied
            lent, self.lent = self.lent, result.lent
            self.lend(lent)
        return True

    # -- the pool's scale (Calibrations) ---------------------------------------------------------

    def own_scale(self) -> float | None:
        """How much slower than its prior this worker is, by its own TTFTs (the prefill step of
        ``SCALE_REFERENCE_TOKENS`` tokens, fitted or scaled, over the prior's); None if not own."""
        ref = self.prior.prefill_step_ms(SCALE_REFERENCE_TOKENS)
        return self.timing.prefill_step_ms(SCALE_REFERENCE_TOKENS) / ref if self.own and ref > 0 else None

    def lend(self, k: float) -> bool:
        """Score a worker with no TTFT of its own with its prior times ``k``, the pool's scale
        (its decode too, unless that has observations of its own). True if its model changed.
        No fit: arithmetic on the prior only, so the actor may call it."""
        if self.own or k == self.lent:
            return False
        self.lent = k
        p = self.prior
        t = scaled_prefill(p, self.timing, k)
        own_decode = len(self._decode) >= early_samples(self.min_samples)
        if not own_decode:
            t = scaled_decode(p, t, k)
        before, self.timing = self.timing, replace(
            t, source=source_of(p, t, fitted=self.decode_fitted, pooled=k != 1.0))
        return self.timing != before

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
    so the caller can re-read the slots that score with it.

    A worker with no TTFT of its own yet (just joined, or reset) is scored with its prior times
    the pool's scale (:func:`pool_scale` of its model's other workers): in a pool that advertises a
    generic prior, an unobserved worker would otherwise look ten times faster than its observed
    peers and draw every request until its first token comes back."""

    def __init__(self, models: Iterable[str], *, inline: bool = True) -> None:
        self.inline = inline  # see Calibration: refit as observations come, or by windows()/apply()
        self.workers: dict[int, Calibration] = {}
        self._model: dict[int, str] = {}
        self._pending: dict[str, Pending] = {}
        self._cold: set[int] = set()  # workers with no TTFT of their own (Calibration.own)
        self.decode_tokens = {m: RunningMean() for m in models}
        self.seen: dict[str, int] = {}  # first tokens observed, per model (observations' clock)
        self.expired = 0  # sweeps that expired a worker's observations, so far

    def timing(self, wid: int) -> Timing | None:
        cal = self.workers.get(wid)
        return cal.timing if cal is not None else None

    def join(self, wid: int, model: str, prior: Timing, *, window: int, min_samples: int) -> list[int]:
        """A worker joined or re-announced itself: create its calibration or update its prior.
        Returns the other workers whose model changed (the pool's scale lent to them)."""
        cal = self.workers.get(wid)
        if cal is None:
            self.workers[wid] = Calibration(prior, window=window, min_samples=min_samples, inline=self.inline)
            self._model[wid] = model
        else:
            cal.set_prior(prior)
        return [w for w in self._settle([wid]) if w != wid]

    def forget(self, wid: int, booking_ids: Iterable[str] = ()) -> None:
        self.workers.pop(wid, None)
        self._model.pop(wid, None)
        self._cold.discard(wid)
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
        self._settle(changed)
        return changed

    def reset(self, model: str | None = None) -> list[int]:
        """Back to the priors (every model, or one); returns the workers reset."""
        out = []
        for wid, cal in self.workers.items():
            if model is None or self._model.get(wid) == model:
                cal.reset()
                out.append(wid)
        self._settle(out)
        return out

    # -- the pool's scale ------------------------------------------------------------------------

    def _settle(self, wids: Iterable[int]) -> list[int]:
        """These workers' models changed: note which have TTFTs of their own, and lend their pool's
        scale to its workers that have none. Returns the workers whose model the loan changed.
        O(workers of the model) only while one of them has no TTFT of its own, else O(moved);
        off the actor's request path: once per round of fits (apply), or at a join or reset."""
        models = set()
        for wid in wids:
            cal = self.workers.get(wid)
            if cal is not None:
                (self._cold.discard if cal.own else self._cold.add)(wid)
                models.add(self._model[wid])
        return [w for m in sorted(models) for w in self._lend(m)]

    def _lend(self, model: str) -> list[int]:
        cold = sorted(w for w in self._cold if self._model.get(w) == model)
        if not cold:
            return []
        k = pool_scale(s for w, cal in self.workers.items()
                       if self._model.get(w) == model and (s := cal.own_scale()) is not None)
        return [w for w in cold if self.workers[w].lend(k)]

    # -- observations ----------------------------------------------------------------------------

    def expect(self, booking_id: str, pending: Pending) -> None:
        self._pending[booking_id] = pending

    def observation(self, booking_id: str, ttft_ms: float) -> tuple[int, PrefillObservation] | None:
        """The worker of ``booking_id`` and its first token as observed (what the router knew at
        selection, and ``ttft_ms``), or None for a request it does not expect."""
        pending = self._pending.get(booking_id)
        if pending is None:
            return None
        pred = pending.prediction
        return pending.instance_id, PrefillObservation(
            queued_tokens=pred.queued_tokens, uncached_tokens=pred.uncached_tokens, running=pred.running,
            kv_usage=pred.kv_usage, budget=pending.budget, measured_ms=ttft_ms, predicted_ms=pred.ttft_ms,
        )

    def observe_first_token(self, instance_id: int, obs: PrefillObservation) -> list[int]:
        """Record a first token (:meth:`observation`); the workers whose timing changed."""
        cal = self.workers.get(instance_id)
        if cal is None:
            return []
        model = self._model[instance_id]
        seen = self.seen[model] = self.seen.get(model, 0) + 1
        before, own = cal.timing, cal.own
        cal.observe_ttft(obs, at=seen)
        changed = self._changed(instance_id, cal, before, own)
        if seen % SWEEP_EVERY == 0:
            changed += self._expire(model, seen)
        return changed

    def _expire(self, model: str, seen: int) -> list[int]:
        """Expire what the model's workers observed more than ``EXPIRE_WINDOWS`` windows per
        worker of its first tokens ago; the workers whose timing model changed. O(workers of the
        model), once every ``SWEEP_EVERY`` of its first tokens."""
        pool = [(w, cal) for w, cal in self.workers.items() if self._model.get(w) == model]
        changed, moved = [], []
        for wid, cal in pool:
            before, own = cal.timing, cal.own
            if cal.expire(seen - EXPIRE_WINDOWS * cal.window_size * len(pool)):
                self.expired += 1
                if cal.timing != before:
                    changed.append(wid)
                if cal.timing != before or cal.own != own:
                    moved.append(wid)
        return list(dict.fromkeys(changed + self._settle(moved)))

    def first_token(self, booking_id: str, ttft_ms: float) -> list[int]:
        found = self.observation(booking_id, ttft_ms)
        return self.observe_first_token(*found) if found is not None else []

    def done(self, booking_id: str, itl_ms: float | None, decode_tokens: int | None) -> list[int]:
        pending = self._pending.pop(booking_id, None)
        if pending is None:
            return []
        if decode_tokens is not None and decode_tokens > 0 and pending.model in self.decode_tokens:
            self.decode_tokens[pending.model].add(float(decode_tokens))
        cal = self.workers.get(pending.instance_id)
        if cal is None or itl_ms is None:
            return []
        before, own = cal.timing, cal.own
        cal.observe_decode(pending.prediction.kv_usage, itl_ms, running=pending.prediction.running,
                           at=self.seen.get(pending.model, 0))
        return self._changed(pending.instance_id, cal, before, own)

    def _changed(self, wid: int, cal: Calibration, before: Timing, own: bool) -> list[int]:
        """The worker, if its model changed, and the workers its pool's scale was lent to."""
        timing = cal.timing
        if (timing is before or timing == before) and cal.own == own:  # (unchanged: the same object,
            return []  # a field-by-field comparison saved on every request)
        return ([wid] if cal.timing != before else []) + self._settle([wid])

    # -- fits off the caller (not inline) -----------------------------------------------------------

    def windows(self) -> list[FitWindow]:
        """The windows of every worker with a refit due (see Calibration.due)."""
        out = []
        for wid, cal in self.workers.items():
            decode, prefill = cal.due()
            if decode or prefill:
                out.append(cal.window(wid, decode=decode, prefill=prefill))
        return out

    def apply(self, results: Iterable[FitResult]) -> list[int]:
        """Take fits' results; returns the workers whose timing model changed."""
        changed: list[int] = []
        moved: list[int] = []  # timing or own changed: the pool's scale is lent again, once a round
        for r in results:
            cal = self.workers.get(r.instance_id)
            if cal is not None:
                before, own = cal.timing, cal.own
                if cal.apply(r):
                    if cal.timing != before:
                        changed.append(r.instance_id)
                    if cal.timing != before or cal.own != own:
                        moved.append(r.instance_id)
        return list(dict.fromkeys(changed + self._settle(moved)))

    def status(self) -> list[WorkerCalibration]:
        out: list[WorkerCalibration] = []
        for wid, cal in sorted(self.workers.items()):
            snap = cal.snapshot()
            t = cal.timing
            out.append(WorkerCalibration(
                model=self._model.get(wid, ""), instance_id=wid, source=t.source,
                prefill_ms=(t.p0, t.p1, t.p2), decode_ms=(t.d0, t.d1, t.d2), running_ms=t.running_ms,
                decode_running_ms=t.decode_running_ms,
                prefill_fitted=cal.prefill_fitted, decode_fitted=cal.decode_fitted,
                prefill_samples=snap["prefill_samples"], decode_samples=snap["decode_samples"],
                ttft_mae_ms=snap["ttft_mae_ms"], ttft_p90_error_ms=snap["ttft_p90_error_ms"],
            ))
        return out
