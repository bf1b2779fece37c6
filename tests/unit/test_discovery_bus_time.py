"""B4 and B2 in router discovery (pure; every clock injected):

- heartbeat ages are measured on the NATS server's clock (the newest live receive time, projected
  on the monotonic clock), so a router whose wall clock runs ahead (+5 s, +1 h) or behind keeps its
  workers live;
- while the bus cannot store (the router's own status write fails), worker ages hold past the
  outage grace, and run again once it can.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.protocol.events import MembershipEvent, MembershipOp, WorkerRecord
from controlplane.protocol.liveness import BusClock
from router.discovery import Change, Discovery, Health

T0 = datetime(2026, 6, 1, tzinfo=UTC)  # the NATS server's clock at monotonic 0


def _mem(op: MembershipOp, wid: int) -> MembershipEvent:
    rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", dp_size=1, block_size=4,
                       kv_total_blocks=100, max_num_batched_tokens=64, started_at=T0)
    return MembershipEvent(op=op, worker=rec, at=T0)


def _beat(d: Discovery, wid: int, now: float, skew: timedelta, *, stored_ago: float = 0.0,
          live: bool = True) -> Change:
    """A heartbeat the server stored ``stored_ago`` s before ``now``, seen by a router whose wall
    clock is ``skew`` off the server's."""
    server_now = T0 + timedelta(seconds=now)
    return d.apply(_mem(MembershipOp.HEARTBEAT, wid), now=now, wall_now=server_now + skew,
                   received_at=server_now - timedelta(seconds=stored_ago), live=live)


@pytest.mark.parametrize("skew", [timedelta(seconds=5), timedelta(hours=1), timedelta(0),
                                  timedelta(seconds=-5), timedelta(hours=-1)])
def test_a_router_clock_off_the_servers_keeps_live_workers_live(skew: timedelta) -> None:
    d = Discovery(ttl_s=10, stale_s=3, models=frozenset({"m"}))
    # The replay at start is aged on the router's wall clock (nothing better is known yet) ...
    _beat(d, 1, 0.0, skew, stored_ago=0.5, live=False)
    # ... then heartbeats delivered live give the server's time.
    for t in (1.0, 2.0, 3.0, 4.0):
        _beat(d, 1, t, skew)
        _beat(d, 2, t, skew)
    for wid in (1, 2):
        s = d.get(wid)
        assert s is not None, f"worker {wid} dropped with the router clock {skew} off"
        assert d.health(s, 4.5) is Health.LIVE
    # A worker that stops while the other goes on ages on the server's time: stale, then gone.
    for t in range(5, 16):
        _beat(d, 2, float(t), skew)
    s1 = d.get(1)
    assert s1 is None or d.health(s1, 7.5) is Health.STALE
    assert d.expire(15.0) == [1]
    assert d.get(2) is not None


def test_a_replayed_old_heartbeat_after_live_ones_is_aged_on_the_servers_clock() -> None:
    """Once live heartbeats flow, a replayed record the server stored 20 s ago is 20 s old
    whatever the router's wall clock says."""
    for skew in (timedelta(hours=-1), timedelta(hours=1)):
        d = Discovery(ttl_s=10, stale_s=3, models=frozenset({"m"}))
        _beat(d, 1, 30.0, skew)
        assert _beat(d, 2, 30.5, skew, stored_ago=20.0, live=False) is Change.IGNORED  # older than the TTL
        _beat(d, 3, 31.0, skew, stored_ago=5.0, live=False)
        s3 = d.get(3)
        assert s3 is not None and d.health(s3, 31.0) is Health.STALE


def test_bus_time_is_the_newest_live_receive_time_projected_forward() -> None:
    d = Discovery(ttl_s=10, stale_s=3)
    wall = T0 + timedelta(hours=3)
    assert d.bus_now(0.0, wall) == wall  # nothing live yet: the router's wall clock
    _beat(d, 1, 10.0, timedelta(hours=3))
    assert d.bus_now(12.5, wall) == T0 + timedelta(seconds=12.5)
    _beat(d, 1, 11.0, timedelta(hours=3), stored_ago=0.8)  # older than projected: no step back
    assert d.bus_now(12.5, wall) == T0 + timedelta(seconds=12.5)


def test_workers_survive_a_bus_that_cannot_store_past_the_outage_grace() -> None:
    """B2: a full NATS disk stops every heartbeat; the router's own status write fails, so it
    holds ages (a silence alone would count again after the 30 s grace)."""
    d = Discovery(ttl_s=10, stale_s=3, outage_grace_s=30)
    for wid in (1, 2):
        _beat(d, wid, 100.0, timedelta(0))
    d.bus_unhealthy(101.0, True)
    states = [d.get(1), d.get(2)]
    for now in (110.0, 140.0, 400.0):
        assert [d.health(s, now) for s in states if s] == [Health.LIVE, Health.LIVE]
        assert d.expire(now) == []
    d.bus_unhealthy(400.0, False)  # the bus stores again; worker 2 is back, worker 1 died
    for t in (401.0, 402.0, 403.0, 404.0):
        _beat(d, 2, t, timedelta(0))
    assert d.expire(404.0) == []
    s1 = d.get(1)
    assert s1 is not None and d.health(s1, 404.0) is Health.STALE
    for t in range(405, 413):
        _beat(d, 2, float(t), timedelta(0))
    assert d.expire(412.0) == [1]


def test_bus_clock_hold_is_continuous() -> None:
    c = BusClock(counted_s=1.5, grace_s=30)
    c.heard(100.0)
    assert c.at(120.0) == 101.5
    c.hold(120.0, True)
    assert c.at(120.0) == 101.5
    assert c.at(500.0) == 101.5  # no grace runs out while holding
    c.hold(500.0, False)
    assert c.at(500.0) == 101.5
    assert c.at(501.0) == 102.5  # the silence is past the grace: it counts again from here
    assert c.heard(502.0) == 103.5
    c.hold(502.0, False)  # (no change: nothing moves)
    assert c.at(502.0) == 103.5


def test_a_hold_noticed_after_the_grace_covers_the_whole_silence() -> None:
    """The router notices the failure late (its status write times out): the silence began with
    the failure, so the hold counts none of it beyond ``counted_s``."""
    c = BusClock(counted_s=1.5, grace_s=30)
    c.heard(100.0)
    assert c.at(140.0) == 111.5  # past the grace: 10 s counted again
    c.hold(140.0, True)
    assert c.at(140.0) == 101.5
    assert c.at(900.0) == 101.5


def test_a_server_clock_stepped_back_is_followed() -> None:
    """Live deliveries come in stored order: one stamped more than the TTL before the projected
    server time means the server's clock stepped back, not a heartbeat that old."""
    d = Discovery(ttl_s=10, stale_s=3, models=frozenset({"m"}))
    _beat(d, 1, 0.0, timedelta(0))
    back = timedelta(hours=-1)  # the server's clock from now on
    for t in (1.0, 2.0, 3.0):
        server_now = T0 + timedelta(seconds=t) + back
        d.apply(_mem(MembershipOp.HEARTBEAT, 1), now=t, wall_now=T0 + timedelta(seconds=t),
                received_at=server_now, live=True)
    s = d.get(1)
    assert s is not None and d.health(s, 3.0) is Health.LIVE
