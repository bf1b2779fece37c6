"""Overload: one ``kv`` router in front of mock workers, driven open-loop (Poisson arrivals) at
multiples of the fleet's capacity (docs/decisions.md 107).

The capacity is measured first (closed loop, ``--capacity-concurrency`` connections, through the
router). Then each ``--rates`` multiple runs for ``--seconds``: a request on an idle keep-alive
connection of the client's pool, or on a new one (a client library's unbounded pool), however
many are in flight. Reported per phase: requests sent and served, the refusals by their text
(``no worker available`` is the router mistaking its own backlog for silent workers; past
``MAX_CONNECTIONS`` the router answers 503 as designed), connection errors, goodput (served per
second over the phase and its drain), TTFT p50/p99 of the served, the workers' preemptions (a
request evicted for KV space and computed again), and cores used by the router, the workers and
the client. With ``--baseline``, a router of another checkout runs the same
phases, alternating with this one's (the ratio is read against the run's own spread).

    python bench/overload.py                         # table, bench/results/overload.json
    python bench/overload.py --baseline /work/wt/old --runs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Fleet, Router, kv_routers, machine, metric_sums, pct, write_result
from bench.proxy_overhead import MODEL, PROMPT, RawClient, split, throughput
from cli.embedded import LocalBus

NO_WORKER = b"no worker available"
MAX_CONN = b"holds its limit"


async def open_loop(url: str, rate: float, seconds: float, max_tokens: int, seed: int) -> dict[str, Any]:
    host, port = split(url)
    idle: list[RawClient] = []
    tasks: set[asyncio.Task[None]] = set()
    rng = random.Random(seed)
    counts = {"sent": 0, "served": 0, "no_worker": 0, "max_connections": 0, "other_status": 0, "conn_errors": 0}
    ttfts: list[float] = []
    in_flight = peak = 0

    async def one(i: int) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        client = idle.pop() if idle else RawClient(host, port)
        body = json.dumps({"model": MODEL, "prompt": f"{PROMPT} user {i % 50}", "max_tokens": max_tokens,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        try:
            ttft, _, status = await client.post_stream("/v1/completions", body)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            counts["conn_errors"] += 1
            await client.close()
            return
        finally:
            in_flight -= 1
        if status == 200:
            counts["served"] += 1
            ttfts.append(ttft)
        elif NO_WORKER in client.last_body:
            counts["no_worker"] += 1
        elif MAX_CONN in client.last_body:
            counts["max_connections"] += 1
        else:
            counts["other_status"] += 1
        idle.append(client)

    t0 = time.perf_counter()
    at = t0
    i = 0
    while True:
        at += rng.expovariate(rate)
        if at - t0 > seconds:
            break
        wait = at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        task = asyncio.create_task(one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        counts["sent"] += 1
        i += 1
    if tasks:
        await asyncio.wait(tasks, timeout=120)
    wall = time.perf_counter() - t0
    for client in idle:
        await client.close()
    return {**counts, "rate": rate, "wall_s": wall, "peak_in_flight": peak,
            "goodput_rps": counts["served"] / wall,
            "ttft_p50_ms": pct(ttfts, 0.5) * 1e3 if ttfts else None,
            "ttft_p99_ms": pct(ttfts, 0.99) * 1e3 if ttfts else None}


async def preemptions(urls: list[str]) -> int:
    """The mock workers' preemptions so far (a request evicted for KV space and recomputed)."""
    total = 0
    async with httpx.AsyncClient(timeout=10) as client:
        for url in urls:
            total += int((await metric_sums(client, url, ("rudder_mock_preemptions",)))["rudder_mock_preemptions"])
    return total


