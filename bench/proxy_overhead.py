"""Proxy overhead: what the router adds to a streamed request, versus calling the worker directly.

One mock worker (``rudder serve worker``, high ``speedup_ratio`` so the engine itself is cheap) and
one router (``rudder serve router``, mode ``kv``: the full path with prompt hashing, index lookup, cost
and booking) on one embedded nats-server, all on 127.0.0.1. Both targets get the same streamed
``/v1/completions`` requests (a ~100-token prompt, 8 output tokens, ``include_usage``):

1. latency: requests one at a time, alternating direct / router, so both see the same machine
   state; TTFT = send -> first body chunk (the first token), total = send -> end of stream;
2. throughput: a closed loop at several concurrencies, alternating direct / router phases of a
   fixed length; the best requests/s of each target.

The load generator is a small HTTP/1.1 client on raw asyncio streams (keep-alive, chunked
decoding), much cheaper than httpx, so that on a 2-core box the client takes as little CPU from
the servers as possible. CPU per process is reported for every throughput phase.

    python bench/proxy_overhead.py           # table on stdout, bench/results/proxy_overhead.json
    python bench/proxy_overhead.py --profile /tmp/prof   # + py-spy flame graphs of router and worker
    python bench/proxy_overhead.py --baseline /work/main # + a router of another checkout, same run

With ``--baseline``, a second router runs the code of that checkout on the same bus and worker;
its throughput phases alternate with the others', and the ratio router / baseline is reported
with the run-to-run spread of each target across rounds (the noise it must be read against).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.common import CpuSampler, Fleet, Router, machine, pct, write_result
from cli.embedded import LocalBus

MODEL = "bench-proxy"
PROMPT = "Tell me about prefix caching in large language model serving. " * 2  # ~120 tokens
MAX_TOKENS = 8


class RawClient:
    """One keep-alive HTTP/1.1 connection; POSTs a JSON body and reads a (chunked) response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.writer = self.reader = None

    async def post_stream(self, path: str, body: bytes) -> tuple[float, float, int]:
        """Returns (TTFT s, total s, status); TTFT = first non-empty body chunk."""
        if self.writer is None:
            await self._connect()
        assert self.reader is not None and self.writer is not None
        t0 = time.perf_counter()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
        )
        r = self.reader
        status_line = await r.readline()
        if not status_line:
            await self.close()
            raise ConnectionError("connection closed")
        status = int(status_line.split(b" ", 2)[1])
        chunked = False
        length = 0
        close = False
        while True:
            line = await r.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "content-length":
                length = int(value)
            elif name == "connection" and value == "close":
                close = True
        ttft = 0.0
        if chunked:
            while True:
                size = int((await r.readline()).split(b";")[0], 16)
                if size == 0:
                    await r.readline()
                    break
                await r.readexactly(size + 2)
                if not ttft:
                    ttft = time.perf_counter() - t0
        else:
            await r.readexactly(length)
            ttft = time.perf_counter() - t0
        total = time.perf_counter() - t0
        if close:
            await self.close()
        return ttft, total, status


def request_body() -> bytes:
    return json.dumps({
        "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()


def split(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def latency(direct: str, router: str, n: int) -> dict[str, Any]:
    body = request_body()
    clients = {"direct": RawClient(*split(direct)), "router": RawClient(*split(router))}
    samples: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "total": []} for k in clients}
    try:
        for _ in range(20):  # warm up both paths (connections, JIT-free but caches, allocators)
            for c in clients.values():
                await c.post_stream("/v1/completions", body)
        for _ in range(n):
            for name, c in clients.items():
                ttft, total, status = await c.post_stream("/v1/completions", body)
                if status != 200:
                    raise RuntimeError(f"{name}: HTTP {status}")
                samples[name]["ttft"].append(ttft)
                samples[name]["total"].append(total)
    finally:
        for c in clients.values():
            await c.close()
    out: dict[str, Any] = {"requests_each": n}
    for name, s in samples.items():
        for metric, values in s.items():
            out[f"{name}_{metric}_p50_ms"] = pct(values, 0.5) * 1e3
            out[f"{name}_{metric}_p99_ms"] = pct(values, 0.99) * 1e3
            out[f"{name}_{metric}_mean_ms"] = statistics.fmean(values) * 1e3
    for metric in ("ttft", "total"):
        for q in ("p50", "p99"):
            out[f"added_{metric}_{q}_ms"] = out[f"router_{metric}_{q}_ms"] - out[f"direct_{metric}_{q}_ms"]
    return out


async def throughput(url: str, concurrency: int, seconds: float, max_requests: int) -> dict[str, Any]:
    """Closed loop: ``concurrency`` connections each send the next request when one ends."""
    body = request_body()
    host, port = split(url)
    done = 0
    errors = 0
    ttfts: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done, errors
        c = RawClient(host, port)
        try:
            while time.perf_counter() < stop_at and done + errors < max_requests:
                try:
                    ttft, _, status = await c.post_stream("/v1/completions", body)
                except (ConnectionError, OSError, asyncio.IncompleteReadError):
                    errors += 1
                    await c.close()
                    continue
                if status == 200:
                    done += 1
                    ttfts.append(ttft)
                else:
                    errors += 1
        finally:
            await c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": done, "errors": errors, "wall_s": wall,
            "rps": done / wall, "ttft_p50_ms": pct(ttfts, 0.5) * 1e3, "ttft_p99_ms": pct(ttfts, 0.99) * 1e3}


