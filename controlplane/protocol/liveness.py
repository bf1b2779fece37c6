"""A bus clock for liveness ages (the router's discovery, the control plane's fleet view). Pure.

Heartbeats stop for everyone at once when the bus does (a broker restart, a stream-leader
election on a cluster): measured with the wall clock, every worker or router would then look dead
although none is. A :class:`BusClock` runs with the clock while the stream it listens to is heard,
and counts only the first ``counted_s`` of any silence of it, for up to ``grace_s``: a silence
longer than that is not taken for an outage any more, and past the grace the bus clock runs with
the clock again (so a fleet that is really gone still ages). Ages measured in bus seconds grow as
before for a sender that stops while others go on.

While the caller knows the bus is unhealthy (:meth:`hold`: it cannot store, so nobody's messages
can arrive), no silence counts beyond ``counted_s``, however long: the grace does not run out.
"""

from __future__ import annotations


class BusClock:
    def __init__(self, *, counted_s: float, grace_s: float) -> None:
        self.counted_s = counted_s
        self.grace_s = max(grace_s, counted_s)
        self._heard: float | None = None  # when the newest message arrived (the caller's clock)
        self._suspended = 0.0  # silence not counted up to then, in seconds
        self._holding = False

    def _uncounted(self, gap: float) -> float:
        return max(0.0, (gap if self._holding else min(gap, self.grace_s)) - self.counted_s)

    def hold(self, now: float, holding: bool) -> None:
        """From ``now`` on, the bus is known unhealthy (True) or healthy again (False).

        A hold counts no silence beyond ``counted_s``, and applies to the whole current silence
        (it began with the failure: everyone's messages stopped at once), so ages that grew past
        the grace before the failure was noticed shrink back. When the hold ends the bus clock is
        continuous (the silence counts on as it would have, less the held time)."""
        if holding == self._holding:
            return
        if self._heard is None or holding:
            self._holding = holding
            return
        gap = max(now, self._heard) - self._heard
        before = self._uncounted(gap)
        self._holding = holding
        self._suspended += before - self._uncounted(gap)

    def at(self, now: float) -> float:
        """Bus seconds at ``now`` (the caller's clock, in seconds)."""
        if self._heard is None:
            return now
        now = max(now, self._heard)  # a clock that went back: as at the newest message
        return now - self._suspended - self._uncounted(now - self._heard)

    def heard(self, now: float) -> float:
        """A message of the stream arrived at ``now``; returns the bus seconds then."""
        if self._heard is None or now > self._heard:
            if self._heard is not None:
                self._suspended += self._uncounted(now - self._heard)
            self._heard = now
        return self.at(now)
