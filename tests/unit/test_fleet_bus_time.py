"""B4's twin in the control plane's fleet view (pure; every clock injected):

- router and worker ages are measured on the NATS server's clock (the newest live receive time,
  projected on the monotonic clock), so a control plane whose wall clock runs ahead (+5 s, +1 h)
  or behind keeps live routers and workers live, and still ages out one that stops;
- while the bus cannot store (the control plane's store probe fails), the view keeps the
  last-known routers and workers past the outage grace, and ages them again once it can.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from nats.aio.client import Client as NATS

from bus.client import Bus, Message
from controlplane.fleet import FleetView
from controlplane.protocol.events import MembershipEvent, MembershipOp, RouterStatus, WorkerRecord
from controlplane.protocol.liveness import ServerTime
from controlplane.protocol.subjects import membership_subject

T0 = datetime(2026, 6, 1, tzinfo=UTC)  # the NATS server's clock at monotonic 0
SKEWS = [timedelta(seconds=5), timedelta(hours=1), timedelta(0), timedelta(seconds=-5), timedelta(hours=-1)]


class Clocks:
    """Monotonic seconds ``t``; the server's time is T0 + t, the control plane's that + skew."""

    def __init__(self, skew: timedelta) -> None:
        self.t = 0.0
        self.skew = skew

    def server(self, ago: float = 0.0) -> datetime:
        return T0 + timedelta(seconds=self.t - ago)

    def wall(self) -> datetime:
        return self.server() + self.skew


def _view(c: Clocks, *, grace_s: float = 30.0) -> FleetView:
    # Router TTL 3 s (3 heartbeats of 1 s), worker TTL 10 s.
    return FleetView(Bus(NATS()), worker_ttl_s=10, router_heartbeat_s=1.0, clock=c.wall,
                     monotonic=lambda: c.t, outage_grace_s=grace_s)


def _router(view: FleetView, c: Clocks, rid: str, *, ago: float = 0.0, live: bool = True) -> None:
    status = RouterStatus(router_id=rid, models=["m"], started_at=T0, heartbeat_at=c.wall())
    view._on_router_status(rid, status.model_dump_json().encode(), c.server(ago), live=live)


def _worker(view: FleetView, c: Clocks, wid: int, *, ago: float = 0.0, live: bool = True) -> None:
    rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", dp_size=1, block_size=4,
                       kv_total_blocks=100, max_num_batched_tokens=64, started_at=T0)
    event = MembershipEvent(op=MembershipOp.HEARTBEAT, worker=rec, at=c.wall())
    msg = Message(subject=membership_subject("m", wid), data=event.model_dump_json().encode(),
                  stored_at=c.server(ago), pending=0)
    view.on_membership(msg, live=live)


def _live(view: FleetView) -> tuple[list[str], list[int]]:
    return ([r.router_id for r in view.live_routers()],
            [w.worker.instance_id for w in view.live_workers()])


@pytest.mark.parametrize("skew", SKEWS, ids=str)
def test_a_control_plane_clock_off_the_servers_keeps_live_routers_and_workers_live(skew: timedelta) -> None:
    c = Clocks(skew)
    view = _view(c)
    # The replay at start is aged on the control plane's wall clock (nothing better is known) ...
    _router(view, c, "r-a", ago=0.2, live=False)
    _worker(view, c, 1, ago=0.2, live=False)
    # ... then entries delivered live give the server's time.
    for t in (1.0, 2.0, 3.0, 4.0):
        c.t = t
        for rid in ("r-a", "r-b"):
            _router(view, c, rid)
        for wid in (1, 2):
            _worker(view, c, wid)
    c.t = 4.5
    assert _live(view) == (["r-a", "r-b"], [1, 2]), f"the control plane's clock {skew} off the server's"
    # A router and a worker that stop while the others go on age out on the server's time.
    for t in range(5, 16):
        c.t = float(t)
        _router(view, c, "r-b")
        _worker(view, c, 2)
    assert _live(view) == (["r-b"], [2])
    # The worker's last-seen time is the server's, not the control plane's.
    assert view.last_seen(1) == T0 + timedelta(seconds=4)


@pytest.mark.parametrize("skew", [timedelta(hours=-1), timedelta(hours=1)], ids=str)
def test_a_replayed_old_entry_after_live_ones_is_aged_on_the_servers_clock(skew: timedelta) -> None:
    """Once live entries flow, a status or heartbeat the server stored long ago is that old,
    whatever the control plane's wall clock says (a clock an hour behind must not revive them)."""
    c = Clocks(skew)
    view = _view(c)
    c.t = 30.0
    _router(view, c, "r-a")
    _worker(view, c, 1)
    _router(view, c, "r-old", ago=5.0, live=False)  # older than the router TTL (3 s)
    _worker(view, c, 9, ago=20.0, live=False)  # older than the worker TTL (10 s)
    assert _live(view) == (["r-a"], [1])


