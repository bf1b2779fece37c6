"""KV events under load: does the router's prefix index keep up with its workers, and does its
memory stay flat? (issue 16, docs/decisions.md 122)

Two mock workers (``--workers``) at speedup 1000 behind one ``kv`` router, 32 closed-loop clients, each request a
prompt never seen before (so every request stores new blocks and evicts old ones: the workers
publish KV events as fast as they serve). Every 10 s it samples the router's RSS and, where the
router has it, ``rudder_router_kv_events_backlog`` (events received, not yet applied); at the end,
the clients' TTFT p50/p99, the router's gaps (``rudder_router_kv_index_events_total{reason="gap"}``)
and dropped KV events (``rudder_router_bus_dropped_total{kind="kv"}``, by reason). With ``--baseline <checkout>`` that
checkout's router runs the same load first, then this one (one router at a time: they would share
two cores). Startup values, but for the log level (WARNING, as every bench).

    python bench/kv_load.py                                   # this checkout, 60 s
    python bench/kv_load.py --baseline /work/wt/base --seconds 120
    python bench/kv_load.py --routers 2 --workers 4 --clients 64   # two replicas, no affinity
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

from bench.common import Fleet, Router, machine, pct, write_result
from bench.proxy_overhead import STARTUP, RawClient, process_tree, split
from cli.embedded import LocalBus

MODEL = "bench-kv-load"
SAMPLE_S = 10.0


def unique_body(rng: random.Random, max_tokens: int = 8) -> bytes:
    """A streamed completion whose prompt (~120 tokens) no earlier request shared."""
    words = " ".join(f"w{rng.getrandbits(40):x}" for _ in range(60))
    return json.dumps({"model": MODEL, "prompt": words, "max_tokens": max_tokens, "stream": True}).encode()


def scrape(text: str) -> dict[str, float]:
    """The series this bench reads, by their full names with labels."""
    wanted = ("rudder_router_kv_events_backlog", "rudder_router_kv_index_events_total",
              "rudder_router_bus_dropped_total")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(wanted):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def run_one(name: str, bus: LocalBus, src: Path | None, seconds: float, clients: int, workers: int,
                  logs: Path, replicas: int = 1, max_tokens: int = 8) -> dict[str, Any]:
    fleet = Fleet(bus, MODEL, workers, mock={"speedup_ratio": 1000}, launcher="cli")
    await fleet.start()
    routers = [Router(bus, MODEL, mode="kv", launcher="cli", log=logs / f"{name}-{i}.log", src=src, env=STARTUP)
               for i in range(replicas)]
    try:
        for router in routers:
            await router.ready(workers)
        procs = [psutil.Process(process_tree(router.proc)[-1]) for router in routers]
        addresses = [split(router.url) for router in routers]
        done = errors = 0
        ttfts: list[float] = []
        samples: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        stop_at = t0 + seconds

        async def client(seed: int) -> None:
            nonlocal done, errors
            rng = random.Random(seed)
            # one connection to each replica; the next request goes to the next one (no affinity)
            conns = [RawClient(host, port) for host, port in addresses]
            turn = seed
            try:
                while time.perf_counter() < stop_at:
                    turn += 1
                    c = conns[turn % len(conns)]
                    try:
                        ttft, _, status = await c.post_stream("/v1/completions", unique_body(rng, max_tokens))
                    except (ConnectionError, OSError, asyncio.IncompleteReadError):
                        errors += 1
                        await c.close()
                        continue
                    done += status == 200
                    errors += status != 200
                    if status == 200:
                        ttfts.append(ttft)
            finally:
                for c in conns:
                    await c.close()

        async def sample(http: httpx.AsyncClient) -> None:
            while True:
                got = [scrape((await http.get(router.url + "/metrics")).text) for router in routers]
                backlogs = [g.get("rudder_router_kv_events_backlog") for g in got]
                # the largest of the replicas' (one router: its own)
                row = {"t_s": round(time.perf_counter() - t0, 1), "requests": done,
                       "rss_mb": max(round(proc.memory_info().rss / 2**20, 1) for proc in procs),
                       "backlog": None if None in backlogs else max(b or 0.0 for b in backlogs)}
                if len(routers) > 1:
                    row["rss_mb_each"] = [round(proc.memory_info().rss / 2**20, 1) for proc in procs]
                    row["backlog_each"] = backlogs
                samples.append(row)
                print(f"  {name:<10} {row['t_s']:6.1f} s  {done:8d} requests  RSS {row['rss_mb']:7.1f} MB"
                      f"  backlog {row['backlog'] if row['backlog'] is not None else '-'}", flush=True)
                if time.perf_counter() >= stop_at:
                    return
                await asyncio.sleep(min(SAMPLE_S, max(stop_at - time.perf_counter(), 0.0)))

        async with httpx.AsyncClient(timeout=10) as http:
            await asyncio.gather(sample(http), *(client(i) for i in range(clients)))
            wall = time.perf_counter() - t0
            ends = [scrape((await http.get(router.url + "/metrics")).text) for router in routers]
        end: dict[str, float] = {}  # summed over the replicas
        for got in ends:
            for k, v in got.items():
                end[k] = end.get(k, 0.0) + v
        first, last = samples[0], samples[-1]
        mid = samples[len(samples) // 2]
        drops = {k.split('kind="')[1].split('"')[0] + ":" + k.split('reason="')[1].rstrip('"}'): v
                 for k, v in end.items() if k.startswith("rudder_router_bus_dropped_total{")}
        backlogs = [s["backlog"] for s in samples if s["backlog"] is not None]
        return {
            "target": name, "replicas": len(routers), "requests": done, "errors": errors,
            "rps": round(done / wall, 1),
            "ttft_p50_ms": round(pct(ttfts, 0.5) * 1e3, 2), "ttft_p99_ms": round(pct(ttfts, 0.99) * 1e3, 2),
            "rss_start_mb": first["rss_mb"], "rss_end_mb": last["rss_mb"],
            # second half only: the index and the caches fill in the first
            "rss_mb_per_10k_requests_second_half": round(
                (last["rss_mb"] - mid["rss_mb"]) * 10_000 / max(last["requests"] - mid["requests"], 1), 2),
            "backlog_max": max(backlogs) if backlogs else None,
            "gaps": end.get('rudder_router_kv_index_events_total{reason="gap"}', 0.0),
            "bus_dropped": drops, "samples": samples,
        }
    finally:
        for router in routers:
            router.stop()
        fleet.stop()


async def main(args: argparse.Namespace) -> None:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvload-") as tmp:
        logs = Path(args.log_dir) if args.log_dir else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        bus = LocalBus(Path(tmp))
        bus.start()
        try:
            targets: list[tuple[str, Path | None]] = [("baseline", Path(args.baseline))] if args.baseline else []
            targets.append(("rudder", None))
            for name, src in targets:
                runs.append(await run_one(name, bus, src, args.seconds, args.clients, args.workers, logs,
                                          args.routers, args.max_tokens))
        finally:
            bus.stop()
    print()
    print(f"{'target':<10}{'requests':>10}{'req/s':>8}{'TTFT p50':>10}{'p99':>9}{'RSS start':>11}{'RSS end':>9}"
          f"{'MB/10k req (2nd half)':>23}{'backlog max':>13}{'gaps':>6}  dropped on the bus (kind:reason)")
    for r in runs:
        backlog = "-" if r["backlog_max"] is None else f"{r['backlog_max']:.0f}"
        print(f"{r['target']:<10}{r['requests']:>10}{r['rps']:>8.0f}{r['ttft_p50_ms']:>8.1f}ms{r['ttft_p99_ms']:>7.1f}ms"
              f"{r['rss_start_mb']:>9.1f}MB"
              f"{r['rss_end_mb']:>7.1f}MB{r['rss_mb_per_10k_requests_second_half']:>23.2f}{backlog:>13}"
              f"{r['gaps']:>6.0f}  {r['bus_dropped'] or '-'}")
    path = write_result(args.output, {"benchmark": "kv_load", **machine(), "seconds": args.seconds,
                                      "clients": args.clients, "workers": args.workers,
                                      "routers": args.routers, "max_tokens": args.max_tokens,
                                      "baseline": args.baseline, "runs": runs})
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of the load on each router")
    p.add_argument("--clients", type=int, default=32, help="closed-loop clients")
    p.add_argument("--workers", type=int, default=2, help="mock workers behind the router")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each answer streams (a chunk each)")
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas; each client sends its next request to the next one (no affinity)")
    p.add_argument("--baseline", default="", help="also run a router from this checkout, first")
    p.add_argument("--log-dir", default="", help="keep the routers' logs here")
    p.add_argument("--output", default="kv_load")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
