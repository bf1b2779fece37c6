"""Pure router state: prefix index, discovery, bookings, busy thresholds, policy application."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

from controlplane.protocol.events import (
    KvCleared,
    KvDumpRank,
    KvDumpReply,
    KvEvent,
    KvRemoved,
    KvStored,
    MembershipEvent,
    MembershipOp,
    StoredBlock,
    WorkerRecord,
)
from controlplane.protocol.hashing import block_hashes
from controlplane.protocol.policy import ALL_CACHE_INPUTS, CacheInput, PolicyKind, startup_values
from router.bookings import Bookings
from router.busy import Thresholds, rank_busy
from router.cost.common import Overlap
from router.discovery import Change, Discovery, Health
from router.index import KvApplied, PrefixIndex
from router.policy_state import ApplyResult, Outcome, PolicyState
from tests.policy_keys import session_keys

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _stored(wid: int, eid: int, tokens: list[int], bs: int = 4, *, rank: int = 0,
            tier: CacheInput = CacheInput.DEVICE) -> KvEvent:
    blocks = [StoredBlock(block_hash=c, tokens_hash=b) for c, b in block_hashes(tokens, bs)]
    return KvEvent(instance_id=wid, dp_rank=rank, event_id=eid, tier=tier,
                   data=KvStored(parent_hash=None, blocks=blocks))


def _chain(tokens: list[int], bs: int = 4) -> list[int]:
    return [c for c, _ in block_hashes(tokens, bs)]


# -- index --------------------------------------------------------------------------------------


def test_index_overlap_is_the_leading_run_per_worker_and_tier() -> None:
    idx = PrefixIndex()
    toks = list(range(32))  # 8 blocks of 4
    assert idx.apply(_stored(1, 0, toks[:24])) is KvApplied.NEW_WORKER
    assert idx.apply(_stored(2, 0, toks[:8])) is KvApplied.NEW_WORKER
    assert idx.apply(_stored(2, 1, toks[:16], tier=CacheInput.HOST)) is KvApplied.APPLIED
    ov = idx.overlaps(_chain(toks))
    assert ov[(1, 0)] == Overlap(device=6)
    # blocks 0-1 on device (fastest tier wins), 2-3 only on host
    assert ov[(2, 0)] == Overlap(device=2, host=2)


def test_index_removed_and_cleared() -> None:
    idx = PrefixIndex()
    toks = list(range(16))
    chain = _chain(toks)
    idx.apply(_stored(1, 0, toks))
    idx.apply(KvEvent(instance_id=1, event_id=1, data=KvRemoved(block_hashes=[chain[2]])))
    assert idx.overlaps(chain)[(1, 0)] == Overlap(device=2)
    idx.apply(KvEvent(instance_id=1, event_id=2, data=KvCleared()))
    assert idx.overlaps(chain) == {}
    assert len(idx) == 0


def test_index_gap_duplicate_and_dump_replay() -> None:
    idx = PrefixIndex()
    toks = list(range(16))
    idx.apply(_stored(1, 0, toks[:4]))
    assert idx.apply(_stored(1, 0, toks[:4])) is KvApplied.DUPLICATE
    assert idx.apply(_stored(1, 5, toks[:8])) is KvApplied.GAP
    assert idx.begin_dump(1)
    assert idx.apply(_stored(1, 6, toks[:12])) is KvApplied.BUFFERED
    assert idx.apply(_stored(1, 8, toks[:16])) is KvApplied.BUFFERED
    dump = KvDumpReply(instance_id=1, last_event_id=7, ranks=[
        KvDumpRank(dp_rank=0, blocks=[(None, c, b) for c, b in block_hashes(toks[:12], 4)])
    ])
    replay = idx.load_dump(dump)
    assert replay == [KvApplied.APPLIED]  # event 6 ≤ 7 dropped, event 8 follows 7
    assert idx.overlaps(_chain(toks))[(1, 0)] == Overlap(device=4)


def test_index_remove_worker_and_approximate_expiry() -> None:
    idx = PrefixIndex()
    chain = _chain(list(range(16)))
    idx.record((1, 0), chain, now=0.0, ttl=10.0)
    idx.record((2, 0), chain[:2], now=5.0, ttl=10.0)
    assert idx.overlaps(chain)[(1, 0)] == Overlap(device=4)
    assert idx.expire(10.0) == 4
    assert (1, 0) not in idx.overlaps(chain)
    assert idx.overlaps(chain)[(2, 0)] == Overlap(device=2)
    idx.remove_worker(2)
    assert idx.overlaps(chain) == {}


# -- discovery ----------------------------------------------------------------------------------


def _rec(wid: int, *, model: str = "m", dp: int = 1) -> WorkerRecord:
    return WorkerRecord(instance_id=wid, model=model, url=f"http://w{wid}", dp_size=dp,
                        block_size=4, kv_total_blocks=100, max_num_batched_tokens=64, started_at=T0)


def _mem(op: MembershipOp, wid: int, at: datetime, **kw: object) -> MembershipEvent:
    return MembershipEvent(op=op, worker=_rec(wid), at=at, **kw)  # type: ignore[arg-type]


def _beat(d: Discovery, wid: int, now: float) -> Change:
    return d.apply(_mem(MembershipOp.HEARTBEAT, wid, T0 + timedelta(seconds=now)), now=now,
                   wall_now=T0 + timedelta(seconds=now))


def test_discovery_join_stale_expire_and_leave() -> None:
    """Worker 1 stops while worker 2 goes on heartbeating: 1 goes stale, then expires."""
    d = Discovery(ttl_s=10, stale_s=3, models=frozenset({"m"}))
    assert d.apply(_mem(MembershipOp.JOIN, 1, T0), now=100.0, wall_now=T0) is Change.JOINED
    assert _beat(d, 1, 101.0) is Change.UPDATED
    s = d.get(1)
    assert s is not None
    for t in range(101, 112):
        _beat(d, 2, float(t))
        if t == 102:
            assert d.health(s, 102.0) is Health.LIVE
        if t == 104:
            assert d.health(s, 104.5) is Health.STALE
        if t == 110:
            assert d.expire(110.9) == []
    assert d.expire(111.0) == [1]
    assert d.get(1) is None
    d.apply(_mem(MembershipOp.JOIN, 2, T0), now=0.0, wall_now=T0)
    assert d.apply(_mem(MembershipOp.LEAVE, 2, T0), now=0.0, wall_now=T0) is Change.LEFT


def test_discovery_ignores_replayed_dead_workers_and_other_models() -> None:
    d = Discovery(ttl_s=10, stale_s=3, models=frozenset({"m"}))
    old = _mem(MembershipOp.HEARTBEAT, 1, T0)
    # Stored by the bus 30 s ago (a replay of a dead worker's last record).
    assert d.apply(old, now=0.0, wall_now=T0 + timedelta(seconds=30), received_at=T0) is Change.IGNORED
    other = MembershipEvent(op=MembershipOp.JOIN, worker=_rec(2, model="x"), at=T0)
    assert d.apply(other, now=0.0, wall_now=T0) is Change.IGNORED
    # A heartbeat stored 2 s ago is seen as 2 s old.
    d.apply(_mem(MembershipOp.HEARTBEAT, 3, T0), now=50.0, wall_now=T0 + timedelta(seconds=2),
            received_at=T0)
    s = d.get(3)
    assert s is not None and s.last_seen == 48.0


def test_discovery_liveness_uses_the_receivers_clock_not_the_payloads_at() -> None:
    d = Discovery(ttl_s=10, stale_s=3, models=frozenset({"m"}))
    future = T0 + timedelta(days=365)
    # A forged heartbeat stamped a year ahead is as old as when it was received ...
    assert d.apply(_mem(MembershipOp.JOIN, 1, future), now=0.0, wall_now=T0) is Change.JOINED
    s = d.get(1)
    assert s is not None and s.last_seen == 0.0
    for t in (1.0, 2.0, 3.0):  # (another worker's heartbeats keep the bus clock running)
        _beat(d, 9, t)
    assert d.health(s, 3.0) is Health.STALE
    for t in range(4, 11):
        _beat(d, 9, float(t))
    assert d.expire(10.0) == [1]  # ... so it cannot keep the worker alive
    # ... and it does not hide the worker's later, honestly stamped heartbeats.
    d = Discovery(ttl_s=10, stale_s=3, models=frozenset({"m"}))
    d.apply(_mem(MembershipOp.JOIN, 2, future), now=0.0, wall_now=T0)
    assert d.apply(_mem(MembershipOp.HEARTBEAT, 2, T0 + timedelta(seconds=5)), now=5.0,
                   wall_now=T0 + timedelta(seconds=5)) is Change.UPDATED
    s2 = d.get(2)
    assert s2 is not None and s2.last_seen == d.bus_clock(5.0)  # just now
    assert d.health(s2, 5.0) is Health.LIVE
    # A bus timestamp ahead of the receiver (clock skew) counts as "just now", not as younger.
    d.apply(_mem(MembershipOp.HEARTBEAT, 2, T0), now=6.0, wall_now=T0,
            received_at=T0 + timedelta(hours=1))
    assert s2.last_seen == d.bus_clock(6.0)


def test_a_silent_bus_stales_no_worker_until_the_outage_grace() -> None:
    """Every heartbeat stops at once (a broker restart, a leader election): nobody ages, so the
    pools stay; heartbeats again and all is as before. Silence beyond the grace: ages grow with the
    clock less the grace, so a fleet that is really gone still goes stale and expires."""
    d = Discovery(ttl_s=10, stale_s=3, outage_grace_s=30)
    for wid in (1, 2, 3):
        _beat(d, wid, 100.0)
    states = [d.get(w) for w in (1, 2, 3)]
    assert all(s is not None for s in states)
    for now in (104.0, 115.0, 129.9):
        assert [d.health(s, now) for s in states if s] == [Health.LIVE] * 3
        assert d.expire(now) == []
    for wid in (1, 2):  # the bus is back; worker 3 does not come back
        _beat(d, wid, 131.0)
    assert d.health(states[2], 131.0) is Health.LIVE  # 2.5 s old: 1.5 s of the silence counted, then 1 s
    for t in (132.0, 133.0, 134.0):
        for wid in (1, 2):
            _beat(d, wid, t)
    assert [d.health(s, 134.0) for s in states if s] == [Health.LIVE, Health.LIVE, Health.STALE]
    # A silence longer than the grace: past it the clock counts again (after the 1.5 s that
    # any silence counts), so the fleet is stale at 30 + 1.5 s and gone at 30 + 8.5 s.
    assert d.health(states[0], 134.0 + 31.4) is Health.LIVE
    assert d.health(states[0], 134.0 + 31.5) is Health.STALE
    assert d.expire(134.0 + 32.9) == []
    assert d.expire(134.0 + 33.0) == [3]  # 5.5 s old when the silence began
    assert d.expire(134.0 + 38.4) == []
    assert sorted(d.expire(134.0 + 38.5)) == [1, 2]


def test_discovery_unreachable_until_next_heartbeat() -> None:
    d = Discovery(ttl_s=10, stale_s=3)
    d.apply(_mem(MembershipOp.JOIN, 1, T0), now=0.0, wall_now=T0)
    assert d.mark_unreachable(1)
    s = d.get(1)
    assert s is not None and d.health(s, 0.0) is Health.UNREACHABLE
    d.apply(_mem(MembershipOp.HEARTBEAT, 1, T0 + timedelta(seconds=1)), now=1.0,
            wall_now=T0 + timedelta(seconds=1))
    assert d.health(s, 1.0) is Health.LIVE


# -- bookings and busy --------------------------------------------------------------------------


def test_bookings_book_first_token_free() -> None:
    b = Bookings()
    b.book("r1", (1, 0), model="m", prefill_tokens=100, hashes=[1, 2, 3])
    b.book("r2", (1, 0), model="m", prefill_tokens=50, hashes=[1, 2, 9])
    rank = b.rank((1, 0))
    assert rank is not None
    assert (rank.prefill_tokens, rank.requests, rank.active_blocks) == (150, 2, 4)
    b.first_token("r1")
    b.first_token("r1")  # idempotent
    assert rank.prefill_tokens == 50
    b.free("r1")
    assert (rank.prefill_tokens, rank.requests, rank.active_blocks) == (50, 1, 3)
    assert len(b.drop_worker(1)) == 1
    assert b.rank((1, 0)) is None and len(b) == 0


def test_busy_thresholds_each_opt_in() -> None:
    load = {"active_decode_blocks": 50, "active_prefill_tokens": 100, "kv_total_blocks": 100,
            "max_num_batched_tokens": 64}
    assert not rank_busy(Thresholds(), **load)
    assert rank_busy(Thresholds(active_decode_blocks_threshold=0.4), **load)
    assert not rank_busy(Thresholds(active_decode_blocks_threshold=0.5), **load)
    assert rank_busy(Thresholds(active_prefill_tokens_threshold=99), **load)
    assert not rank_busy(Thresholds(active_prefill_tokens_threshold=100), **load)
    assert rank_busy(Thresholds(active_prefill_tokens_threshold_frac=1.5), **load)
    idle = dict(load, active_decode_blocks=0, active_prefill_tokens=0)
    assert not rank_busy(Thresholds(0.0, 0, 0.0), **idle)


# -- policy state -------------------------------------------------------------------------------


def _event(doc: dict[str, float], *, expected: int, kind: str = "selection", model: str = "m") -> bytes:
    return json.dumps({
        "event_id": str(uuid.uuid4()), "model": model, "kind": kind, "op": "patch",
        "expected_revision": expected, "changes": doc, "document": doc, "actor": "t",
        "request_id": "q", "at": T0.isoformat(),
    }).encode()


def _state(inputs: frozenset[CacheInput] = ALL_CACHE_INPUTS) -> PolicyState:
    startup = {k: startup_values(k, cache_inputs=inputs) for k in PolicyKind}
    return PolicyState(router_id="r-1", models=["m"], startup=startup, cache_inputs=inputs,
                       keyring=session_keys().keyring)


def _apply(st: PolicyState, model: str, kind: PolicyKind, revision: int, payload: bytes) -> ApplyResult:
    """Apply an event signed by the session's control-plane key, as on the stream."""
    return st.apply(model, kind, revision, payload, session_keys().headers_for(model, kind, payload))


