"""The scheduler with the predicted-time cost (mode kv-time): heterogeneous workers, TTFT
objectives, calibration fed through the actor's commands. No network (DESIGN §5, issue 9)."""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from datetime import UTC, datetime

import pytest

from controlplane.protocol.errors import Overloaded
from controlplane.protocol.events import (
    EngineTiming,
    KvEvent,
    KvStored,
    MembershipEvent,
    MembershipOp,
    RankLoad,
    RouterRole,
    StoredBlock,
    WorkerRecord,
)
from controlplane.protocol.hashing import block_hashes, chain_hashes
from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
from router.calibration import Calibration
from router.commands import (
    ApplyKvEvents,
    ApplyMembership,
    ApplyPolicy,
    LoadKvDump,
    RequestDone,
    RequestFirstToken,
    RoutingRequest,
    SelectWorker,
)
from router.cost.time import DEFAULT_TIMING
from router.scheduler import Scheduler
from router.settings import RoutingMode
from tests.policy_keys import session_keys

NOW = datetime.now(UTC)
BLOCK = 64


def timing(speedup: float) -> EngineTiming:
    t = DEFAULT_TIMING
    return EngineTiming(prefill_ms=(t.p0 / speedup, t.p1 / speedup, t.p2 / speedup),
                        decode_ms=(t.d0 / speedup, t.d1 / speedup, t.d2 / speedup),
                        decode_min_ms=t.decode_min_ms / speedup)


def sched(mode: RoutingMode = RoutingMode.KV_TIME, **selection: float) -> Scheduler:
    startup = {k: startup_values(k) for k in PolicyKind}
    startup[PolicyKind.SELECTION].update(selection)
    return Scheduler(
        router_id="r-t", models=["m"], role=RouterRole.AGGREGATED, mode=mode, kv_events=True,
        cache_inputs=ALL_CACHE_INPUTS, startup=startup, worker_ttl_s=1e9, worker_stale_s=1e9,
        clock=lambda: 1000.0, wall=lambda: NOW, rng=random.Random(1), keyring=session_keys().keyring,
    )


def signed(payload: bytes) -> tuple[bytes, dict[str, str]]:
    """A policy event as the control plane publishes it: signed (routers verify every event)."""
    return payload, session_keys().headers_for("m", PolicyKind.SELECTION, payload)


def join(s: Scheduler, wid: int, *, speedup: float | None = 1.0, prefill: int = 0, running: int = 0,
         op: MembershipOp = MembershipOp.JOIN) -> None:
    rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", block_size=BLOCK,
                       kv_total_blocks=16384, max_num_batched_tokens=8192, started_at=NOW,
                       timing=None if speedup is None else timing(speedup))
    load = [RankLoad(active_prefill_tokens=prefill, running=running, active_decode_blocks=running * 50)]
    s._dispatch(ApplyMembership(MembershipEvent(op=op, worker=rec, load=load, at=NOW)))
    s._dispatch(LoadKvDump(wid, None, final=True))


def req(i: int, tokens: list[int], **kw: object) -> RoutingRequest:
    return RoutingRequest(request_id=f"q{i}", model="m", prompt_tokens=len(tokens),
                          hashes={BLOCK: chain_hashes(tokens, BLOCK)}, **kw)  # type: ignore[arg-type]


def policy(doc: dict[str, float], expected: int) -> bytes:
    return json.dumps({
        "event_id": str(uuid.uuid4()), "model": "m", "kind": "selection", "op": "patch",
        "expected_revision": expected, "changes": doc, "document": doc, "actor": "t",
        "request_id": "q", "at": NOW.isoformat(),
    }).encode()


def test_a_worker_twice_as_slow_gets_about_half_the_prefill_work() -> None:
    """No setting: the advertised timing models alone split the work (each request holds its
    prefill until its first token, so queued work builds up as it would under load)."""
    s = sched()
    for wid, speedup in ((1, 1.0), (2, 1.0), (3, 0.5), (4, 0.5)):
        join(s, wid, speedup=speedup)
    rng = random.Random(2)
    work: Counter[int] = Counter()
    open_ids: list[str] = []
    for i in range(400):
        tokens = [rng.randrange(256) for _ in range(rng.randrange(500, 3000))]
        sel = s._dispatch(SelectWorker(req(i, tokens), seq=i))
        work[sel.instance_id] += len(tokens)
        open_ids.append(sel.request_id)
        if len(open_ids) > 12:  # a bounded number in prefill at once
            done = open_ids.pop(0)
            s._dispatch(RequestFirstToken(done))
            s._dispatch(RequestDone(done))
    fast, slow = work[1] + work[2], work[3] + work[4]
    assert 1.6 < fast / slow < 2.5, (fast, slow)


