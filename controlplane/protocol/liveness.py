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

Ages themselves are measured on the bus server's clock (:class:`ServerTime`), never as the
receiver's wall clock minus the server's receive time: the two clocks may be apart.
"""

from __future__ import annotations

from datetime import datetime, timedelta


class BusClock:
    def __init__(self, *, counted_s: float, grace_s: float) -> None:
        self.counted_s = counted_s
        self.grace_s = max(grace_s, counted_s)
        self._heard: float | None = None  # when the newest message arrived (the caller's clock)
        self._suspended = 0.0  # silence not counted up to then, in seconds
        self._holding = False

    @property
    def holding(self) -> bool:
        """Whether the bus is known unhealthy (:meth:`hold`)."""
        return self._holding

    @property
    def heard_at(self) -> float | None:
        """When the newest message arrived (the caller's clock), None before the first."""
        return self._heard

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


class ServerTime:
    """The bus server's time, learnt from when it stored the messages it delivers live (B4).

    An age measured as "my wall clock minus the server's receive time" is wrong by the skew
    between the two clocks: 5 s ahead stales every sender, an hour ahead drops them all. The
    server's time is instead the newest receive time of a message delivered live (as it was
    stored, not replayed), projected forward on the caller's monotonic clock; the caller's wall
    clock is used only until the first live message. A live message stamped more than
    ``step_back_s`` before the projection means the server's clock stepped back (live deliveries
    come in stored order): the projection follows it. All clocks are passed in.
    """

    def __init__(self, *, step_back_s: float) -> None:
        self.step_back = timedelta(seconds=step_back_s)
        self._ref: tuple[datetime, float] | None = None  # (a live receive time, monotonic then)

    def now(self, mono: float, wall: datetime) -> datetime:
        """The server's time at ``mono`` (monotonic seconds); ``wall`` before any live message."""
        if self._ref is None:
            return wall
        ref, at = self._ref
        return ref + timedelta(seconds=max(0.0, mono - at))

    def learn(self, stored_at: datetime, mono: float, wall: datetime) -> None:
        """A message stored at ``stored_at`` was delivered live at ``mono``."""
        projected = self.now(mono, wall)
        if self._ref is None or stored_at > projected or stored_at < projected - self.step_back:
            self._ref = (stored_at, mono)

    def age(self, stored_at: datetime | None, mono: float, wall: datetime) -> float:
        """Seconds since the server stored a message (0 without a receive time, never < 0)."""
        if stored_at is None:
            return 0.0
        return max(0.0, (self.now(mono, wall) - stored_at).total_seconds())
