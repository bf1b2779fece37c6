"""What a worker may claim is bounded at the router (issue 17 items 1-2), without a network."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from controlplane.protocol.events import (
    DEFAULT_DECODE_MIN_MS,
    DEFAULT_DECODE_MS,
    DEFAULT_PREFILL_MS,
    EngineTiming,
    KvEvent,
    KvStored,
    MembershipEvent,
    MembershipOp,
    RankLoad,
    StoredBlock,
    WorkerRecord,
)
from router.calibration import PrefillObservation
from router.claims import CacheOutcomes, ClaimCaps, RateLimits, TimingOutcomes
from router.cost.time import DEFAULT_TIMING, Timing
from router.index import KvApplied, PrefixIndex

pytestmark = pytest.mark.timeout(20)


def _join(*, dp: int, blocks: int, load: int = 0) -> MembershipEvent:
    rec = WorkerRecord(instance_id=7, model="m", url="http://w", dp_size=dp, block_size=16,
                       kv_total_blocks=blocks, max_num_batched_tokens=8192, started_at=datetime.now(UTC))
    return MembershipEvent(op=MembershipOp.JOIN, worker=rec, load=[RankLoad(dp_rank=r) for r in range(load)],
                           at=datetime.now(UTC))


def test_dp_size_and_kv_blocks_are_cut_to_the_caps_with_the_load_of_ranks_past_them() -> None:
    caps = ClaimCaps(max_dp_size=8, max_kv_blocks=1000)
    capped, fields = caps.cap(_join(dp=1024, blocks=2**32, load=1024))
    assert fields == ["dp_size", "kv_total_blocks"]
    assert capped.worker.dp_size == 8 and capped.worker.kv_total_blocks == 1000
    assert [r.dp_rank for r in capped.load] == list(range(8))
    honest = _join(dp=4, blocks=1000, load=4)
    assert caps.cap(honest) == (honest, [])
    assert caps.blocks_per_rank(1000, 8) == 125


def _timing(scale: float) -> Timing:
    return Timing.from_engine(EngineTiming(
        prefill_ms=tuple(v * scale for v in DEFAULT_PREFILL_MS),  # type: ignore[arg-type]
        decode_ms=tuple(v * scale for v in DEFAULT_DECODE_MS),  # type: ignore[arg-type]
        decode_min_ms=DEFAULT_DECODE_MIN_MS * scale))


def test_a_zero_cost_prior_is_not_believed_but_a_fast_engine_is() -> None:
    caps = ClaimCaps(max_prior_speedup=256)
    zero = Timing.from_engine(EngineTiming(prefill_ms=(0, 0, 0), decode_ms=(0, 0, 0), decode_min_ms=0))
    assert caps.prior(zero) == DEFAULT_TIMING
    assert caps.prior(_timing(1 / 1000)) == DEFAULT_TIMING  # 1000x faster than the router's own
    assert caps.prior(_timing(1000)) == DEFAULT_TIMING
    fast = _timing(1 / 200)  # the mock at speed-up 200, as tests run it
    assert caps.prior(fast) == fast


def test_the_index_holds_at_most_a_ranks_capacity() -> None:
    index = PrefixIndex()
    index.set_capacity(7, 10)
    event = KvEvent(instance_id=7, event_id=0, data=KvStored(
        blocks=[StoredBlock(block_hash=h, tokens_hash=h) for h in range(1, 1001)]))
    assert index.apply(event) is KvApplied.NEW_WORKER
    assert index.blocks_of((7, 0)) == 10 and len(index) == 10 and index.refused == 990
    # Blocks it already holds are stored again for free (another tier, say).
    again = KvEvent(instance_id=7, event_id=1, data=KvStored(
        blocks=[StoredBlock(block_hash=h, tokens_hash=h) for h in range(1, 11)]))
    assert index.apply(again) is KvApplied.APPLIED
    assert index.blocks_of((7, 0)) == 10 and index.refused == 990
    index.store((7, 1), [5000, 5001])  # its second rank
    assert index.held() == {7: 12}  # what /metrics shows (rudder_router_prefix_index_blocks)
    index.remove_worker(7)
    assert len(index) == 0 and index.held() == {}


def test_events_buffered_during_a_dump_are_bounded() -> None:
    index = PrefixIndex(max_buffered=3)
    index.begin_dump(7)
    for i in range(10):
        index.apply(KvEvent(instance_id=7, event_id=i, data=KvStored(blocks=[StoredBlock(block_hash=i + 1,
                                                                                          tokens_hash=1)])))
    assert index.buffer_dropped == 7


def test_rate_limits_are_a_bucket_per_source_and_bounded() -> None:
    limits = RateLimits(10, 5, max_sources=2)
    assert [limits.allow("a", 0.0) for _ in range(7)] == [True] * 5 + [False] * 2
    assert limits.allow("b", 0.0)  # another source has its own bucket
    assert limits.allow("a", 0.1) and not limits.allow("a", 0.1)  # 10/s: one more after 0.1 s
    limits.allow("c", 0.1)  # a third source evicts the least recently used
    assert len(limits._buckets) == 2


def test_a_worker_delivering_less_than_half_its_predicted_hits_is_quarantined_once() -> None:
    outcomes = CacheOutcomes(min_predicted=1000, min_ratio=0.5, decay=1.0)
    assert not outcomes.report(1, 600, 600)  # honest
    assert not outcomes.report(1, 600, 500)
    assert outcomes.ratio(1) == pytest.approx(1100 / 1200)
    assert not outcomes.report(2, 500, 0)  # below min_predicted: not judged yet
    assert outcomes.report(2, 600, 0)  # 1100 predicted, none delivered
    assert not outcomes.report(2, 600, 0)  # already quarantined
    assert outcomes.quarantined == {2}
    assert not outcomes.report(3, 2000, 5000) and outcomes.ratio(3) == 1.0  # over-delivery earns nothing
    outcomes.forget(2)
    assert outcomes.quarantined == set()


def test_a_worker_persistently_slower_than_its_claimed_prior_loses_it_once() -> None:
    outcomes = TimingOutcomes(max_ratio=4.0, slack_ms=20.0, min_weight=8.0, decay=1.0, persist_s=0.0)
    for i in range(50):  # honest, with HTTP overhead: 3 ms predicted, 10 ms measured (inside the slack)
        assert not outcomes.report(1, 3.0, 10.0, now=i)
    assert 1 not in outcomes.quarantined
    caught = [outcomes.report(2, 0.3, 30.0, now=i) for i in range(10)]  # claims 100x faster than it is
    assert caught == [False] * 7 + [True, False, False]  # judged from min_weight answers on, once
    assert outcomes.quarantined == {2} and outcomes.ratio(2) == pytest.approx(100.0)
    assert not outcomes.report(3, float("nan"), 5.0, now=0) and outcomes.ratio(3) is None
    outcomes.forget(2)
    assert outcomes.quarantined == set()


def test_a_claim_is_taken_away_only_after_answers_read_slower_without_a_break_for_persist_s() -> None:
    """A batch of first tokens that all waited on one stall of their worker arrives together: one
    event, many answers. Past the bound for less than ``persist_s`` (answers 10 ms apart, then
    quick ones), the claim stays; past it for ``persist_s`` without a break, it goes."""
    outcomes = TimingOutcomes(max_ratio=4.0, slack_ms=20.0, min_weight=8.0, decay=0.95, persist_s=3.0)
    t = 0.0
    for _ in range(30):  # honest and quick
        t += 0.1
        assert not outcomes.report(1, 3.0, 5.0, now=t)
    for _ in range(30):  # a stall: 30 first tokens 55 ms late, within 0.3 s
        t += 0.01
        assert not outcomes.report(1, 3.0, 60.0, now=t)
    for _ in range(60):  # quick again: the window recovers, the clock restarts
        t += 0.1
        assert not outcomes.report(1, 3.0, 5.0, now=t)
    assert outcomes.quarantined == set()
    caught = []
    for _ in range(60):  # slow for good (claims 20x faster than it is): caught after 3 s past the bound
        t += 0.1
        caught.append(outcomes.report(1, 3.0, 60.0, now=t))
    assert caught.count(True) == 1 and outcomes.quarantined == {1}
    assert 30 <= caught.index(True) <= 45  # ~0.5-1 s for the window to cross, then 3 s


def test_the_claimed_prior_predicts_the_first_token_as_the_fit_models_it() -> None:
    obs = PrefillObservation(queued_tokens=0, uncached_tokens=512, running=0, kv_usage=0.5, budget=8192,
                             measured_ms=0.0, predicted_ms=0.0)
    assert obs.ttft_ms(DEFAULT_TIMING) == pytest.approx(DEFAULT_TIMING.prefill_step_ms(512))
    busy = PrefillObservation(queued_tokens=8192, uncached_tokens=512, running=3, kv_usage=0.5, budget=8192,
                              measured_ms=0.0, predicted_ms=0.0)
    want = (DEFAULT_TIMING.prefill_step_ms(8192) + DEFAULT_TIMING.prefill_step_ms(512)
            + 2 * DEFAULT_TIMING.decode_step_ms(0.5))
    assert busy.ttft_ms(DEFAULT_TIMING) == pytest.approx(want)


def test_a_delay_a_workers_peers_share_is_not_held_against_it_alone_it_is() -> None:
    outcomes = TimingOutcomes(max_ratio=4.0, slack_ms=20.0, min_weight=8.0, decay=1.0, persist_s=0.0)
    for i in range(50):  # a loaded host: every answer 30 ms past any prior (3 ms predicted)
        for wid in (1, 2, 3):
            assert not outcomes.report(wid, 3.0, 33.0, now=i, peers=(1, 2, 3, 4))
    assert outcomes.quarantined == set() and outcomes.shared_ms(1, (1, 2, 3)) == pytest.approx(30.0)
    # Claims 100x faster than it is, on the same host: judged on its delay past its peers'.
    caught = [outcomes.report(4, 0.3, 30.0 + 30.0, now=50, peers=(1, 2, 3, 4)) for _ in range(10)]
    assert caught == [False] * 7 + [True, False, False] and outcomes.quarantined == {4}
    assert outcomes.shared_ms(1, (1, 2, 3, 4)) == pytest.approx(30.0)  # a quarantined peer counts no more
    # With no peer to say the delay is shared, the same answers read as a lie (as before).
    alone = TimingOutcomes(max_ratio=4.0, slack_ms=20.0, min_weight=8.0, decay=1.0, persist_s=0.0)
    assert [alone.report(9, 3.0, 33.0, now=0, peers=(9,)) for _ in range(9)][-2:] == [True, False]
