"""Timing model and the per-rank scheduler's budgets, prefix hits and preemption (pure)."""

from __future__ import annotations

import math

import pytest

from controlplane.protocol.events import KvRemoved, KvStored
from worker.engines.mock.blocks import BlockPool
from worker.engines.mock.scheduler import Scheduler, SeqState, output_token
from worker.engines.mock.timing import TimingModel
from worker.settings import MockEngineSettings


def make(num_blocks: int = 64, bs: int = 4, seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(
        pool=BlockPool(num_blocks=num_blocks, block_size=bs), timing=TimingModel(),
        max_num_seqs=seqs, max_num_batched_tokens=budget,
    )


def run_to_end(s: Scheduler, limit: int = 10_000) -> list[int]:
    tokens: list[int] = []
    for _ in range(limit):
        if not s.has_work:
            return tokens
        tokens.extend(o.token for o in s.complete(s.schedule()))
    raise AssertionError("scheduler did not drain")


# -- timing -------------------------------------------------------------------------------------


def test_timing_defaults_match_the_reference_simulator() -> None:
    t = TimingModel.from_settings(MockEngineSettings())
    assert t.prefill_ms(0) == 0.0
    assert t.prefill_ms(1000) == pytest.approx(4.209989e-7 * 1e6 + 1.518344e-2 * 1000 + 16.50142)
    assert t.decode_ms(0.0) == pytest.approx(5.74)
    assert t.decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert t.decode_ms(2.0) == t.decode_ms(1.0)  # usage is clamped
    assert t.step_ms(uncached_tokens=0, decoding=0, kv_usage=0.3) == 0.0
    both = t.step_ms(uncached_tokens=100, decoding=3, kv_usage=0.3)
    assert both == pytest.approx(t.prefill_ms(100) + t.decode_ms(0.3))


def test_timing_speedup_and_floor() -> None:
    fast = TimingModel(speedup_ratio=10.0)
    assert fast.prefill_ms(500) == pytest.approx(TimingModel().prefill_ms(500) / 10)
    floor = TimingModel(decode_a=0.0, decode_b=0.0, decode_c=0.1, decode_min_ms=1.0)
    assert floor.decode_ms(0.5) == 1.0
    assert fast.kv_transfer_ms(10) == pytest.approx((2.0 + 0.05 * 10) / 10)
    assert MockEngineSettings().num_blocks == 16384 and MockEngineSettings().block_size == 64
    assert MockEngineSettings().max_num_seqs == 256
    assert MockEngineSettings().max_num_batched_tokens == 8192


# -- scheduler ----------------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    s = make(budget=16)
    seq = s.add("r1", list(range(40)), max_tokens=3)
    sizes = []
    while seq.generated == 0:
        batch = s.schedule()
        assert sum(i.num_tokens for i in batch.items) <= 16
        sizes.append(batch.uncached_tokens)
        s.complete(batch)
    assert sizes == [16, 16, 8]
    assert run_to_end(s) == [output_token(1), output_token(2)]
    assert seq.state is SeqState.FINISHED and s.pool.used_blocks == 0


def test_decodes_are_served_before_new_prefills_and_share_the_budget() -> None:
    s = make(budget=10)
    a = s.add("a", list(range(8)), max_tokens=5)
    s.complete(s.schedule())  # a prefilled, first token out
    assert a.generated == 1
    b = s.add("b", list(range(100, 130)), max_tokens=1)
    batch = s.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in batch.items] == [("a", 1), ("b", 9)]
    assert batch.decoding == 1 and batch.uncached_tokens == 9
    assert batch.duration_ms == pytest.approx(
        s.timing.prefill_ms(9) + s.timing.decode_ms(s.pool.usage)
    )
    s.complete(batch)
    assert b.computed == 9


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make(seqs=2, budget=1000)
    for i in range(5):
        s.add(f"r{i}", [i] * 6, max_tokens=4)
    batch = s.schedule()
    assert len(batch.items) == 2 and len(s.running) == 2 and len(s.waiting) == 3
    load = s.load()
    assert load.running == 2 and load.waiting == 3
    assert load.active_prefill_tokens == 3 * 6 + 2 * 6  # nothing computed yet
    s.complete(batch)
    assert s.load().active_prefill_tokens == 3 * 6
    run_to_end(s)
    assert s.load().running == 0 and s.load().kv_used_blocks == 0


def test_repeated_prompt_hits_its_full_blocks_and_stores_nothing_new() -> None:
    s = make(bs=4, budget=100)
    prompt = list(range(18))  # 4 full blocks + 2 tokens
    first = s.add("1", prompt, max_tokens=1)
    run_to_end(s)
    assert first.cached_tokens == 0
    stored = [e for e in s.pool.drain_events() if isinstance(e, KvStored)]
    assert sum(len(e.blocks) for e in stored) == 4
    second = s.add("2", prompt, max_tokens=1)
    batch = s.schedule()
    assert second.cached_tokens == 16 and batch.uncached_tokens == 2
    s.complete(batch)
    assert [e for e in s.pool.drain_events() if isinstance(e, KvStored)] == []


def test_fully_cached_aligned_prompt_still_computes_its_last_token() -> None:
    s = make(bs=4, budget=100)
    prompt = list(range(16))
    s.add("1", prompt, max_tokens=1)
    run_to_end(s)
    again = s.add("2", prompt, max_tokens=1)
    batch = s.schedule()
    assert again.cached_tokens == 12 and batch.uncached_tokens == 4


def test_generated_tokens_fill_blocks_that_are_cached_too() -> None:
    s = make(bs=4, budget=100)
    s.add("1", list(range(6)), max_tokens=7)  # 6 + 7 = 13 tokens; 12 computed → 3 full blocks
    run_to_end(s)
    stored = [b for e in s.pool.drain_events() if isinstance(e, KvStored) for b in e.blocks]
    assert len(stored) == 3


def test_remote_prefill_skips_the_prompt_compute() -> None:
    s = make(bs=4, budget=8)
    seq = s.add("d", list(range(40)), max_tokens=2, remote_prefill=True)
    batch = s.schedule()
    assert batch.items[0].num_tokens == 1 and batch.decoding == 1 and batch.uncached_tokens == 0
    s.complete(batch)
    assert seq.generated == 1 and s.pool.cached_blocks == 10


def test_small_pool_preempts_and_evicts_but_finishes_everything() -> None:
    s = make(num_blocks=6, bs=4, seqs=4, budget=64)
    seqs = [s.add(f"r{i}", [i] * 9, max_tokens=6) for i in range(3)]
    out = run_to_end(s)
    assert len(out) == 18
    assert all(q.state is SeqState.FINISHED for q in seqs)
    assert s.preemptions > 0
    assert any(isinstance(e, KvRemoved) for e in s.pool.drain_events())
    assert s.pool.used_blocks == 0


def test_abort_releases_blocks_wherever_the_request_is() -> None:
    s = make(budget=8)
    a = s.add("a", list(range(20)), max_tokens=4)
    b = s.add("b", list(range(20)), max_tokens=4)
    batch = s.schedule()
    s.abort(a)
    s.abort(b)
    assert s.complete(batch) == []
    assert a.state is SeqState.ABORTED and b.state is SeqState.ABORTED
    assert s.pool.used_blocks == 0 and not s.has_work


def test_requests_that_can_never_fit_are_refused() -> None:
    s = make(num_blocks=4, bs=4)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add("big", [1] * 15, max_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        s.add("empty", [], max_tokens=2)
    assert math.isclose(s.pool.usage, 0.0)
