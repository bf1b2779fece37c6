"""router.decisions: a sampled decision's record explains the time cost term by term."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from controlplane.protocol.events import (
    MembershipEvent,
    MembershipOp,
    RankLoad,
    RouterRole,
    WorkerRecord,
)
from controlplane.protocol.hashing import chain_hashes
from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
from router.commands import ApplyMembership, LoadKvDump, RoutingRequest
from router.decisions import TERMS, DecisionLog, DecisionRecord, Why
from router.scheduler import Scheduler
from router.settings import RoutingMode
from tests.policy_keys import session_keys

NOW = datetime.now(UTC)
BLOCK = 16


def sched(decisions: DecisionLog | None, *, mode: RoutingMode = RoutingMode.KV_TIME, seed: int = 1,
          **selection: float) -> Scheduler:
    startup = {k: startup_values(k) for k in PolicyKind}
    startup[PolicyKind.SELECTION].update(selection)
    return Scheduler(
        router_id="r-d", models=["m"], role=RouterRole.AGGREGATED, mode=mode, kv_events=True,
        cache_inputs=ALL_CACHE_INPUTS, startup=startup, worker_ttl_s=1e9, worker_stale_s=1e9,
        clock=lambda: 1000.0, wall=lambda: NOW, rng=random.Random(seed), keyring=session_keys().keyring,
        decisions=decisions,
    )


def join(s: Scheduler, wid: int, *, prefill: int, running: int) -> None:
    rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", block_size=BLOCK,
                       kv_total_blocks=4096, max_num_batched_tokens=512, started_at=NOW)
    load = [RankLoad(active_prefill_tokens=prefill, running=running, active_decode_blocks=running * 40)]
    s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=rec, load=load, at=NOW)))
    s._dispatch(LoadKvDump(wid, None, final=True))


def request(i: int, n: int) -> RoutingRequest:
    tokens = list(range(i, i + n))
    return RoutingRequest(request_id=f"q{i}", model="m", prompt_tokens=n, hashes={BLOCK: chain_hashes(tokens, BLOCK)})


@pytest.mark.parametrize("workers", [3, 120])  # the scalar and the vectorised form of the cost
def test_the_terms_add_up_to_each_candidates_cost_and_the_chosen_one_to_the_selections(workers: int) -> None:
    log = DecisionLog(sample=1.0, capacity=16)
    s = sched(log, decode_slowdown_weight=0.5, prefill_interference_weight=0.3)
    for wid in range(1, workers + 1):
        join(s, wid, prefill=(wid % 4) * 700, running=wid % 3)
        if wid % 2:  # a fit that charges each running request (decision 110)
            cal = s.timings.workers[wid]
            cal.timing = replace(cal.timing, running_ms=0.7, decode_running_ms=0.05)
            s._retime(wid)
    sel = s._select(request(1, 1500), 0)
    (record,) = log.get("q1")
    assert record.instance_id == sel.instance_id and record.cost_ms == sel.cost
    assert record.candidates_total == workers
    # 120 workers repeat 12 loads: the least cost is shared (a uniform draw among them)
    assert record.why == [(Why.LOWEST_COST if workers == 3 else Why.TIE).value]
    assert record.revisions == dict(sel.revisions) and record.router_id == "r-d"
    assert len(record.candidates) == min(workers, 64)
    for c in record.candidates:
        total = sum(getattr(c, t) for t in TERMS)
        assert total == pytest.approx(c.cost_ms, rel=1e-9), c
    chosen = record.chosen
    assert chosen is not None and chosen.instance_id == sel.instance_id
    assert sum(getattr(chosen, t) for t in TERMS) == pytest.approx(sel.cost, rel=1e-9)
    # every term is exercised by some candidate
    for t in ("queued_prefill_ms", "prefill_ms", "decode_ms", "busy_ms", "interference_ms", "decode_growth_ms"):
        assert any(getattr(c, t) > 0 for c in record.candidates), t


def test_sampling_does_not_change_the_choices_and_off_records_nothing() -> None:
    choices = {}
    for sample in (0.0, 1.0):
        log = DecisionLog(sample=sample, capacity=1000)
        s = sched(log, seed=7, router_temperature=0.5)
        for wid in range(1, 6):
            join(s, wid, prefill=0, running=0)
        choices[sample] = [s._select(request(i, 100), i).instance_id for i in range(50)]
        assert (len(log.get("q3")) == 1) is (sample == 1.0)
    assert choices[0.0] == choices[1.0]


def test_a_comparison_mode_records_its_choice_without_costs() -> None:
    log = DecisionLog(sample=1.0, capacity=4)
    s = sched(log, mode=RoutingMode.ROUND_ROBIN)
    join(s, 1, prefill=0, running=0)
    sel = s._select(request(1, 40), 0)
    (record,) = log.get("q1")
    assert record.why == [Why.MODE.value] and record.instance_id == sel.instance_id and record.candidates == []


def test_the_log_is_bounded_and_finishes_a_record_once() -> None:
    log = DecisionLog(sample=1.0, capacity=2)

    def rec(rid: str) -> DecisionRecord:
        return DecisionRecord(request_id=rid, model="m", at=0.0, pool="aggregated", mode="kv", why=[],
                              instance_id=5, dp_rank=0, cost_ms=1.0, prompt_tokens=1, candidates_total=1)

    for rid in ("a", "b", "c"):
        log.add(rec(rid))
    assert log.get("a") == [] and len(log.get("c")) == 1
    done = log.finish("c", 5, ttft_ms=12.5, cached_tokens=32, status="200")
    assert done is not None and done.measured_ttft_ms == 12.5 and done.reported_cached_tokens == 32
    assert log.finish("c", 5, ttft_ms=1.0, cached_tokens=0, status="200") is None
    assert log.finish("c", 6, ttft_ms=1.0, cached_tokens=0, status="200") is None
