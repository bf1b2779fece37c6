"""The block cost, temperature sampling and tie-breaking of DESIGN §5, in both forms of the block
cost (router.cost.blocks): the Python loop and the numpy columns of a load table (router.loadvec) used
for large pools, checked against each other bit for bit and against a plain reading of the formula;
the comparison modes (router.choose); and the prefix index query."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from datetime import UTC, datetime

import numpy as np
import pytest

import router.choose as choose_mod
from controlplane.protocol.events import (
    KvEvent,
    KvRemoved,
    KvStored,
    MembershipEvent,
    MembershipOp,
    RankLoad,
    RouterRole,
    StoredBlock,
    WorkerRecord,
)
from controlplane.protocol.policy import ALL_CACHE_INPUTS, CacheInput, PolicyKind, startup_values
from router.choose import RoundRobin, least_loaded
from router.commands import (
    ApplyKvEvents,
    ApplyMembership,
    LoadKvDump,
    RequestDone,
    RequestFirstToken,
    RoutingRequest,
    SelectWorker,
)
from router.cost.blocks import costs, vector_costs
from router.cost.common import (
    NO_OVERLAP,
    Candidate,
    Overlap,
    SelectionParams,
    pick,
    pick_index,
    probabilities,
)
from router.index import PrefixIndex
from router.loadvec import LoadTable
from router.scheduler import Scheduler
from router.settings import RoutingMode
from tests.policy_keys import session_keys


def _cand(i: int, *, decode: int, device: int = 0, prefill: int = 0, requests: int = 0) -> Candidate:
    return Candidate(i, 0, 16, prefill, decode, requests, Overlap(device=device))


def test_worked_example_costs_18_10_11_picks_the_second() -> None:
    # credit 1.0, raw prefill 10 blocks each (P = 160 tokens, B = 16), overlaps 2/5/8,
    # decode blocks 10/5/9 → costs 18/10/11 → the second worker.
    cands = [_cand(1, decode=10, device=2), _cand(2, decode=5, device=5), _cand(3, decode=9, device=8)]
    params = SelectionParams(overlap_score_credit=1.0)
    c = costs(cands, params, 160)
    assert c == [18.0, 10.0, 11.0]
    assert pick(c, 0.0, random.Random(0)) == 1


def test_request_blocks_are_added_to_decode_blocks_less_shared_bookings() -> None:
    cands = [_cand(1, decode=10), _cand(2, decode=10)]
    c = costs(cands, SelectionParams(), 160, request_blocks={16: 10}, booked_shared={(2, 0): 4})
    assert c == [30.0, 26.0]


def test_credit_decay_shrinks_credit_of_loaded_workers() -> None:
    params = SelectionParams(overlap_score_credit=1.0, overlap_score_credit_decay=1.0)
    # Worker 2 has 160 more active prefill tokens (10 blocks) than the least; R = 10 →
    # decay = 1 / (1 + 1·10/10) = 0.5 → its credit of 8 blocks counts 4.
    cands = [_cand(1, decode=0), _cand(2, decode=0, device=8, prefill=160)]
    c = costs(cands, params, 160)
    assert c[0] == 10.0
    assert c[1] == pytest.approx((160 + 160) / 16 - 4)


def test_cache_tier_weights_and_load_scale() -> None:
    params = SelectionParams(
        overlap_score_credit=1.0, host_cache_hit_weight=0.5, disk_cache_hit_weight=0.25,
        shared_cache_multiplier=0.1, prefill_load_scale=2.0, decode_active_request_weight=3.0,
    )
    cand = Candidate(1, 0, 16, 0, 1, 2, Overlap(device=1, host=2, disk=4, shared=10))
    # credit = 1 + 1 + 1 + 1 = 4; prefill = 10 - 4 = 6; cost = 2·6 + 1 + 3·2
    assert costs([cand], params, 160) == [19.0]


def test_prefill_term_is_never_negative() -> None:
    cand = Candidate(1, 0, 16, 0, 3, 0, Overlap(device=50))
    assert costs([cand], SelectionParams(), 160) == [3.0]


def test_ties_at_temperature_zero_are_broken_uniformly() -> None:
    rng = random.Random(7)
    counts = Counter(pick([5.0, 3.0, 3.0, 3.0, 9.0], 0.0, rng) for _ in range(30_000))
    assert set(counts) == {1, 2, 3}
    for i in (1, 2, 3):
        assert counts[i] == pytest.approx(10_000, rel=0.05)


def test_temperature_sampling_matches_the_boltzmann_distribution() -> None:
    cost = [10.0, 12.0, 15.0, 20.0]
    t = 0.7
    expected = [math.exp(-(c - 10.0) / (10.0 * t)) for c in cost]
    total = sum(expected)
    expected = [e / total for e in expected]
    assert probabilities(cost, t) == pytest.approx(expected)
    rng = random.Random(12345)
    n = 40_000
    counts = Counter(pick(cost, t, rng) for _ in range(n))
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(expected))
    assert chi2 < 16.27  # χ²(3 dof) at p = 0.001
    # and it is not the argmin-only distribution
    assert counts[3] > 0.05 * n


def test_temperature_with_equal_costs_is_uniform() -> None:
    rng = random.Random(3)
    counts = Counter(pick([4.0, 4.0, 4.0], 2.0, rng) for _ in range(30_000))
    for i in range(3):
        assert counts[i] == pytest.approx(10_000, rel=0.05)


def test_pick_empty_raises() -> None:
    with pytest.raises(ValueError):
        pick([], 0.0, random.Random())


def test_params_from_values_falls_back_to_defaults() -> None:
    p = SelectionParams.from_values({"router_temperature": 0.5, "host_cache_hit_weight": None})
    assert p.router_temperature == 0.5
    assert p.host_cache_hit_weight == 0.75


def test_round_robin_cycles_by_instance_id() -> None:
    cands = [_cand(3, decode=0), _cand(1, decode=0), _cand(2, decode=0)]
    rr = RoundRobin()
    chosen = [cands[rr.pick(cands)].instance_id for _ in range(6)]
    assert chosen == [1, 2, 3, 1, 2, 3]


def test_least_loaded_ignores_cache() -> None:
    cands = [_cand(1, decode=5, device=100), _cand(2, decode=4)]
    assert least_loaded(cands, random.Random(0)) == 1


# -- the vectorised form (router.cost.blocks over router.loadvec's columns) against a plain reading of DESIGN §5



def reference_costs(
    cands: list[Candidate], params: SelectionParams, p: int, overlaps: dict[tuple[int, int], Overlap],
    booked_shared: dict[tuple[int, int], int],
) -> list[float]:
    """DESIGN §5 read literally, one candidate at a time, request blocks R = ⌈P/B⌉ added to the
    decode blocks less those already booked on the rank."""
    least = min(c.active_prefill_tokens for c in cands)
    out = []
    for c in cands:
        b = c.block_size
        r = max(1, math.ceil(p / b))
        ov = overlaps.get(c.key, NO_OVERLAP)
        excess = (c.active_prefill_tokens - least) / b
        decay = 1 / (1 + params.overlap_score_credit_decay * excess / r)
        credit = (
            params.overlap_score_credit * decay * ov.device + params.host_cache_hit_weight * ov.host
            + params.disk_cache_hit_weight * ov.disk + params.shared_cache_multiplier * ov.shared
        )
        decode_blocks = c.decode_blocks + r - booked_shared.get(c.key, 0)
        out.append(
            params.prefill_load_scale * max((c.active_prefill_tokens + p) / b - credit, 0)
            + decode_blocks + params.decode_active_request_weight * c.active_requests
        )
    return out


def _eligible(c: Candidate) -> bool:
    return c.active_requests != 13  # an arbitrary rule, to exercise ineligible rows


def _random_fleet(rng: random.Random, n: int, sizes: tuple[int, ...]) -> tuple[
    list[Candidate], SelectionParams, int, dict[tuple[int, int], Overlap], dict[tuple[int, int], int]
]:
    cands = [
        Candidate(rng.randrange(1, 2**64), rng.randrange(4), rng.choice(sizes), rng.randrange(0, 9000),
                  rng.randrange(0, 3000), rng.randrange(0, 20))
        for _ in range(n)
    ]
    params = SelectionParams(
        overlap_score_credit=rng.choice([1.0, 0.5, 1.7]),
        overlap_score_credit_decay=rng.choice([0.0, 0.0, 0.3, 2.0]),
        prefill_load_scale=rng.choice([1.0, 0.25, 3.0]),
        host_cache_hit_weight=rng.random(), disk_cache_hit_weight=rng.random(),
        shared_cache_multiplier=rng.choice([0.0, 0.4]),
        decode_active_request_weight=rng.choice([0.0, 0.0, 1.5]),
    )
    p = rng.randrange(1, 8192)
    overlaps = {
        c.key: Overlap(rng.randrange(0, 80), rng.randrange(0, 5), rng.randrange(0, 5), rng.randrange(0, 3))
        for c in rng.sample(cands, rng.randrange(0, n + 1))
    }
    overlaps[(1, 99)] = Overlap(7)  # a rank the table does not hold
    shared = {c.key: rng.randrange(0, 10) for c in rng.sample(cands, rng.randrange(0, n // 2 + 1))}
    return cands, params, p, overlaps, shared


@pytest.mark.parametrize("seed", range(60))
def test_vectorised_costs_equal_the_loop_bit_for_bit_and_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    sizes = (16,) if seed % 3 else (16, 32, 64)
    cands, params, p, overlaps, shared = _random_fleet(rng, rng.randrange(1, 300), sizes)
    table: LoadTable[Candidate] = LoadTable(_eligible)
    for c in cands:
        table[c.key] = c
    request_blocks = {b: -(-p // b) for b in sizes}
    rows = table.eligible_rows()
    chosen = cands if rows is None else [cands[i] for i in rows.tolist()]
    assert chosen == [c for c in cands if _eligible(c)]
    if not chosen:
        return
    loop = costs(chosen, params, p, overlaps=overlaps, request_blocks=request_blocks, booked_shared=shared)
    vec = vector_costs(table.columns(rows), params, p, overlaps=overlaps, request_blocks=request_blocks,
                       booked_shared=shared)
    assert vec.tolist() == loop  # exactly: same operations, same order
    ref = reference_costs(chosen, params, p, overlaps, shared)
    assert loop == pytest.approx(ref, rel=1e-12, abs=1e-9)
    # and the choice: same tie list, same draw
    for t in (0.0, 0.7):
        assert pick_index(vec, t, random.Random(seed)) == pick(loop, t, random.Random(seed))


def test_vectorised_worked_example_costs_18_10_11_picks_the_second() -> None:
    cands = [_cand(1, decode=10, device=2), _cand(2, decode=5, device=5), _cand(3, decode=9, device=8)]
    table: LoadTable[Candidate] = LoadTable(lambda c: True)
    for c in cands:
        table[c.key] = c
    overlaps = {c.key: c.overlap for c in cands}
    c = vector_costs(table.columns(table.eligible_rows()), SelectionParams(overlap_score_credit=1.0), 160,
                     overlaps=overlaps)
    assert c.tolist() == [18.0, 10.0, 11.0]
    assert pick_index(c, 0.0, random.Random(0)) == 1


def test_vectorised_ties_at_temperature_zero_are_uniform_and_drawn_like_pick() -> None:
    cost = np.array([5.0, 3.0, 3.0 + 1e-12, 3.0, 9.0])
    rng_a, rng_b = random.Random(7), random.Random(7)
    counts = Counter()
    for _ in range(30_000):
        i = pick_index(cost, 0.0, rng_a)
        assert i == pick(cost.tolist(), 0.0, rng_b)
        counts[i] += 1
    assert set(counts) == {1, 2, 3}
    for i in (1, 2, 3):
        assert counts[i] == pytest.approx(10_000, rel=0.05)


@pytest.mark.parametrize("t", [0.3, 0.7, 2.0])
def test_vectorised_temperature_sampling_matches_the_distribution(t: float) -> None:
    rng = random.Random(99)
    cost = np.array([rng.uniform(10, 20) for _ in range(6)])
    expected = probabilities(cost.tolist(), t)
    c_min, span = cost.min(), cost.max() - cost.min()
    direct = np.exp(-(cost - c_min) / (span * t))
    assert expected == pytest.approx((direct / direct.sum()).tolist())
    n = 60_000
    counts = Counter(pick_index(cost, t, rng) for _ in range(n))
    chi2 = sum((counts[i] - n * q) ** 2 / (n * q) for i, q in enumerate(expected))
    assert chi2 < 20.52  # χ²(5 dof) at p = 0.001
    assert Counter(pick_index(np.array([4.0, 4.0, 4.0]), t, rng) for _ in range(30_000))[2] == pytest.approx(
        10_000, rel=0.05
    )
    with pytest.raises(ValueError):
        pick_index(np.zeros(0), t, rng)


def test_load_table_keeps_columns_in_step_with_the_dict() -> None:
    rng = random.Random(5)
    table: LoadTable[Candidate] = LoadTable(_eligible)
    plain: dict[tuple[int, int], Candidate] = {}
    params = SelectionParams(decode_active_request_weight=0.5)
    for step in range(3000):
        op = rng.random()
        key = (rng.randrange(1, 60), rng.randrange(2))
        if op < 0.4:
            c = Candidate(key[0], key[1], rng.choice((16, 32)), rng.randrange(500), rng.randrange(500),
                          rng.randrange(20))
            if rng.random() < 0.5:
                table[key] = plain[key] = c
            else:
                table.update({key: c})
                plain[key] = c
        elif op < 0.55 and plain:
            key = rng.choice(list(plain))
            if rng.random() < 0.5:
                del table[key]
                del plain[key]
            else:
                assert table.pop(key) is plain.pop(key)
        elif op < 0.6:
            assert table.pop(key, None) is plain.pop(key, None)
        elif op < 0.95 and plain:
            c = plain[rng.choice(list(plain))]
            c.active_prefill_tokens = rng.randrange(500)
            c.active_requests = rng.randrange(20)
            c.touch()
        elif op < 0.96:
            for c in plain.values():
                assert c.table is table
            table.clear()
            for c in plain.values():
                assert c.table is None
            plain.clear()
        assert list(table.items()) == list(plain.items())
        if step % 50 == 0 and plain:
            rows = table.eligible_rows()
            chosen = list(plain.values()) if rows is None else [table.row(i) for i in rows.tolist()]
            assert chosen == [c for c in plain.values() if _eligible(c)]
            if chosen:
                got = vector_costs(table.columns(rows), params, 300, overlaps={}, request_blocks={16: 19, 32: 10})
                assert got.tolist() == costs(chosen, params, 300, overlaps={}, request_blocks={16: 19, 32: 10})
    with pytest.raises(ValueError):
        table[(1, 0)] = Candidate(2, 0, 16, 0, 0, 0)
    with pytest.raises(KeyError):
        del table[(12345, 0)]


def test_load_table_excludes_instances_across_the_u64_range() -> None:
    table: LoadTable[Candidate] = LoadTable(lambda c: True)
    for wid in (2**64 - 1, 7, 2**63):
        table[(wid, 0)] = Candidate(wid, 0, 16, 0, 0, 0)
    rows = table.eligible_rows(frozenset({2**64 - 1, 2**63}))
    assert rows is not None and rows.tolist() == [1]
    assert table.eligible_rows() is None


# -- the prefix index query -------------------------------------------------------------------


def _reference_overlaps(index: PrefixIndex, hashes: list[int]) -> dict[tuple[int, int], Overlap]:
    """Leading run of blocks per rank holding the first, each counted in its fastest tier."""
    best = {1: 0, 2: 1, 4: 2, 8: 3}
    out = {}
    for key in index._holders.get(hashes[0], {}) if hashes else ():
        counts = [0, 0, 0, 0]
        for h in hashes:
            mask = index._holders.get(h, {}).get(key, 0)
            if not mask:
                break
            counts[best[mask & -mask]] += 1
        out[key] = Overlap(*counts)
    return out


@pytest.mark.parametrize("seed", range(25))
def test_index_overlaps_match_a_plain_reference(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex()
    chains = [[rng.getrandbits(64) for _ in range(40)] for _ in range(6)]
    keys = [(w, r) for w in range(1, 30) for r in range(2)]
    tiers = [CacheInput.DEVICE] * 6 + [CacheInput.HOST, CacheInput.DISK, CacheInput.SHARED]
    if seed % 2:
        tiers = [CacheInput.DEVICE]  # device only: the fast path throughout
    for _ in range(200):
        key, chain = rng.choice(keys), rng.choice(chains)
        n = rng.randrange(1, 41)
        if rng.random() < 0.8:
            index.store(key, chain[:n], rng.choice(tiers))
        else:
            index.remove(key, rng.sample(chain, rng.randrange(1, 5)), rng.choice(tiers))
        if rng.random() < 0.02:
            index.clear(rng.choice(keys))
    for chain in chains:
        for cut in (0, 1, 5, 40):
            hashes = [*chain[:cut], rng.getrandbits(64)]
            assert index.overlaps(hashes) == _reference_overlaps(index, hashes)
        assert index.overlaps(chain) == _reference_overlaps(index, chain)
    assert index.overlaps([]) == {}


def _slot_figures(s: Scheduler) -> list[tuple[object, ...]]:
    return [(key, slot.active_prefill_tokens, slot.decode_blocks, slot.active_requests, slot.busy,
             slot.arrival_rate) for key, slot in sorted(s._slots["m"].items())]


def test_an_end_that_carries_its_first_token_is_its_first_token_then_its_end() -> None:
    """``RequestDone(first_token=True, ttft_ms=...)`` (an answer whose first token came in its last
    read, or a non-streamed one) leaves the scheduler as its ``RequestFirstToken`` then its
    ``RequestDone`` do: the same selections after it, the same load on every slot, the same
    bookings and calibration, through returns of earlier requests' prefixes."""
    split, merged = (_fleet_scheduler(0.0, 7, 12, RoutingMode.KV_TIME)[0] for _ in range(2))
    rng = random.Random(7)
    open_ids: list[str] = []
    chains = [[rng.getrandbits(64) for _ in range(6)] for _ in range(4)]  # shared: returns happen
    for i in range(300):
        hashes = [*rng.choice(chains)[: rng.randrange(1, 7)], rng.getrandbits(64)]
        req = RoutingRequest(request_id=f"q{i}", model="m", prompt_tokens=16 * len(hashes) + 3, hashes={16: hashes})
        a, b = split._dispatch(SelectWorker(req, seq=i)), merged._dispatch(SelectWorker(req, seq=i))
        assert (a.instance_id, a.dp_rank, a.cost) == (b.instance_id, b.dp_rank, b.cost)
        open_ids.append(req.request_id)
        if rng.random() < 0.6:
            rid = open_ids.pop(rng.randrange(len(open_ids)))
            ttft = rng.uniform(5.0, 80.0)
            split._dispatch(RequestFirstToken(rid, ttft_ms=ttft))
            split._dispatch(RequestDone(rid, itl_ms=4.0, decode_tokens=9))
            merged._dispatch(RequestDone(rid, itl_ms=4.0, decode_tokens=9, first_token=True, ttft_ms=ttft))
            assert _slot_figures(split) == _slot_figures(merged)
    assert set(split.bookings.keys()) == set(merged.bookings.keys())
    assert sorted(split.in_flight()) == sorted(merged.in_flight())
    assert [c.model_dump() for c in split.calibration_status()] == [c.model_dump() for c in merged.calibration_status()]