def cpu_seconds(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    return {name: sum(sum(p.cpu_times()[:2]) for p in ps) for name, ps in procs.items()}


async def main(args: argparse.Namespace) -> None:
    multiples = [float(m) for m in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        bus = LocalBus(Path(tmp))
        bus.start()
        fleet = Fleet(bus, MODEL, args.workers, mock={"speedup_ratio": args.speedup})
        routers: dict[str, Router] = {}
        try:
            await fleet.start()
            routers.update(kv_routers(bus, MODEL, Path(tmp), args.baseline, names=("router", "baseline")))
            for r in routers.values():
                await r.ready(args.workers)
            workers = [psutil.Process(p.pid) for p in fleet.procs]
            first = next(iter(routers.values()))
            cap = await throughput(first.url, args.capacity_concurrency, args.seconds, 10**9, args.max_tokens)
            capacity = cap["rps"]
            print(f"capacity (closed loop, c={args.capacity_concurrency}, through the router): "
                  f"{capacity:.0f} req/s", flush=True)
            phases: list[dict[str, Any]] = []
            for run in range(1, args.runs + 1):
                for name, r in routers.items():
                    procs = {"router": [psutil.Process(r.proc.pid)], "workers": workers, "client": [psutil.Process()]}
                    for mult in multiples:
                        before, evicted = cpu_seconds(procs), await preemptions(fleet.urls)
                        psutil.cpu_percent()  # the machine's busy share from here
                        res = await open_loop(r.url, mult * capacity, args.seconds, args.max_tokens, seed=run)
                        after, busy = cpu_seconds(procs), psutil.cpu_percent()
                        res.update(target=name, run=run, multiple=mult, machine_busy_pct=busy,
                                   preemptions=await preemptions(fleet.urls) - evicted,
                                   cores={k: (after[k] - before[k]) / res["wall_s"] for k in procs})
                        phases.append(res)
                        print(f"  run {run} {name} {mult:g}x: served {res['served']}/{res['sent']}, "
                              f"no worker {res['no_worker']}, goodput {res['goodput_rps']:.0f} req/s", flush=True)
        finally:
            for r in routers.values():
                r.stop()
            fleet.stop()
            bus.stop()
    print(f"\n{'target':<10}{'run':>4}{'x':>5}{'sent':>7}{'served':>8}{'no worker':>10}{'max conn':>9}"
          f"{'other':>6}{'conn err':>9}{'goodput':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'preempt':>9}"
          f"  cores router/workers/client, machine busy")
    for p in phases:
        c = p["cores"]
        ttft50 = f"{p['ttft_p50_ms']:.0f}ms" if p["ttft_p50_ms"] is not None else "-"
        ttft99 = f"{p['ttft_p99_ms']:.0f}ms" if p["ttft_p99_ms"] is not None else "-"
        print(f"{p['target']:<10}{p['run']:>4}{p['multiple']:>5g}{p['sent']:>7}{p['served']:>8}{p['no_worker']:>10}"
              f"{p['max_connections']:>9}{p['other_status']:>6}{p['conn_errors']:>9}{p['goodput_rps']:>9.0f}"
              f"{ttft50:>10}{ttft99:>10}{p['preemptions']:>9}  {c['router']:.2f}/{c['workers']:.2f}/{c['client']:.2f}, "
              f"{p['machine_busy_pct']:.0f}%")
    out = {"benchmark": "overload", **machine(), "workers": args.workers, "speedup": args.speedup,
           "max_tokens": args.max_tokens, "seconds": args.seconds, "capacity_rps": capacity,
           "baseline": args.baseline or None, "phases": phases}
    path = Path(args.output + ".json") if args.output else write_result("overload", out)
    if args.output:
        path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,2,4", help="multiples of the measured capacity, one phase each")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of a phase (and of the capacity run)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--speedup", type=float, default=10.0, help="mock speedup_ratio")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--capacity-concurrency", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1, help="rounds of every target's phases, alternating")
    ap.add_argument("--baseline", default="", help="also a router of this checkout (e.g. a worktree of main)")
    ap.add_argument("--output", default="", help="write the JSON here (+ .json) instead of bench/results/")
    asyncio.run(main(ap.parse_args()))
