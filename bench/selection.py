"""Selection time of the router's scheduler at 8..4096 workers (DESIGN §5; issue 3 "Speed").

Measures, for the block cost (``kv-blocks``) and the predicted-time cost (``kv-time``), the
scheduler's handling of one ``SelectWorker`` (prefix-index overlap query, cost of every
candidate, pick, booking, the chosen worker's TTFT prediction) with a populated index, 4096-token
prompts and 64-token blocks, at router
temperature 0 and 0.7. Hashing the prompt (done on the HTTP side, outside the actor) is measured
separately. No network: the pure core is driven through the actor's dispatch directly.

Pools of ``VECTOR_MIN_CANDIDATES`` ranks or more take the numpy path (each cost's vectorised form
over router.loadvec's columns), smaller ones the Python loop (its scalar form; router.cost); each
case records which (``path``). Each request is freed
before the next (the booked-shared-blocks scan then has nothing to scan), except in the cases
with requests in flight (4 per worker), which keep their bookings while later requests select.

    python bench/selection.py            # prints a table, writes bench/results/selection.json
    python bench/selection.py --rounds 5 # more rounds (each case: its median round by p50)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controlplane.protocol.events import (
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
from controlplane.protocol.signing import Keyring
from router.choose import VECTOR_MIN_CANDIDATES
from router.commands import ApplyKvEvents, ApplyMembership, LoadKvDump, RequestDone, RoutingRequest, SelectWorker
from router.scheduler import Scheduler
from router.settings import RoutingMode

BLOCK = 64
PROMPT = 4096
PREFIXES = 32
MODEL = "bench-model"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def build(n_workers: int, temperature: float, rng: random.Random,
          mode: RoutingMode = RoutingMode.KV_BLOCKS) -> tuple[Scheduler, list[list[int]]]:
    now = datetime.now(UTC)
    startup = {k: startup_values(k) for k in PolicyKind}
    startup[PolicyKind.SELECTION]["router_temperature"] = temperature
    s = Scheduler(
        router_id="bench", models=[MODEL], role=RouterRole.AGGREGATED, mode=mode,
        kv_events=True, cache_inputs=ALL_CACHE_INPUTS, startup=startup, worker_ttl_s=1e9,
        worker_stale_s=1e9, wall=lambda: now, rng=rng,
        keyring=Keyring({}),  # selections only: no policy event is applied here
    )
    prefixes = [[rng.randrange(256) for _ in range(PROMPT)] for _ in range(PREFIXES)]
    prefix_blocks = [block_hashes(p, BLOCK) for p in prefixes]
    for wid in range(1, n_workers + 1):
        rec = WorkerRecord(instance_id=wid, model=MODEL, url=f"http://w{wid}", block_size=BLOCK,
                           kv_total_blocks=16384, max_num_batched_tokens=8192, started_at=now)
        load = [RankLoad(active_decode_blocks=rng.randrange(2000),
                         active_prefill_tokens=rng.randrange(8192), running=rng.randrange(64))]
        s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=rec, load=load, at=now)))
        s._dispatch(LoadKvDump(wid, None))  # no dump in the bench: start from events
        # Each worker caches a random leading part of 3 random prefixes.
        for eid, p in enumerate(rng.sample(range(PREFIXES), 3)):
            n = rng.randrange(1, len(prefix_blocks[p]) + 1)
            blocks = [StoredBlock(block_hash=c, tokens_hash=b) for c, b in prefix_blocks[p][:n]]
            s._dispatch(ApplyKvEvents([KvEvent(instance_id=wid, event_id=eid, data=KvStored(blocks=blocks))]))
    return s, prefixes


def run_case(n_workers: int, temperature: float, iters: int,
             mode: RoutingMode = RoutingMode.KV_BLOCKS, in_flight: int = 0) -> dict[str, Any]:
    rng = random.Random(n_workers * 10 + int(temperature * 10))
    s, prefixes = build(n_workers, temperature, rng, mode)
    times: list[float] = []
    hash_times: list[float] = []
    open_ids: list[str] = []
    for i in range(iters):
        base = prefixes[rng.randrange(PREFIXES)]
        cut = rng.randrange(PROMPT // 2, PROMPT)
        tokens = base[:cut] + [rng.randrange(256) for _ in range(PROMPT - cut)]
        t0 = time.perf_counter()
        hashes = chain_hashes(tokens, BLOCK)
        t1 = time.perf_counter()
        hash_times.append(t1 - t0)
        req = RoutingRequest(request_id=f"r{i}", model=MODEL, prompt_tokens=PROMPT, hashes={BLOCK: hashes})
        t2 = time.perf_counter()
        s._dispatch(SelectWorker(req, seq=i))
        times.append(time.perf_counter() - t2)
        open_ids.append(f"r{i}")
        while len(open_ids) > in_flight:  # the oldest request finishes
            s._dispatch(RequestDone(open_ids.pop(0)))
    return {
        "mode": mode.value, "workers": n_workers, "temperature": temperature, "iterations": iters,
        "in_flight": in_flight,
        "path": "numpy" if n_workers >= VECTOR_MIN_CANDIDATES else "loop",
        "select_p50_us": pct(times, 0.5) * 1e6, "select_p99_us": pct(times, 0.99) * 1e6,
        "select_mean_us": statistics.fmean(times) * 1e6,
        "hash_p50_us": pct(hash_times, 0.5) * 1e6, "hash_p99_us": pct(hash_times, 0.99) * 1e6,
        "index_blocks": len(s.index),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of every case, interleaved; each case reports its median round by p50")
    args = ap.parse_args()
    specs: list[tuple[RoutingMode, int, float, int, int]] = []
    for mode in (RoutingMode.KV_BLOCKS, RoutingMode.KV_TIME):
        for n, iters in ((8, 3000), (64, 3000), (512, 1500), (4096, 400)):
            for t in (0.0, 0.7):
                specs.append((mode, n, t, iters, 0))
        # Under load: 4 requests in flight per worker (their bookings stay while others select).
        specs.append((mode, 64, 0.0, 3000, 256))
    runs: dict[tuple[RoutingMode, int, float, int, int], list[dict[str, Any]]] = {spec: [] for spec in specs}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for spec in specs:
            mode, n, t, iters, in_flight = spec
            runs[spec].append(run_case(n, t, iters, mode, in_flight=in_flight))
    cases = []
    for spec in specs:
        ordered = sorted(runs[spec], key=lambda c: c["select_p50_us"])
        case = dict(ordered[len(ordered) // 2])
        case["rounds_p50_us"] = [c["select_p50_us"] for c in runs[spec]]
        cases.append(case)
    print(f"{'mode':>10} {'workers':>8} {'T':>4} {'path':>6} {'in flight':>9} {'p50 µs':>9} {'p99 µs':>9} "
          f"{'hash p50 µs':>12} {'hash p99 µs':>12} {'blocks':>8}")
    for c in cases:
        print(f"{c['mode']:>10} {c['workers']:>8} {c['temperature']:>4} {c['path']:>6} {c['in_flight']:>9} "
              f"{c['select_p50_us']:>9.1f} "
              f"{c['select_p99_us']:>9.1f} {c['hash_p50_us']:>12.1f} {c['hash_p99_us']:>12.1f} "
              f"{c['index_blocks']:>8}")
    out = {
        "benchmark": "selection", "prompt_tokens": PROMPT, "block_size": BLOCK,
        "python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
        "vector_min_candidates": VECTOR_MIN_CANDIDATES, "rounds": args.rounds,
        "at": datetime.now(UTC).isoformat(), "cases": cases,
    }
    path = Path(__file__).parent / "results" / "selection.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