# -- the scheduler picks the same worker either way -------------------------------------------


def _fleet_scheduler(
    temperature: float, seed: int, n: int, mode: RoutingMode = RoutingMode.KV_BLOCKS
) -> tuple[Scheduler, list[list[int]]]:
    now = datetime.now(UTC)
    startup = {k: startup_values(k) for k in PolicyKind}
    startup[PolicyKind.SELECTION].update(
        router_temperature=temperature, overlap_score_credit_decay=0.5, decode_active_request_weight=0.25,
    )
    rng = random.Random(seed)
    s = Scheduler(
        router_id="r-eq", models=["m"], role=RouterRole.AGGREGATED, mode=mode, kv_events=True,
        cache_inputs=ALL_CACHE_INPUTS, startup=startup, worker_ttl_s=1e9, worker_stale_s=1e9,
        clock=lambda: 1000.0, wall=lambda: now, rng=random.Random(seed), keyring=session_keys().keyring,
    )
    chains = [[rng.getrandbits(64) for _ in range(12)] for _ in range(5)]
    for wid in range(1, n + 1):
        rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", block_size=16, dp_size=2,
                           kv_total_blocks=4096, max_num_batched_tokens=8192, started_at=now)
        load = [RankLoad(dp_rank=r, active_decode_blocks=rng.randrange(50), active_prefill_tokens=rng.randrange(300),
                         running=rng.randrange(4)) for r in range(2)]
        s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=rec, load=load, at=now)))
        s._dispatch(LoadKvDump(wid, None, final=True))
        eid = itertools.count()
        for chain in rng.sample(chains, 2):
            blocks = [StoredBlock(block_hash=h, tokens_hash=h) for h in chain[: rng.randrange(1, 13)]]
            tier = rng.choice([CacheInput.DEVICE, CacheInput.DEVICE, CacheInput.HOST])
            s._dispatch(ApplyKvEvents([KvEvent(
                instance_id=wid, dp_rank=rng.randrange(2), event_id=next(eid), tier=tier,
                data=KvStored(blocks=blocks))]))
        if wid % 5 == 0:
            s._dispatch(ApplyKvEvents([KvEvent(
                instance_id=wid, event_id=next(eid), data=KvRemoved(block_hashes=chains[0][3:5]))]))
    return s, chains


