"""Balance after a burst: how a router spreads an under-capacity load over identical workers once
a burst has passed (docs/decisions.md 110).

Two (``--workers``) identical mock workers behind each router. The fleet's capacity is measured
first (closed loop, ``--burst-concurrency`` connections, through the first router). Then, for
each target and each of ``--runs`` rounds (targets alternate): a burst (the same closed loop for
``--burst-seconds``: every TTFT long, as in any load spike), then ``--seconds`` of Poisson
arrivals at ``--load`` times the capacity, during which each engine's running requests are read
every 0.2 s. Reported per phase: the requests each worker served (from the engines' own counters)
and the busiest one's share, the mean imbalance of the sampled running counts (|a - b| / (a + b)
over samples with at least 10 running in all; 0 is even, 1 is all on one), the share of samples
where a worker ran nothing while the fleet ran 10 or more, and TTFT p50/p99 of the served.

Targets: this checkout's router in ``kv`` (the startup values), ``round_robin`` as the even
reference, and with ``--baseline`` another checkout's ``kv`` router.

    python bench/balance.py                                   # table, bench/results/balance.json
    python bench/balance.py --baseline /work/wt/old --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Fleet, Router, kv_routers, machine, metric_sums, write_result
from bench.overload import open_loop
from bench.proxy_overhead import MODEL, throughput
from bench.routing_quality import router_timing
from cli.embedded import LocalBus

SAMPLE_S = 0.2
BUSY = 10  # running requests in the fleet from which a sample counts


async def engine_figures(client: httpx.AsyncClient, urls: list[str]) -> list[tuple[float, float]]:
    """(running, requests served so far) of each mock worker, from its /metrics."""
    out = []
    for url in urls:
        f = await metric_sums(client, url, ("rudder_mock_running", "rudder_mock_requests_total"))
        out.append((f["rudder_mock_running"], f["rudder_mock_requests_total"]))
    return out


async def phase(url: str, urls: list[str], rate: float, seconds: float, max_tokens: int, seed: int) -> dict[str, Any]:
    samples: list[list[float]] = []
    async with httpx.AsyncClient(timeout=30) as client:
        before = [s for _, s in await engine_figures(client, urls)]

        async def watch() -> None:
            while True:
                await asyncio.sleep(SAMPLE_S)
                samples.append([r for r, _ in await engine_figures(client, urls)])

        watcher = asyncio.create_task(watch())
        try:
            res = await open_loop(url, rate, seconds, max_tokens, seed=seed)
        finally:
            watcher.cancel()
        after = [s for _, s in await engine_figures(client, urls)]
        timing = await router_timing(url)  # each worker's error over its calibration window
        error = {"prediction_mae_ms": timing["mean_worker_mae_ms"], "prediction_p90_ms": timing["mean_worker_p90_ms"]}
    served = [b - a for a, b in zip(before, after, strict=True)]
    busy = [s for s in samples if sum(s) >= BUSY]
    imbalance = [(max(s) - min(s)) / sum(s) for s in busy]
    return {**res, **error, "served_per_worker": served, "busiest_share": max(served) / max(sum(served), 1),
            "samples": len(samples), "busy_samples": len(busy),
            "imbalance_mean": statistics.fmean(imbalance) if imbalance else None,
            "starved_share": sum(1 for s in busy if min(s) == 0) / len(busy) if busy else None}


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="balance-") as tmp:
        bus = LocalBus(Path(tmp))
        bus.start()
        fleet = Fleet(bus, MODEL, args.workers, mock={"speedup_ratio": args.speedup})
        routers: dict[str, Router] = {}
        phases: list[dict[str, Any]] = []
        try:
            await fleet.start()
            routers.update(kv_routers(bus, MODEL, Path(tmp), args.baseline, names=("kv", "baseline kv")))
            routers["round_robin"] = Router(bus, MODEL, mode="round_robin", log=Path(tmp) / "rr.log")
            for r in routers.values():
                await r.ready(args.workers)
            first = next(iter(routers.values()))
            capacity = (await throughput(first.url, args.burst_concurrency, args.burst_seconds, 10**9,
                                         args.max_tokens))["rps"]
            print(f"capacity (closed loop, c={args.burst_concurrency}, through the router): {capacity:.0f} req/s",
                  flush=True)
            for run in range(1, args.runs + 1):
                for name, r in routers.items():
                    await throughput(r.url, args.burst_concurrency, args.burst_seconds, 10**9, args.max_tokens)
                    res = await phase(r.url, fleet.urls, args.load * capacity, args.seconds, args.max_tokens, seed=run)
                    res.update(target=name, run=run)
                    phases.append(res)
                    print(f"  run {run} {name}: served per worker {[int(s) for s in res['served_per_worker']]}",
                          flush=True)
        finally:
            for r in routers.values():
                r.stop()
            fleet.stop()
            bus.stop()

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(f"\n{'target':<13}{'run':>4}{'served':>8}{'busiest':>9}{'imbalance':>11}{'starved':>9}"
          f"{'TTFT p50':>10}{'TTFT p99':>10}{'pred. MAE':>11}{'pred. p90':>11}")
    for p in phases:
        print(f"{p['target']:<13}{p['run']:>4}{p['served']:>8}{p['busiest_share']:>9.0%}"
              f"{fmt(p['imbalance_mean'], '.2f'):>11}{fmt(p['starved_share'], '.0%'):>9}"
              f"{fmt(p['ttft_p50_ms'], '.0f'):>8}ms{fmt(p['ttft_p99_ms'], '.0f'):>8}ms"
              f"{fmt(p['prediction_mae_ms'], '.1f'):>9}ms{fmt(p['prediction_p90_ms'], '.1f'):>9}ms")
    keys = ("busiest_share", "imbalance_mean", "starved_share", "ttft_p50_ms", "ttft_p99_ms",
            "prediction_mae_ms", "prediction_p90_ms")
    summary = {}
    for name in routers:
        mine = [p for p in phases if p["target"] == name]
        summary[name] = {k: statistics.fmean(p[k] for p in mine if p[k] is not None)
                         for k in keys if any(p[k] is not None for p in mine)}
    print(f"\n{'mean over runs':<16}{'busiest':>9}{'imbalance':>11}{'starved':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'pred. MAE':>11}{'pred. p90':>11}")
    for name, s in summary.items():
        print(f"{name:<16}{s.get('busiest_share', 0):>9.0%}{fmt(s.get('imbalance_mean'), '.2f'):>11}"
              f"{fmt(s.get('starved_share'), '.0%'):>9}{fmt(s.get('ttft_p50_ms'), '.0f'):>8}ms"
              f"{fmt(s.get('ttft_p99_ms'), '.0f'):>8}ms{fmt(s.get('prediction_mae_ms'), '.1f'):>9}ms"
              f"{fmt(s.get('prediction_p90_ms'), '.1f'):>9}ms")
    out = {"benchmark": "balance", **machine(), "workers": args.workers, "speedup": args.speedup,
           "max_tokens": args.max_tokens, "seconds": args.seconds, "burst_seconds": args.burst_seconds,
           "load": args.load, "capacity_rps": capacity, "baseline": args.baseline or None,
           "summary": summary, "phases": phases}
    print(f"wrote {save(out, args.output)}")


def save(out: dict[str, Any], output: str) -> Path:
    if not output:
        return write_result("balance", out)
    path = Path(output + ".json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=float, default=0.8, help="the open loop's rate, a multiple of the capacity")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of the open-loop phase")
    ap.add_argument("--burst-seconds", type=float, default=5.0, help="length of the burst (and the capacity run)")
    ap.add_argument("--burst-concurrency", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--speedup", type=float, default=10.0, help="mock speedup_ratio")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2, help="rounds of every target, alternating")
    ap.add_argument("--baseline", default="", help="also a kv router of this checkout (e.g. a worktree of main)")
    ap.add_argument("--output", default="", help="write the JSON here (+ .json) instead of bench/results/")
    asyncio.run(main(ap.parse_args()))
