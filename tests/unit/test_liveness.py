"""The bus clock that liveness ages run on (controlplane.protocol.liveness), and the control
plane's fleet view on it: a silence of the whole bus empties no view; a router or worker that
stops while others go on ages as before (DESIGN §5 liveness, issue 10's failover)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from nats.aio.client import Client as NATS

from bus.client import Bus
from controlplane.fleet import FleetView
from controlplane.protocol.events import RouterStatus
from controlplane.protocol.liveness import BusClock

T0 = datetime(2026, 6, 1, tzinfo=UTC)


def test_bus_clock_counts_part_of_a_silence_up_to_the_grace() -> None:
    c = BusClock(counted_s=1.5, grace_s=30)
    assert c.at(100.0) == 100.0  # nothing heard yet: the clock itself
    assert c.heard(100.0) == 100.0
    assert c.at(101.0) == 101.0
    assert c.at(110.0) == 101.5  # a silence counts 1.5 s ...
    assert c.at(130.0) == 101.5  # ... until the grace ...
    assert c.at(135.0) == 106.5  # ... past which the clock runs again
    assert c.heard(120.0) == 101.5  # a message after 20 s of silence: 1.5 s of it counted
    assert c.at(121.0) == 102.5
    assert c.heard(119.0) == 101.5  # (a clock that went back: as at the newest message)


def _view(now: list[datetime]) -> FleetView:
    # The monotonic clock runs with the wall clock here (ages are measured on it since B4's twin).
    return FleetView(Bus(NATS()), worker_ttl_s=10, router_heartbeat_s=1.0, clock=lambda: now[0],
                     monotonic=lambda: (now[0] - T0).total_seconds())


def _status(router_id: str, at: datetime) -> bytes:
    return RouterStatus(router_id=router_id, models=["m"], started_at=T0, heartbeat_at=at).model_dump_json().encode()


def test_a_silent_bus_empties_no_fleet_view_a_stopped_router_still_ages_out() -> None:
    now = [T0]
    view = _view(now)

    def beat(*routers: str) -> None:
        for r in routers:
            view._on_router_status(r, _status(r, now[0]), now[0], live=True)

    beat("r-a", "r-b")
    # The watch's JetStream node dies: 8 s without any status (the router TTL is 3 s).
    now[0] = T0 + timedelta(seconds=8)
    assert [r.router_id for r in view.live_routers()] == ["r-a", "r-b"]
    # The watch is back and r-a heartbeats every second; r-b does not come back.
    for s in range(9, 13):
        now[0] = T0 + timedelta(seconds=s)
        beat("r-a")
    assert [r.router_id for r in view.live_routers()] == ["r-a"]
    # A status stored long before it is read (a replay) is as old as its bus timestamp.
    view._on_router_status("r-c", _status("r-c", now[0]), now[0] - timedelta(seconds=5), live=False)
    assert [r.router_id for r in view.live_routers()] == ["r-a"]