@pytest.mark.parametrize("mode", [RoutingMode.KV_BLOCKS, RoutingMode.KV_TIME])
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 1), (0.0, 2), (0.7, 3), (1.5, 4)])
def test_scheduler_selects_the_same_with_and_without_numpy(
    temperature: float, seed: int, mode: RoutingMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same fleet, same requests, same random source: the scalar loop and the vectorised path
    choose the same rank at the same cost, through bookings, first tokens, completions, a
    heartbeat that changes load and a worker leaving."""
    scalar, chains = _fleet_scheduler(temperature, seed, 70, mode)
    vector, _ = _fleet_scheduler(temperature, seed, 70, mode)
    rng = random.Random(seed)
    open_ids: list[str] = []
    now = datetime.now(UTC)

    def both(cmd_of: object) -> tuple[object, object]:
        out = []
        for s, threshold in ((scalar, 10**9), (vector, 0)):
            monkeypatch.setattr(choose_mod, "VECTOR_MIN_CANDIDATES", threshold)
            out.append(s._dispatch(cmd_of()))  # type: ignore[operator]
        return out[0], out[1]

    for i in range(400):
        chain = rng.choice(chains)
        hashes = [*chain[: rng.randrange(1, 13)], rng.getrandbits(64)]
        exclude = frozenset({rng.randrange(1, 71)}) if i % 17 == 0 else frozenset()
        req = RoutingRequest(request_id=f"q{i}", model="m", prompt_tokens=16 * len(hashes) + rng.randrange(16),
                             hashes={16: hashes}, exclude=exclude)
        a, b = both(lambda req=req, i=i: SelectWorker(req, seq=i))
        assert (a.instance_id, a.dp_rank, a.overlap_blocks, a.candidates) == (  # type: ignore[attr-defined]
            b.instance_id, b.dp_rank, b.overlap_blocks, b.candidates)  # type: ignore[attr-defined]
        # Bit for bit for the block cost; the time cost's numpy arithmetic may round differently.
        assert a.cost == (b.cost if mode is RoutingMode.KV_BLOCKS else pytest.approx(b.cost))  # type: ignore[attr-defined]
        open_ids.append(req.request_id)
        if rng.random() < 0.5:
            rid = rng.choice(open_ids)
            both(lambda rid=rid: RequestFirstToken(rid))
        if rng.random() < 0.4:
            rid = open_ids.pop(rng.randrange(len(open_ids)))
            both(lambda rid=rid: RequestDone(rid))
        if i % 23 == 0:
            wid = rng.randrange(1, 71)
            rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", block_size=16, dp_size=2,
                               kv_total_blocks=4096, max_num_batched_tokens=8192, started_at=now)
            load = [RankLoad(dp_rank=0, active_decode_blocks=rng.randrange(80), running=rng.randrange(6))]
            op = MembershipOp.LEAVE if i % 115 == 0 else MembershipOp.HEARTBEAT
            both(lambda rec=rec, load=load, op=op: ApplyMembership(
                MembershipEvent(op=op, worker=rec, load=load, at=now)))