def compare(phases: list[dict[str, Any]], concurrencies: list[int]) -> dict[str, Any]:
    """Router against baseline at each concurrency (best phase of each), with each target's
    spread across rounds ((max - min) / mean of its phases): the run-to-run noise."""
    def rps(name: str, c: int) -> list[float]:
        return [p["rps"] for p in phases if p["target"] == name and p["concurrency"] == c]

    def spread(values: list[float]) -> float:
        return (max(values) - min(values)) / statistics.fmean(values) if len(values) > 1 else 0.0

    def cpu_ms(name: str, c: int) -> list[float]:
        """The target's own CPU per request: steadier than req/s on a machine others load."""
        return [p["cpu"]["process_cores"][name] * p["wall_s"] / p["requests"] * 1e3
                for p in phases if p["target"] == name and p["concurrency"] == c and p["requests"]]

    rows = [{"concurrency": c, "router_rps": max(rps("router", c)), "baseline_rps": max(rps("baseline", c)),
             "ratio": max(rps("router", c)) / max(rps("baseline", c)),
             "router_spread": spread(rps("router", c)), "baseline_spread": spread(rps("baseline", c)),
             "router_cpu_ms_per_request": statistics.median(cpu_ms("router", c)),
             "baseline_cpu_ms_per_request": statistics.median(cpu_ms("baseline", c))}
            for c in concurrencies]
    best_router = max(p["rps"] for p in phases if p["target"] == "router")
    best_baseline = max(p["rps"] for p in phases if p["target"] == "baseline")
    return {"by_concurrency": rows, "max_ratio": best_router / best_baseline}


