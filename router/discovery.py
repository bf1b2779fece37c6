"""The discovery snapshot: live workers from membership events (DESIGN §5). Pure.

A worker is *live* while its last heartbeat is younger than ``stale_s``, *stale* after that (not a
candidate; a pin to it is 503), and *gone* after ``ttl_s`` or a ``leave`` event (removed; a pin to
it is 400). A connection failure marks it *unreachable* until its next heartbeat.

Ages run on a bus clock (:class:`controlplane.protocol.liveness.BusClock`) that stops while the
membership stream is silent for everyone: of any gap between two membership events only the first
``stale_s / 2`` counts, for up to ``outage_grace_s``, so a broker restart or a leader election
stales no worker; a worker that stops while others go on ages as before.

Liveness never uses the worker's ``at`` stamp (a future ``at`` could otherwise keep a dead worker
alive or, as "newer than anything", hide a real worker's later heartbeats). An event's age is
measured on the bus's clock: ``bus_now - received_at``, where ``received_at`` is when the bus
stored it (JetStream's own timestamp, so a replayed heartbeat of a dead worker is not mistaken for
a live one; without one, the age is 0). ``bus_now`` is the newest ``received_at`` of an event
delivered live (after the replay), projected forward on the monotonic clock; the router's wall
clock is used only until the first live event, so a router clock ahead of or behind the NATS
server does not matter once heartbeats flow. A live event stamped more than the TTL before the
projection means the server's clock stepped back (live deliveries come in stored order): the
projection follows it. All clocks are passed in.

A worker is one process: its record's ``started_at`` (with its model) names it. A record of the same
instance id from a later start is a *restart* (a process that died without leaving, back under a
fixed id within the TTL: a compose service, a StatefulSet's pod index): the old process's state is
replaced, and the caller forgets what it knew of it (its cache, its bookings). A record from an
earlier start than the one known is ignored, its leave too (a replay, or the process the newer one
replaced), unless it is a join: a process sends that once, as it starts, so a join stamped earlier
comes from a host whose clock stepped back across the restart.

While the router knows the bus cannot store (its own status write fails), :meth:`bus_unhealthy`
holds every age: heartbeats cannot arrive, so their absence says nothing about the workers (a
worker that really died ages from when the bus is healthy again).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from controlplane.protocol.events import (
    MembershipEvent,
    MembershipOp,
    RankLoad,
    WorkerRecord,
    WorkerRole,
)
from controlplane.protocol.liveness import BusClock


class Health(enum.Enum):
    LIVE = "live"
    STALE = "stale"
    UNREACHABLE = "unreachable"


class Change(enum.Enum):
    JOINED = "joined"
    UPDATED = "updated"
    RESTARTED = "restarted"  # a new process under a known instance id (the module's text)
    LEFT = "left"
    IGNORED = "ignored"


@dataclass(slots=True)
class WorkerState:
    record: WorkerRecord
    last_seen: float  # on the discovery's bus clock (monotonic seconds less bus silences)
    at: datetime  # the worker's stamp on its last event
    load: dict[int, RankLoad] = field(default_factory=dict)
    unreachable: bool = False

    @property
    def instance_id(self) -> int:
        return self.record.instance_id


def _replaced(event: MembershipEvent, known: WorkerRecord) -> bool:
    """Whether ``event`` comes from a process the known one replaced (started earlier). A join is
    never one: a process sends it once, as it starts, so a join stamped earlier comes from a host
    whose clock stepped back across the restart."""
    return event.worker.started_at < known.started_at and event.op is not MembershipOp.JOIN


class Discovery:
    def __init__(self, *, ttl_s: float, stale_s: float, models: frozenset[str] | None = None,
                 outage_grace_s: float = 30.0) -> None:
        self.ttl_s = ttl_s
        self.stale_s = min(stale_s, ttl_s)
        self.models = models
        self.workers: dict[int, WorkerState] = {}
        self.clock = BusClock(counted_s=self.stale_s / 2, grace_s=outage_grace_s)
        # The newest receive time of a live event and the monotonic time it was applied at.
        self._bus_ref: tuple[datetime, float] | None = None

    def bus_now(self, now: float, wall_now: datetime) -> datetime:
        """The NATS server's time at ``now`` (monotonic): the newest live receive time seen,
        projected forward; the router's wall clock before any live event."""
        if self._bus_ref is None:
            return wall_now
        ref, at = self._bus_ref
        return ref + timedelta(seconds=max(0.0, now - at))

    def bus_unhealthy(self, now: float, unhealthy: bool) -> None:
        """The bus cannot store (True) or can again (False): hold ages meanwhile."""
        self.clock.hold(now, unhealthy)

    def bus_clock(self, now: float) -> float:
        """Monotonic seconds less the bus silences (what liveness ages are measured in)."""
        return self.clock.at(now)

    def apply(
        self, event: MembershipEvent, *, now: float, wall_now: datetime,
        received_at: datetime | None = None, live: bool = False,
    ) -> Change:
        """Apply one event, in the order the bus delivered it (per worker, the order it stored
        them). ``received_at``: when the bus stored it (None: just now); ``live``: delivered as
        it was stored (not a replay), so its ``received_at`` is the bus's time now."""
        rec = event.worker
        wid = rec.instance_id
        if self.models is not None and rec.model not in self.models:
            return Change.IGNORED
        state = self.workers.get(wid)
        if event.op is MembershipOp.LEAVE:
            if state is None or _replaced(event, state.record):
                return Change.IGNORED
            del self.workers[wid]
            return Change.LEFT
        age = 0.0
        if received_at is not None:
            if live and (self._bus_ref is None or received_at > self.bus_now(now, wall_now)
                         or received_at < self.bus_now(now, wall_now) - timedelta(seconds=self.ttl_s)):
                # Newer than projected; or, delivered live yet older than the TTL: the server's
                # clock stepped back (live deliveries come in stored order), so follow it.
                self._bus_ref = (received_at, now)
            age = max(0.0, (self.bus_now(now, wall_now) - received_at).total_seconds())
        if age >= self.ttl_s:
            return Change.IGNORED  # a replayed record of a worker that is already gone
        last_seen = self.clock.heard(now) - age
        load = {r.dp_rank: r for r in event.load}
        if state is None:
            self.workers[wid] = WorkerState(rec, last_seen, event.at, load)
            return Change.JOINED
        known = state.record
        if rec.started_at != known.started_at or rec.model != known.model:
            if _replaced(event, known):
                return Change.IGNORED
            self.workers[wid] = WorkerState(rec, last_seen, event.at, load)
            return Change.RESTARTED
        state.record = rec
        state.last_seen = max(state.last_seen, last_seen)
        state.at = event.at
        if load:
            state.load = load
        state.unreachable = False
        return Change.UPDATED

    def expire(self, now: float) -> list[int]:
        """Remove workers whose heartbeat is older than the TTL; return their ids."""
        ref = self.bus_clock(now)
        gone = [wid for wid, s in self.workers.items() if ref - s.last_seen >= self.ttl_s]
        for wid in gone:
            del self.workers[wid]
        return gone

    def remove(self, instance_id: int) -> bool:
        return self.workers.pop(instance_id, None) is not None

    def get(self, instance_id: int) -> WorkerState | None:
        return self.workers.get(instance_id)

    def health(self, state: WorkerState, now: float) -> Health:
        if state.unreachable:
            return Health.UNREACHABLE
        if self.bus_clock(now) - state.last_seen >= self.stale_s:
            return Health.STALE
        return Health.LIVE

    def mark_unreachable(self, instance_id: int) -> bool:
        state = self.workers.get(instance_id)
        if state is None or state.unreachable:
            return False
        state.unreachable = True
        return True

    def of_model(self, model: str, role: WorkerRole | None = None) -> list[WorkerState]:
        return [
            s for s in self.workers.values()
            if s.record.model == model and (role is None or s.record.role is role)
        ]


class SamePool:
    """The workers of one model and role, as a container whose membership is looked up when asked
    (``wid in pool``): no list of a whole pool built for a question about a few of its workers."""

    __slots__ = ("_discovery", "_model", "_role")

    def __init__(self, discovery: Discovery, model: str, role: WorkerRole) -> None:
        self._discovery = discovery
        self._model = model
        self._role = role

    def __contains__(self, wid: object) -> bool:
        state = self._discovery.workers.get(wid) if isinstance(wid, int) else None
        return state is not None and state.record.model == self._model and state.record.role is self._role