def test_policy_apply_in_order_idempotent_with_gap_report() -> None:
    st = _state()
    r = _apply(st, "m", PolicyKind.SELECTION, 5, _event({"router_temperature": 0.5}, expected=3))
    assert r.outcome is Outcome.ACK and not r.gap  # the first one after start is never a gap
    assert st.get("m", PolicyKind.SELECTION).effective["router_temperature"] == 0.5
    assert _apply(st, "m", PolicyKind.SELECTION, 5, b"{}").outcome is Outcome.SKIP
    assert _apply(st, "m", PolicyKind.SELECTION, 4, b"{}").outcome is Outcome.SKIP
    r = _apply(st, "m", PolicyKind.SELECTION, 9, _event({}, expected=7))
    assert r.outcome is Outcome.ACK and r.gap
    assert st.get("m", PolicyKind.SELECTION).effective["router_temperature"] == 0.0


def test_policy_nack_keeps_last_good_values() -> None:
    st = _state(frozenset())  # a cache-free router
    assert st.get("m", PolicyKind.SELECTION).startup["host_cache_hit_weight"] == 0.0
    _apply(st, "m", PolicyKind.SELECTION, 1, _event({"router_temperature": 0.2}, expected=0))
    r = _apply(st, "m", PolicyKind.SELECTION, 2, _event({"host_cache_hit_weight": 0.5}, expected=1))
    assert r.outcome is Outcome.NACK
    assert "host_cache_hit_weight" in r.detail and "host" in r.detail
    doc = st.get("m", PolicyKind.SELECTION)
    assert doc.revision == 1 and doc.effective["router_temperature"] == 0.2
    assert doc.effective["host_cache_hit_weight"] == 0.0
    assert doc.last_nack_revision == 2
    bad = _apply(st, "m", PolicyKind.SELECTION, 3, b"not json")
    assert bad.outcome is Outcome.NACK and "malformed" in bad.detail
    wrong = _apply(st, "m", PolicyKind.SELECTION, 4, _event({}, expected=3, model="other"))
    assert wrong.outcome is Outcome.NACK
    invalid = _apply(st, "m", PolicyKind.SELECTION, 5, _event({"router_temperature": -1}, expected=4))
    assert invalid.outcome is Outcome.NACK and "router_temperature" in invalid.detail
    assert st.applied()["m|selection"].revision == 1