def start_profiler(pid: int, path: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not found; no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", "200", "--format", "speedscope", "--output", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def main(args: argparse.Namespace) -> None:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="po-") as tmp:
        server = LocalBus(Path(tmp))
        server.start()
        fleet = Fleet(server, MODEL, 1, mock={"speedup_ratio": args.speedup}, launcher=args.launcher)
        router: Router | None = None
        baseline: Router | None = None
        try:
            await fleet.start()
            router = Router(server, MODEL, mode=args.mode, launcher=args.launcher)
            await router.ready(1)
            direct_url, router_url = fleet.urls[0], router.url
            targets = [("direct", direct_url), ("router", router_url)]
            if args.baseline:
                baseline = Router(server, MODEL, mode=args.mode, launcher=args.launcher,
                                  src=Path(args.baseline))
                await baseline.ready(1)
                targets.append(("baseline", baseline.url))

            lat = await latency(direct_url, router_url, args.requests)
            print(f"latency, {args.requests} sequential requests each way (alternating):")
            print(f"{'':<10}{'TTFT p50':>10}{'TTFT p99':>10}{'total p50':>11}{'total p99':>11}")
            for name in ("direct", "router", "added"):
                print(f"{name:<10}{lat[f'{name}_ttft_p50_ms']:>8.2f}ms{lat[f'{name}_ttft_p99_ms']:>8.2f}ms"
                      f"{lat[f'{name}_total_p50_ms']:>9.2f}ms{lat[f'{name}_total_p99_ms']:>9.2f}ms")

            pids = {"router": [router.proc.pid], "worker": [fleet.procs[0].pid], "client": [os.getpid()],
                    "nats": [server.server.proc.pid] if server.server.proc else []}
            if baseline is not None:
                pids["baseline"] = [baseline.proc.pid]
            phases: list[dict[str, Any]] = []
            for rnd in range(args.rounds):
                for c in concurrencies:
                    for name, url in targets:
                        prof = None
                        if args.profile and name == "router" and rnd == args.rounds - 1 and c == max(concurrencies):
                            prof_dir = Path(args.profile)
                            prof = [start_profiler(router.proc.pid, prof_dir / "router.json", args.seconds),
                                    start_profiler(fleet.procs[0].pid, prof_dir / "worker.json", args.seconds)]
                        sampler = CpuSampler(pids)
                        sampler.start()
                        res = await throughput(url, c, args.seconds, args.max_requests)
                        res["cpu"] = sampler.stop()
                        res["target"] = name
                        res["round"] = rnd
                        phases.append(res)
                        for p in prof or []:
                            if p is not None:
                                p.wait(args.seconds + 30)
            names = [name for name, _ in targets]
            best = {name: max((p for p in phases if p["target"] == name), key=lambda p: p["rps"])
                    for name in names}
            print(f"\nthroughput, closed loop, {args.seconds:.0f} s phases, best of {args.rounds} rounds:")
            print(f"{'target':<8}{'conc':>6}{'req/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
                  f"{'CPU router':>11}{'worker':>8}{'client':>8}{'machine':>9}")
            for c in concurrencies:
                for name in names:
                    rows = [p for p in phases if p["target"] == name and p["concurrency"] == c]
                    p = max(rows, key=lambda p: p["rps"])
                    pc = p["cpu"]["process_cores"]
                    own = pc.get(name, pc["router"]) if name != "direct" else pc["router"]
                    print(f"{name:<8}{c:>6}{p['rps']:>9.0f}{p['ttft_p50_ms']:>8.2f}ms{p['ttft_p99_ms']:>8.2f}ms"
                          f"{own:>11.2f}{pc['worker']:>8.2f}{pc['client']:>8.2f}"
                          f"{p['cpu']['machine_busy_pct']:>8.0f}%")
            comparison = compare(phases, concurrencies) if baseline is not None else None
            if comparison is not None:
                print("\nrouter / baseline (best phase each), and each target's spread across rounds:")
                for row in comparison["by_concurrency"]:
                    print(f"  concurrency {row['concurrency']:>3}: {row['ratio'] * 100:6.1f}%  "
                          f"(router spread {row['router_spread'] * 100:.1f}%, "
                          f"baseline spread {row['baseline_spread'] * 100:.1f}%); CPU per request "
                          f"{row['router_cpu_ms_per_request']:.3f} vs {row['baseline_cpu_ms_per_request']:.3f} ms")
                print(f"  max req/s: router {best['router']['rps']:.0f}, baseline {best['baseline']['rps']:.0f} "
                      f"({comparison['max_ratio'] * 100:.1f}%)")
            ratio = best["router"]["rps"] / best["direct"]["rps"]
            print(f"\nmax req/s: direct {best['direct']['rps']:.0f}, router {best['router']['rps']:.0f} "
                  f"({ratio * 100:.0f}% of direct); added TTFT p50 {lat['added_ttft_p50_ms']:.2f} ms, "
                  f"p99 {lat['added_ttft_p99_ms']:.2f} ms")
        finally:
            if baseline is not None:
                baseline.stop()
            if router is not None:
                router.stop()
            fleet.stop()
            server.stop()
    out = {
        "benchmark": "proxy_overhead", **machine(), "mode": args.mode, "launcher": args.launcher,
        "speedup_ratio": args.speedup,
        "prompt_chars": len(PROMPT), "max_tokens": MAX_TOKENS,
        "note": ("streamed /v1/completions; TTFT = send -> first body chunk; latency phase alternates "
                 "direct and router requests one at a time; throughput = closed loop, best phase"),
        "latency": lat, "throughput_phases": phases,
        "max_rps": {"direct": best["direct"]["rps"], "router": best["router"]["rps"],
                    "router_share_of_direct": ratio},
    }
    if comparison is not None:
        out["baseline"] = {"src": args.baseline, **comparison}
    path = write_result(args.output, out)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="sequential requests each way (latency)")
    p.add_argument("--concurrency", default="1,8,32", help="closed-loop concurrencies (throughput)")
    p.add_argument("--seconds", type=float, default=5.0, help="length of one throughput phase")
    p.add_argument("--max-requests", type=int, default=20000, help="cap per throughput phase")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--speedup", type=float, default=1000.0, help="mock speedup_ratio")
    p.add_argument("--mode", default="kv")
    p.add_argument("--launcher", default="cli", choices=("cli", "module"),
                   help="cli = rudder serve (uvloop, as deployed); module = python -m (asyncio loop)")
    p.add_argument("--profile", default="", help="py-spy speedscope profiles of router and worker here")
    p.add_argument("--baseline", default="", help="also run a router from this checkout (e.g. /work/main)")
    p.add_argument("--output", default="proxy_overhead")
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.baseline:
        arguments.baseline = str(Path(arguments.baseline).resolve())
    if arguments.profile:
        Path(arguments.profile).mkdir(parents=True, exist_ok=True)
    asyncio.run(main(arguments))
