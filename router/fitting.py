"""The workers' calibration fits, off the scheduler actor (issue 16).

A fit (router.timing_fit.fit: numpy medians and solves over a worker's window) costs milliseconds;
run on the actor at every first token and every finished request, it took most of a loaded
router's CPU and every selection queued behind it waited. Here the actor only records
observations (O(1)); one :class:`Fitter` task per router, in the router's ``Tasks``:

1. every ``interval_s`` asks the actor for the windows with a refit due (``TakeFitWindows``: a
   copy, O(window) per due worker; a worker is due after ``REFIT_EVERY`` new observations);
2. fits them in a thread (``asyncio.to_thread``), so the event loop and the actor keep running;
3. hands the results back (``ApplyFits``); a result whose worker was reset, re-announced or
   re-configured meanwhile is dropped by its generation.

The cost is bounded whatever the request rate: at most one refit per worker per round, and after
a round that took ``spent`` seconds the next waits until fitting has used at most ``share`` of one
core (``pause_after``). A fit that fails is logged and that worker keeps its model.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.commands import ApplyFits, TakeFitWindows
from router.scheduler import Scheduler
from router.timing_fit import FitResult, FitWindow, fit

log = logging.getLogger(__name__)

FIT_INTERVAL_S = 0.2  # between two rounds at most (the router's tick)
FIT_SHARE = 0.1  # of one core, at most, spent fitting


def pause_after(spent: float, *, interval_s: float, share: float) -> float:
    """Seconds to wait after a round of fits that took ``spent`` seconds: at least ``interval_s``,
    and long enough that fitting takes at most ``share`` of the time."""
    return max(interval_s, spent * (1.0 - share) / share)


def fit_all(windows: list[FitWindow]) -> list[FitResult]:
    """Fit every window; one that fails is logged and skipped (its worker keeps its model)."""
    out = []
    for w in windows:
        try:
            out.append(fit(w))
        except Exception:
            log.exception("calibration fit of worker %s failed", w.instance_id)
    return out


class Fitter:
    """Runs the scheduler's calibration fits in rounds, in a thread, at a bounded rate."""

    def __init__(self, scheduler: Scheduler, *, interval_s: float = FIT_INTERVAL_S, share: float = FIT_SHARE) -> None:
        self.scheduler = scheduler
        self.interval_s = interval_s
        self.share = share
        self.rounds = 0
        self.fits = 0
        self.last_round_s = 0.0  # wall time of the last round's fits
        self.longest_round_s = 0.0

    async def round(self) -> int:
        """One round: copy the due windows, fit them in a thread, hand the results back.
        Returns how many windows were fitted."""
        windows = await self.scheduler.call(TakeFitWindows())
        if not windows:
            self.last_round_s = 0.0
            return 0
        t0 = time.perf_counter()
        results = await asyncio.to_thread(fit_all, windows)
        self.last_round_s = spent = time.perf_counter() - t0
        self.longest_round_s = max(self.longest_round_s, spent)
        self.rounds += 1
        self.fits += len(results)
        self.scheduler.send(ApplyFits(results))
        log.debug("calibration: %d fits in %.1f ms", len(results), spent * 1e3)
        return len(results)

    async def run(self) -> None:
        """Rounds until cancelled; a failed round is logged, the next one comes."""
        while True:
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("calibration round failed")
            await asyncio.sleep(pause_after(self.last_round_s, interval_s=self.interval_s, share=self.share))
