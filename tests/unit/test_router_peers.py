"""Peers' bookings (router.peers) and their merge into the scheduler's load figures, no network."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from bus.identities import Identity, IdentityKind, permissions
from controlplane.protocol.errors import InvalidRequest, SubjectMismatch
from controlplane.protocol.events import (
    MembershipEvent,
    MembershipOp,
    RankLoad,
    RouterRole,
    WorkerRecord,
    check_router_load_subject,
    decode_router_load,
)
from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
from router.bookings import Bookings
from router.commands import (
    ApplyMembership,
    ApplyPeerLoad,
    RequestDone,
    RequestFirstToken,
    RoutingRequest,
    SelectWorker,
    TakeBookings,
    Tick,
)
from router.peers import Figures, PeerLoads, own_figures
from router.peersync import to_message
from router.scheduler import Scheduler
from router.settings import RoutingMode
from tests.policy_keys import session_keys

pytestmark = pytest.mark.timeout(20)


# -- the pure merge -----------------------------------------------------------------------------


def test_peers_are_summed_per_rank_and_a_snapshot_replaces_the_last() -> None:
    p = PeerLoads(stale_s=1.5)
    assert p.apply("a", boot="x", seq=1, ranks={(1, 0): Figures(2, 100, 5), (2, 0): Figures(1, 0, 3)}, now=0) \
        == {(1, 0), (2, 0)}
    assert p.apply("b", boot="y", seq=1, ranks={(1, 0): Figures(1, 50, 2)}, now=0) == {(1, 0)}
    assert p.total((1, 0)) == Figures(3, 150, 7)
    assert p.total((2, 0)) == Figures(1, 0, 3)
    # a's next snapshot: rank (2, 0) finished, (1, 0) unchanged: only (2, 0) changed
    assert p.apply("a", boot="x", seq=2, ranks={(1, 0): Figures(2, 100, 5)}, now=0.1) == {(2, 0)}
    assert p.total((2, 0)) is None
    assert p.total((1, 0)) == Figures(3, 150, 7)
    # an empty snapshot (a peer that stopped gracefully) takes all of its figures away
    assert p.apply("a", boot="x", seq=3, ranks={}, now=0.2) == {(1, 0)}
    assert p.total((1, 0)) == Figures(1, 50, 2)


def test_an_older_snapshot_of_the_same_process_is_ignored_a_new_process_is_not() -> None:
    p = PeerLoads(stale_s=1.5)
    p.apply("a", boot="x", seq=5, ranks={(1, 0): Figures(4, 0, 4)}, now=0)
    assert p.apply("a", boot="x", seq=4, ranks={(1, 0): Figures(1, 0, 1)}, now=0.1) is None
    assert p.apply("a", boot="x", seq=5, ranks={}, now=0.1) is None
    assert p.total((1, 0)) == Figures(4, 0, 4) and p.refused == 2
    # the peer restarted (a new boot): its count starts again
    assert p.apply("a", boot="z", seq=1, ranks={(1, 0): Figures(1, 0, 1)}, now=0.2) == {(1, 0)}
    assert p.total((1, 0)) == Figures(1, 0, 1)


def test_a_workers_report_supersedes_peer_figures_until_their_next_snapshot() -> None:
    p = PeerLoads(stale_s=1.5)
    p.apply("a", boot="x", seq=1, ranks={(1, 0): Figures(2, 10, 2), (1, 1): Figures(1, 0, 1),
                                         (2, 0): Figures(1, 0, 1)}, now=0)
    assert p.supersede(1) == {(1, 0), (1, 1)}
    assert p.total((1, 0)) is None and p.total((1, 1)) is None
    assert p.total((2, 0)) == Figures(1, 0, 1)
    # the peer's next snapshot holds what the report could not include yet
    p.apply("a", boot="x", seq=2, ranks={(1, 0): Figures(3, 20, 3), (2, 0): Figures(1, 0, 1)}, now=0.05)
    assert p.total((1, 0)) == Figures(3, 20, 3)


def test_a_silent_peer_is_forgotten_after_the_staleness_bound() -> None:
    p = PeerLoads(stale_s=1.5)
    p.apply("a", boot="x", seq=1, ranks={(1, 0): Figures(2, 10, 2)}, now=10.0)
    p.apply("b", boot="y", seq=1, ranks={(1, 0): Figures(1, 0, 1)}, now=10.5)
    assert p.expire(11.49) == ([], set())
    assert p.expire(11.5) == (["a"], {(1, 0)})
    assert p.total((1, 0)) == Figures(1, 0, 1) and p.peers() == ["b"]
    assert p.expire(12.0) == (["b"], {(1, 0)})
    assert p.total((1, 0)) is None and len(p) == 0


def test_own_figures_are_the_bookings_per_rank() -> None:
    b = Bookings()
    b.book("q1", (1, 0), model="m", prefill_tokens=100, hashes=[1, 2, 3])
    b.book("q2", (1, 0), model="m", prefill_tokens=40, hashes=[1, 2, 4])
    b.book("q3", (2, 1), model="m", prefill_tokens=8, hashes=[9])
    b.first_token("q1")
    assert own_figures(b) == {(1, 0): Figures(2, 40, 4), (2, 1): Figures(1, 8, 1)}
    v = b.version
    b.free("q3")
    assert b.version > v and own_figures(b) == {(1, 0): Figures(2, 40, 4)}


def test_router_load_messages_are_bounded_and_speak_for_their_subject() -> None:
    msg = to_message("r-a", "boot1", 3, {(7, 0): Figures(2, 10, 4)})
    back = decode_router_load(msg.to_bytes())
    assert back == msg and back.ranks == [(7, 0, 2, 10, 4)]
    check_router_load_subject("rudder.routerload.r-a", back)
    with pytest.raises(SubjectMismatch) as err:
        check_router_load_subject("rudder.routerload.r-b", back)
    assert err.value.field == "router_id"
    with pytest.raises(InvalidRequest) as bad:
        decode_router_load(b'{"router_id": "r-a", "boot": "b", "seq": 1, "ranks": [[7, 0, -1, 0, 0]]}')
    assert bad.value.field.startswith("ranks")
    with pytest.raises(InvalidRequest) as big:
        decode_router_load({"router_id": "r-a", "boot": "b", "seq": 1,
                            "ranks": [[i + 1, 0, 1, 0, 0] for i in range(8193)]})
    assert big.value.field == "ranks"


# -- the merge in the scheduler ------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _sched(clock: Clock) -> Scheduler:
    now = datetime.now(UTC)
    return Scheduler(
        router_id="r-b", models=["m"], role=RouterRole.AGGREGATED, mode=RoutingMode.KV_BLOCKS, kv_events=True,
        cache_inputs=ALL_CACHE_INPUTS, startup={k: startup_values(k) for k in PolicyKind}, worker_ttl_s=10,
        worker_stale_s=3, clock=clock, wall=lambda: now, rng=random.Random(1), keyring=session_keys().keyring,
        peer_stale_s=1.5,
    )


STARTED = datetime.now(UTC)  # every worker's one process (a later start is a restart)


def _member(wid: int, op: MembershipOp = MembershipOp.JOIN, load: list[RankLoad] | None = None) -> MembershipEvent:
    rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", block_size=4, kv_total_blocks=1000,
                       max_num_batched_tokens=64, started_at=STARTED)
    return MembershipEvent(op=op, worker=rec, load=load or [], at=datetime.now(UTC))


def _req(i: int) -> RoutingRequest:
    return RoutingRequest(request_id=f"q{i}", model="m", prompt_tokens=16, hashes={4: [i * 10 + 1, i * 10 + 2]})


def _slot(s: Scheduler, wid: int) -> tuple[int, int, int]:
    slot = s._slots["m"][(wid, 0)]
    return slot.active_requests, slot.active_prefill_tokens, slot.decode_blocks


def test_load_is_the_larger_of_all_bookings_and_the_report() -> None:
    clock = Clock()
    s = _sched(clock)
    s._dispatch(ApplyMembership(_member(1)))
    s._dispatch(ApplyMembership(_member(2)))
    s._dispatch(SelectWorker(_req(1)))  # own booking: one request of 16 prefill tokens, 2 blocks
    own = next(k for k in ((1, 0), (2, 0)) if s.bookings.rank(k) is not None)
    other = (3 - own[0], 0)
    s._dispatch(ApplyPeerLoad("r-a", "x", 1, {own: Figures(3, 100, 6), other: Figures(1, 5, 1)}))
    assert _slot(s, own[0]) == (4, 116, 8)  # own + peer
    assert _slot(s, other[0]) == (1, 5, 1)
    # the worker's report (a heartbeat with load) counts what the peer had booked there: the peer's
    # figures of its ranks are dropped; the report and own bookings give the larger
    beat = _member(own[0], MembershipOp.HEARTBEAT, [RankLoad(dp_rank=0, running=3, active_prefill_tokens=50,
                                                             active_decode_blocks=2)])
    s._dispatch(ApplyMembership(beat))
    assert _slot(s, own[0]) == (3, 50, 2)
    assert _slot(s, other[0]) == (1, 5, 1)  # another worker's figures stay
    # the peer's next snapshot: a request it booked since (the report could not include it)
    s._dispatch(ApplyPeerLoad("r-a", "x", 2, {own: Figures(4, 120, 7)}))
    assert _slot(s, own[0]) == (5, 136, 9)
    assert _slot(s, other[0]) == (0, 0, 0)


def test_a_peers_booking_steers_the_next_selection_and_a_silent_peer_is_forgotten() -> None:
    clock = Clock()
    s = _sched(clock)
    s._dispatch(ApplyMembership(_member(1)))
    s._dispatch(ApplyMembership(_member(2)))
    for n in range(1, 6):  # the peer booked worker 1 busy: every selection here goes to worker 2
        s._dispatch(ApplyPeerLoad("r-a", "x", n, {(1, 0): Figures(5, 600, 50)}))
        assert s._dispatch(SelectWorker(_req(n))).instance_id == 2
    assert s.bookings.rank((1, 0)) is None
    # the peer stops publishing: forgotten at the tick after peer_stale_s, not before
    clock.t += 1.4
    s._dispatch(Tick())
    assert _slot(s, 1)[0] == 5
    clock.t += 0.1
    s._dispatch(Tick())
    assert _slot(s, 1) == (0, 0, 0) and s.peers.peers() == []


def test_take_bookings_answers_only_when_they_changed() -> None:
    s = _sched(Clock())
    s._dispatch(ApplyMembership(_member(1)))
    snap = s._dispatch(TakeBookings(since=-1))
    assert snap.ranks == {}
    assert s._dispatch(TakeBookings(since=snap.version)) is None
    sel = s._dispatch(SelectWorker(_req(1)))
    snap = s._dispatch(TakeBookings(since=snap.version))
    assert snap.ranks == {(sel.instance_id, 0): Figures(1, 16, 2)}
    assert s._dispatch(TakeBookings(since=snap.version)) is None


def test_a_departed_workers_peer_figures_go_with_it() -> None:
    s = _sched(Clock())
    s._dispatch(ApplyMembership(_member(1)))
    s._dispatch(ApplyPeerLoad("r-a", "x", 1, {(1, 0): Figures(2, 0, 2)}))
    s._dispatch(ApplyMembership(_member(1, MembershipOp.LEAVE)))
    assert s.peers.total((1, 0)) is None


def test_a_router_may_publish_its_own_bookings_only_and_read_every_peers() -> None:
    perms = permissions(Identity(IdentityKind.ROUTER, router_id="r-a"))
    mine = [p for p in perms.publish if p.startswith("rudder.routerload")]
    assert mine == ["rudder.routerload.r-a"]
    assert "rudder.routerload.*" in perms.subscribe
    worker = permissions(Identity(IdentityKind.WORKER, model="m", instance_id=3))
    assert not any(p.startswith("rudder.routerload") for p in (*worker.publish, *worker.subscribe))


def test_expected_returns_are_shared_so_a_session_is_expected_whichever_replica_routed_it() -> None:
    clock = Clock()
    a, b = _sched(clock), _sched(clock)
    a.peer_sync = b.peer_sync = True
    for s in (a, b):
        s._dispatch(ApplyMembership(_member(1)))
        s._dispatch(ApplyMembership(_member(2)))
    first = RoutingRequest(request_id="t1", model="m", prompt_tokens=16, hashes={4: [1, 2, 3, 4]})
    sel = a._dispatch(SelectWorker(first))
    a._dispatch(RequestFirstToken("t1", ttft_ms=5.0))
    clock.t += 0.5
    a._dispatch(RequestDone("t1"))
    snap = a._dispatch(TakeBookings(since=-1))
    assert [(f.key, f.hash) for f in snap.finished] == [((sel.instance_id, 0), 4)]
    assert a._dispatch(TakeBookings(since=snap.version)) is None  # events are taken once
    # b hears of it: it expects the session back on that rank too
    b._dispatch(ApplyPeerLoad("r-a", "x", 1, snap.ranks, snap.finished, snap.returned))
    assert b.tables.returns.rate((sel.instance_id, 0), clock.t) > 0
    # the next turn comes through b: b closes the entry, and tells a, which closes its own
    clock.t += 2.0
    nxt = RoutingRequest(request_id="t2", model="m", prompt_tokens=24, hashes={4: [1, 2, 3, 4, 5, 6]})
    b._dispatch(SelectWorker(nxt))
    b._dispatch(RequestFirstToken("t2", ttft_ms=5.0))
    back = b._dispatch(TakeBookings(since=-1))
    assert back.returned == [4] and b.tables.returns.rate((sel.instance_id, 0), clock.t) == 0
    assert a.tables.returns.rate((sel.instance_id, 0), clock.t) > 0
    a._dispatch(ApplyPeerLoad("r-b", "y", 1, back.ranks, back.finished, back.returned))
    assert a.tables.returns.rate((sel.instance_id, 0), clock.t) == 0
    assert a.tables.returns.fraction == b.tables.returns.fraction  # both counted one finish, one return