def test_cached_prefix_wins_over_an_idle_worker_until_the_queue_costs_more() -> None:
    s = sched()
    join(s, 1)
    join(s, 2)
    tokens = list(range(256)) * 16  # 4096 tokens
    chain = block_hashes(tokens, BLOCK)
    s._dispatch(ApplyKvEvents([KvEvent(instance_id=1, event_id=0, data=KvStored(
        blocks=[StoredBlock(block_hash=c, tokens_hash=b) for c, b in chain]))]))
    sel = s._dispatch(SelectWorker(req(1, tokens), seq=1))
    assert sel.instance_id == 1 and sel.cached_tokens == 4032
    assert sel.predicted_ttft_ms == pytest.approx(DEFAULT_TIMING.prefill_step_ms(64))
    s._dispatch(RequestDone("q1"))
    # Worker 1 now has 30k tokens queued: recomputing 4096 on the idle one is quicker.
    join(s, 1, prefill=30_000, op=MembershipOp.HEARTBEAT)
    assert s._dispatch(SelectWorker(req(2, tokens), seq=2)).instance_id == 2


def test_objective_only_the_least_loaded_meets_goes_there() -> None:
    s = sched()
    join(s, 1, prefill=20_000)
    join(s, 2, prefill=4_000)
    join(s, 3, prefill=12_000)
    tokens = [7] * 1000
    # Predicted: worker 2 ≈ 100 ms; the others ≥ 250 ms. An objective of 150 ms: only 2.
    for i in range(20):
        sel = s._dispatch(SelectWorker(req(i, tokens, ttft_slo_ms=150.0), seq=i))
        assert sel.instance_id == 2 and sel.slo_predicted_met is True
        s._dispatch(RequestDone(f"q{i}"))
    assert s.chooser.slo["m"]["predicted_met"] == 20


def test_objective_prefers_the_most_cache_reuse_among_those_that_meet_it() -> None:
    s = sched()
    join(s, 1)
    join(s, 2, prefill=1000)
    tokens = list(range(200)) * 10
    chain = block_hashes(tokens, BLOCK)
    s._dispatch(ApplyKvEvents([KvEvent(instance_id=2, event_id=0, data=KvStored(
        blocks=[StoredBlock(block_hash=c, tokens_hash=b) for c, b in chain[:10]]))]))
    # Both meet a loose objective; worker 2 holds 10 blocks: consolidate there.
    assert s._dispatch(SelectWorker(req(1, tokens, ttft_slo_ms=10_000.0), seq=1)).instance_id == 2


def test_impossible_objective_is_refused_or_best_effort_as_the_policy_says() -> None:
    s = sched()
    join(s, 1, prefill=5000)
    join(s, 2)
    tokens = [3] * 2000
    best_effort = s._dispatch(SelectWorker(req(1, tokens, ttft_slo_ms=1.0), seq=1))
    assert best_effort.instance_id == 2 and best_effort.slo_predicted_met is False
    ack = s._dispatch(ApplyPolicy("m", PolicyKind.SELECTION, 5, *signed(policy({"ttft_slo_reject": 1}, 0))))
    assert ack.result.outcome.value == "ACK"
    with pytest.raises(Overloaded, match="TTFT objective of 1 ms"):
        s._dispatch(SelectWorker(req(2, tokens, ttft_slo_ms=1.0), seq=2))
    assert s.chooser.slo["m"]["rejected"] == 1
    # Without an objective nothing changes.
    assert s._dispatch(SelectWorker(req(3, tokens), seq=3)).instance_id == 2


def test_first_tokens_feed_the_workers_fit_and_the_epoch_resets_it() -> None:
    s = sched(calibration_min_samples=8)
    join(s, 1, speedup=1.0)  # advertises the default; really runs 3x slower
    rng = random.Random(4)
    for i in range(40):
        tokens = [rng.randrange(256) for _ in range(rng.randrange(200, 6000))]
        sel = s._dispatch(SelectWorker(req(i, tokens), seq=i))
        measured = 3 * DEFAULT_TIMING.prefill_ms(len(tokens), 8192)[0]
        s._dispatch(RequestFirstToken(sel.booking_id, ttft_ms=measured))
        s._dispatch(RequestDone(sel.booking_id))
    cal: Calibration = s.calibration[1]
    assert cal.prefill_fitted
    assert cal.timing.prefill_ms(3000, 8192)[0] == pytest.approx(3 * DEFAULT_TIMING.prefill_ms(3000, 8192)[0], rel=0.05)
    # The slots score with the fitted model.
    assert s._slots["m"][(1, 0)].timing == cal.timing
    (status,) = s.calibration_status()
    assert status.prefill_fitted and status.prefill_samples == 40 and status.ttft_mae_ms is not None
    ack = s._dispatch(ApplyPolicy("m", PolicyKind.SELECTION, 9, *signed(policy({"calibration_epoch": 1}, 0))))
    assert ack.result.outcome.value == "ACK"
    assert not s.calibration[1].prefill_fitted and s._slots["m"][(1, 0)].timing == cal.prior