def test_the_fleet_view_holds_last_known_state_while_the_bus_cannot_store() -> None:
    """B2's twin: a full NATS disk stops every heartbeat; the store probe fails, so the view
    holds ages past the 30 s outage grace (a silence alone would count again after it)."""
    c = Clocks(timedelta(0))
    view = _view(c, grace_s=30)
    c.t = 100.0
    _router(view, c, "r-a")
    _worker(view, c, 1)
    c.t = 103.0
    assert view.quiet()  # silent past half the router TTL: the control plane probes
    view.bus_unhealthy(True)
    for t in (110.0, 140.0, 400.0):
        c.t = t
        assert _live(view) == (["r-a"], [1]), f"the view emptied {t - 100:.0f} s into the outage"
        # The silent router watch restarts and replays r-a's last status: neither an older
        # "seen" nor the silence's end (each restart would count half a TTL again).
        _router(view, c, "r-a", ago=t - 100.0, live=False)
        c.t += 0.5
        assert _live(view) == (["r-a"], [1]), f"a replay {t - 100:.0f} s into the outage aged r-a"
    # The bus stores again; r-a comes back, worker 1 died meanwhile: it ages out from now.
    view.bus_unhealthy(False)
    for t in (401.0, 402.0, 403.0):
        c.t = t
        _router(view, c, "r-a")
    assert _live(view) == (["r-a"], [1])
    c.t = 412.0
    _router(view, c, "r-a")
    assert _live(view) == (["r-a"], [])
    # Quiet (worth a store probe) from half a TTL of silence until the grace is spent (the
    # membership stream, silent since 100 s, is long past it: the worker left for good).
    c.t = 413.0
    assert not view.quiet()  # r-a heard 1 s ago (half its TTL is 1.5 s)
    c.t = 414.0
    assert view.quiet()
    c.t = 412.0 + 30.0 + 3.0 + 0.5
    assert not view.quiet()  # past the grace and a TTL: no probe for ever
    # Without the hold the same silence empties the view once the grace is spent.
    cc = Clocks(timedelta(0))
    other = _view(cc, grace_s=30)
    cc.t = 100.0
    _router(other, cc, "r-a")
    _worker(other, cc, 1)
    cc.t = 140.0
    assert _live(other) == ([], [])


def test_server_time_follows_live_receive_times_and_a_step_back() -> None:
    s = ServerTime(step_back_s=10)
    wall = T0 + timedelta(hours=3)
    assert s.now(0.0, wall) == wall  # nothing live yet: the wall clock
    s.learn(T0 + timedelta(seconds=10), 10.0, wall)
    assert s.now(12.5, wall) == T0 + timedelta(seconds=12.5)
    s.learn(T0 + timedelta(seconds=10.2), 11.0, wall)  # older than projected: no step back
    assert s.now(12.5, wall) == T0 + timedelta(seconds=12.5)
    s.learn(T0 - timedelta(seconds=60), 13.0, wall)  # the server's clock stepped back a minute
    assert s.now(14.0, wall) == T0 - timedelta(seconds=59)
    assert s.age(None, 14.0, wall) == 0.0
    assert s.age(T0, 14.0, wall) == 0.0  # (stored "after" now: never negative)
