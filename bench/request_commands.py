"""A request's scheduler work, alone: its selection, first token and end, as a router under the
closed-loop load of ``bench/proxy_overhead.py`` sends them (issue 16; docs/decisions.md 127).

One worker, one 124-token prompt (``--prompts`` for more sessions), 32 requests in flight: each
request is selected through ``Scheduler.select_now``, and the one selected 32 requests earlier
gets its first token and its end through ``Scheduler.send``, on a running actor with its fits in
the background (as ``rudder serve router`` runs it). No network, no HTTP: what the actor's part of
a proxied request costs, which on this shared machine the end-to-end bench cannot tell from its
noise when a change is worth a few percent.

Two measures per tree: the wall time of each command (mean µs; noisy), and with ``--callgrind``
the instructions per request counted by valgrind (the difference between a run of ``3 N`` and one
of ``N`` requests, so start-up and imports cancel out): the same count for the same code whatever
else the machine does. ``--baseline DIR`` runs the same measurement on another checkout's code.

    python bench/request_commands.py                       # table, bench/results/request_commands.json
    python bench/request_commands.py --callgrind --baseline /path/to/other/checkout
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
BLOCK = 64
PROMPT_TOKENS = 124
MODEL = "bench-model"


async def measure(mode: str, requests: int, in_flight: int, prompts: int) -> dict[str, float]:
    """Mean µs of each command over ``requests`` requests (the first 1,000 warm up)."""
    from controlplane.protocol.events import MembershipEvent, MembershipOp, RankLoad, RouterRole, WorkerRecord
    from controlplane.protocol.hashing import chain_hashes
    from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
    from controlplane.protocol.signing import Keyring
    from router.commands import ApplyMembership, LoadKvDump, RequestDone, RequestFirstToken, RoutingRequest
    from router.scheduler import Scheduler
    from router.settings import RoutingMode

    now = datetime.now(UTC)
    s = Scheduler(
        router_id="bench", models=[MODEL], role=RouterRole.AGGREGATED, mode=RoutingMode(mode), kv_events=True,
        cache_inputs=ALL_CACHE_INPUTS, startup={k: startup_values(k) for k in PolicyKind}, worker_ttl_s=1e9,
        worker_stale_s=1e9, wall=lambda: now, rng=random.Random(1), keyring=Keyring({}), background_fits=True,
    )
    rec = WorkerRecord(instance_id=1, model=MODEL, url="http://w1", block_size=BLOCK, kv_total_blocks=16384,
                       max_num_batched_tokens=8192, started_at=now)
    s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=rec, load=[RankLoad()], at=now)))
    s._dispatch(LoadKvDump(1, None, final=True))
    s.start()
    await asyncio.sleep(0)
    rng = random.Random(2)
    hashes = [{BLOCK: chain_hashes([rng.randrange(256) for _ in range(PROMPT_TOKENS)], BLOCK)} for _ in range(prompts)]
    open_ids: collections.deque[str] = collections.deque()
    spent = {"select": 0.0, "first_token": 0.0, "done": 0.0}
    clock = time.perf_counter
    for i in range(requests):
        req = RoutingRequest(request_id=f"q{i}", model=MODEL, prompt_tokens=PROMPT_TOKENS, hashes=hashes[i % prompts])
        t0 = clock()
        sel = s.select_now(req)
        t1 = clock()
        assert sel is not None
        open_ids.append(sel.booking_id)
        if len(open_ids) >= in_flight:
            booking = open_ids.popleft()
            t2 = clock()
            s.send(RequestFirstToken(booking, ttft_ms=5.0))
            t3 = clock()
            s.send(RequestDone(booking, itl_ms=1.0, decode_tokens=8, instance_id=1, predicted_cached=0,
                               reported_cached=0))
            t4 = clock()
            if i >= 1000:
                spent["first_token"] += t3 - t2
                spent["done"] += t4 - t3
        if i >= 1000:
            spent["select"] += t1 - t0
        if i % 256 == 0:
            await asyncio.sleep(0)  # the actor's task and the fits run, as in a router
    await s.stop()
    counted = max(requests - 1000, 1)
    out = {k: v / counted * 1e6 for k, v in spent.items()}
    out["total"] = sum(out.values())
    return out


def child(args: argparse.Namespace) -> None:
    """Run in a checkout's code (``--src``) and print the measurement as JSON."""
    sys.path.insert(0, args.src)
    os.chdir(args.src)
    logging_off()
    print(json.dumps(asyncio.run(measure(args.mode, args.requests, args.in_flight, args.prompts))))