def test_a_worker_without_timing_gets_the_default_prior() -> None:
    s = sched()
    join(s, 1, speedup=None)
    assert s.calibration[1].prior == DEFAULT_TIMING
    join(s, 2, speedup=0.5)
    assert s.calibration[2].prior.p1 == pytest.approx(2 * DEFAULT_TIMING.p1)


def test_objective_parsing_names_the_field() -> None:
    from controlplane.protocol.errors import InvalidRequest
    from router.targets import parse_ttft_slo

    assert parse_ttft_slo(None, {}) is None
    assert parse_ttft_slo({"ttft_slo_ms": 250}, {}) == 250.0
    assert parse_ttft_slo({"ttft_slo_ms": 250}, {"x-rudder-ttft-slo-ms": "90.5"}) == 90.5
    for nvext, headers, field in (({"ttft_slo_ms": "fast"}, {}, "nvext.ttft_slo_ms"),
                                  ({"ttft_slo_ms": 0}, {}, "nvext.ttft_slo_ms"),
                                  ({"ttft_slo_ms": True}, {}, "nvext.ttft_slo_ms"),
                                  (None, {"x-rudder-ttft-slo-ms": "nan"}, "x-rudder-ttft-slo-ms"),
                                  (None, {"x-rudder-ttft-slo-ms": "soon"}, "x-rudder-ttft-slo-ms")):
        with pytest.raises(InvalidRequest) as err:
            parse_ttft_slo(nvext, headers)
        assert err.value.field == field


def score(s: Scheduler, r: RoutingRequest) -> list[float]:
    """The cost of each eligible rank of model m's pool, as the scheduler scores a selection."""
    table = s.tables.table("m", s.pool)
    cost: list[float] = s.chooser.score(r, table, s.pool, s.params("m"), s.timings.decode_tokens["m"].value).cost
    return cost


def test_a_long_prefill_goes_where_no_session_is_expected_back_a_returning_turn_stays_on_its_cache() -> None:
    """Two idle workers; four sessions finished a turn on worker 1 and have not come back yet
    (router.returns). A long uncached prompt there would hold up their returns for its whole
    prefill (λ·D·(ahead + D/2)), so it goes to worker 2; with the term off it is a tie. A session's
    next turn still goes to its cache holder, and closes its entry at its first token: worker 1
    expects less."""
    clock = [1000.0]
    s = sched()
    s.clock = s.tables.clock = lambda: clock[0]
    join(s, 1)
    join(s, 2)
    rng = random.Random(4)
    histories = [[rng.randrange(256) for _ in range(BLOCK * 20)] for _ in range(4)]
    s._dispatch(ApplyKvEvents([KvEvent(instance_id=1, event_id=0, data=KvStored(blocks=[
        StoredBlock(block_hash=c, tokens_hash=b) for h in histories for c, b in block_hashes(h, BLOCK)]))]))
    turns = [[*h, *range(BLOCK + i)] for i, h in enumerate(histories)]
    for i, prompt in enumerate(turns):  # each session's turn, on its cache, finished
        sel = s._dispatch(SelectWorker(req(i, prompt), seq=i))
        assert sel.instance_id == 1
        s._dispatch(RequestDone(sel.booking_id))
        clock[0] += 0.5
    slot1, slot2 = s._slots["m"][(1, 0)], s._slots["m"][(2, 0)]
    assert len(s.tables.returns) == 4
    assert slot1.arrival_rate > 0.0 == slot2.arrival_rate
    long_prompt = [rng.randrange(256) for _ in range(6000)]
    costs = score(s, req(100, long_prompt))
    assert costs[0] > costs[1]  # the wait it would cause at worker 1
    assert s._dispatch(SelectWorker(req(100, long_prompt), seq=100)).instance_id == 2
    s._dispatch(RequestDone("q100"))
    # A request's commands re-read its slot when the slots are next read (Scheduler._slots).
    before = s._slots["m"][(1, 0)].arrival_rate
    # Session 0 comes back: its previous prompt, the answer, a new question.
    back = s._dispatch(SelectWorker(req(101, [*turns[0], *range(40), *range(90)]), seq=101))
    assert back.instance_id == 1
    s._dispatch(RequestFirstToken(back.booking_id))  # where a return is matched
    assert len(s.tables.returns) == 4  # session 0's entry closed, the long prompt's opened
    assert 0.0 < s._slots["m"][(1, 0)].arrival_rate < before
    # Without the term the two idle workers cost the same for the long prompt.
    off = sched(arrival_wait_weight=0.0)
    off.clock = off.tables.clock = lambda: clock[0]
    join(off, 1)
    join(off, 2)
    for i, prompt in enumerate(turns):
        off._dispatch(RequestDone(off._dispatch(SelectWorker(req(i, prompt), seq=i)).booking_id))
    assert off._slots["m"][(1, 0)].arrival_rate > 0.0 or off._slots["m"][(2, 0)].arrival_rate > 0.0
    a, b = score(off, req(102, long_prompt))
    assert a == b