def logging_off() -> None:
    import logging

    logging.disable(logging.WARNING)


def run_tree(src: Path, args: argparse.Namespace, requests: int, *,
             valgrind: str | None = None) -> tuple[dict[str, float], int | None]:
    """(µs per command, instructions of the whole run if counted) of one tree."""
    cmd = [sys.executable, str(HERE), "--child", "--src", str(src), "--mode", args.mode, "--requests", str(requests),
           "--in-flight", str(args.in_flight), "--prompts", str(args.prompts)]
    instructions = None
    with tempfile.TemporaryDirectory(prefix="rc-") as tmp:
        if valgrind is not None:
            cmd = [valgrind, "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        if valgrind is not None:
            found = re.search(r"Collected : (\d+)", proc.stderr)
            instructions = int(found.group(1)) if found else None
    return json.loads(proc.stdout.strip().splitlines()[-1]), instructions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="kv")
    p.add_argument("--requests", type=int, default=20000, help="requests of the timed run")
    p.add_argument("--in-flight", type=int, default=32)
    p.add_argument("--prompts", type=int, default=1, help="distinct prompts (sessions), taken in turn")
    p.add_argument("--callgrind", action="store_true", help="also count instructions per request (valgrind)")
    p.add_argument("--counted", type=int, default=1500, help="N of the counted runs (N and 3N requests)")
    p.add_argument("--baseline", default="", help="another checkout, measured the same way")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--src", default=str(ROOT), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    valgrind = shutil.which("valgrind") if args.callgrind else None
    if args.callgrind and valgrind is None:
        raise SystemExit("--callgrind: valgrind is not installed (Debian's valgrind package)")
    trees = {"this tree": ROOT, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    rows: dict[str, dict[str, Any]] = {}
    for name, src in trees.items():
        print(f"{name}: timing {args.requests} requests ...", file=sys.stderr, flush=True)
        times, _ = run_tree(src, args, args.requests)
        row: dict[str, Any] = {"src": str(src), "us": times}
        if valgrind is not None:
            counts = []
            for n in (args.counted, 3 * args.counted):
                print(f"{name}: counting instructions, {n} requests under callgrind ...", file=sys.stderr, flush=True)
                counts.append(run_tree(src, args, n, valgrind=valgrind)[1])
            if None not in counts:
                row["instructions_per_request"] = (counts[1] - counts[0]) / (2 * args.counted)  # type: ignore[operator]
        rows[name] = row
    print(f"\nmode {args.mode}, one worker, {args.in_flight} in flight, {args.prompts} prompt(s); mean µs a command "
          "(wall time: noisy), instructions a request (callgrind: steady)")
    print(f"{'tree':12} {'select':>8} {'1st token':>10} {'end':>8} {'total':>8} {'instructions':>13}")
    for name, row in rows.items():
        us = row["us"]
        ins = row.get("instructions_per_request")
        print(f"{name:12} {us['select']:8.1f} {us['first_token']:10.1f} {us['done']:8.1f} {us['total']:8.1f} "
              f"{'-' if ins is None else f'{ins:,.0f}':>13}")
    if "baseline" in rows and "instructions_per_request" in rows["baseline"]:
        ratio = rows["this tree"]["instructions_per_request"] / rows["baseline"]["instructions_per_request"]
        print(f"\ninstructions a request, this tree / baseline: {ratio * 100:.1f} %")
    sys.path.insert(0, str(ROOT))
    from bench.common import machine, write_result

    path = write_result("request_commands", {
        "benchmark": "request_commands", "machine": machine(), "mode": args.mode, "in_flight": args.in_flight,
        "prompts": args.prompts, "requests": args.requests, "counted": args.counted if valgrind else None,
        "trees": rows,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