def test_booked_shared_blocks_are_counted_as_the_naive_count() -> None:
    """The leading-run count of a request's blocks booked on each rank equals counting every one
    (bookings hold whole prompts' chain hashes: a booked block implies its whole prefix)."""
    s = sched(mode=RoutingMode.KV_BLOCKS)
    for wid in (1, 2, 3):
        join(s, wid)
    rng = random.Random(8)
    stems = [[rng.randrange(256) for _ in range(BLOCK * 12)] for _ in range(3)]

    def prompt() -> list[int]:
        stem = rng.choice(stems)
        tail = [rng.randrange(256) for _ in range(rng.randrange(1, 3 * BLOCK))]
        return [*stem[: BLOCK * rng.randrange(0, 13)], *tail]

    for i in range(60):
        s._dispatch(SelectWorker(req(i, prompt()), seq=i))
        if i % 5 == 4:
            s._dispatch(RequestDone(f"q{rng.randrange(i)}"))
    table = s.tables.table("m", s.pool)
    shared_seen = 0
    for j in range(40):
        r = req(1000 + j, prompt())
        got = s.tables.booked_shared(r.hashes, table)
        want = {}
        for key in s.bookings.keys():
            rank = s.bookings.rank(key)
            assert rank is not None
            want[key] = sum(1 for h in r.hashes[BLOCK] if h in rank.blocks)
        assert got == want
        shared_seen += sum(got.values())
    assert shared_seen > 0


def test_a_delay_all_workers_see_takes_no_claimed_prior_but_a_liar_among_them_loses_its() -> None:
    """A loaded host (HTTP stacks, event loops) adds the same 30 ms to every first token, far past
    what two honest fast workers' priors predict and past the slack: it is not a lie, and both
    keep their priors (before decision 108 both lost them). A third worker claiming to be 100x
    faster than it is, on the same host, is still caught, and only it."""
    s = sched()
    s.timing_outcomes.persist_s = 0.0  # this clock stands still (the persistence: test_router_claims)
    join(s, 1, speedup=10.0)
    join(s, 2, speedup=10.0)
    shared_ms = 30.0
    rng = random.Random(8)

    def answer(i: int, n_tokens: int, really: dict[int, float]) -> int:
        tokens = [rng.randrange(256) for _ in range(n_tokens)]
        sel = s._dispatch(SelectWorker(req(i, tokens), seq=i))
        real = DEFAULT_TIMING.prefill_ms(len(tokens), 8192)[0] / really[sel.instance_id]
        s._dispatch(RequestFirstToken(sel.booking_id, ttft_ms=real + shared_ms))
        s._dispatch(RequestDone(sel.booking_id))
        return sel.instance_id

    chosen = {answer(i, 100, {1: 10.0, 2: 10.0}) for i in range(60)}
    assert chosen == {1, 2}
    assert s.timing_outcomes.quarantined == set()
    join(s, 3, speedup=100.0)  # runs at 1x
    for i in range(60, 160):
        answer(i, 3000, {1: 10.0, 2: 10.0, 3: 1.0})
        if s.timing_outcomes.quarantined:
            break
    assert s.timing_outcomes.quarantined == {3}
    assert s.calibration[3].prior == DEFAULT_TIMING and s.calibration[1].prior != DEFAULT_TIMING
