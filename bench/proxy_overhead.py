"""Proxy overhead: what a router adds to a streamed request, versus calling the worker directly,
for Rudder and for a Rust router, in the same run with the same client (issue 16).

One mock worker (``rudder serve worker``, high ``speedup_ratio`` so the engine itself is cheap) on
one embedded nats-server, and in front of it, each its own process on 127.0.0.1:

- Rudder routers (``rudder serve router``), one per ``--modes`` (default ``kv``: the full path with
  prompt hashing, index lookup, cost and booking; and ``round_robin``);
- a Rust router from PyPI (``--rust vllm-router``, one process per ``--rust-policies``), installed
  into a bench-only virtual environment under ``~/.cache/rudder/`` (created on first use, then
  reused; never a dependency of the product); ``--rust none`` leaves it out.

Every target gets the same streamed ``/v1/completions`` requests (a ~120-token prompt, 8 output
tokens, ``include_usage``):

1. latency: requests one at a time, alternating over the targets (direct first), so all see the
   same machine state; TTFT = send -> first body chunk (the first token), total = send -> end of
   stream; "added" = the target's percentile - direct's;
2. throughput: a closed loop at several concurrencies, alternating targets in phases of a fixed
   length; the best requests/s of each target at each concurrency, as a share of direct's;
3. the router's own CPU per request (its process and children: user + system seconds over the
   phase / requests; median of its phases at that concurrency): steadier than req/s on a machine
   that others load.

The load generator is a small HTTP/1.1 client on raw asyncio streams (keep-alive, chunked
decoding), much cheaper than httpx, so that on a 2-core box the client takes as little CPU from
the servers as possible. CPU per process is reported for every throughput phase.

    python bench/proxy_overhead.py           # table on stdout, bench/results/proxy_overhead.json
    python bench/proxy_overhead.py --profile /tmp/prof   # + py-spy profiles of Rudder kv and the worker
    python bench/proxy_overhead.py --baseline /work/main # + a Rudder router of another checkout

With ``--baseline``, a further Rudder router (mode ``--mode``) runs the code of that checkout on the
same bus and worker; the ratio router / baseline is reported with the run-to-run spread of each
across rounds (the noise it must be read against).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.common import (
    CpuSampler,
    Fleet,
    Router,
    machine,
    metric_sums,
    pct,
    python_calls,
    python_command,
    router_env,
    spawn,
    stop_all,
    wait_until,
    write_result,
)
from cli.embedded import LocalBus, free_port

MODEL = "bench-proxy"
PROMPT = "Tell me about prefix caching in large language model serving. " * 2  # ~120 tokens
MAX_TOKENS = 8
WARM_UP = 20  # requests to each target before the latency phase measures
# The routers at their startup values: bench.common's router_env turns the debug headers on (the
# routing benches read which worker answered from them); here they would add five headers to
# every answer that a router in production does not send.
STARTUP = {"RUDDER_DEBUG_HEADERS": "false"}


class RawClient:
    """One keep-alive HTTP/1.1 connection; POSTs a JSON body and reads a (chunked) response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_body = b""

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
            self.last_body = await r.readexactly(length)  # an error's text (bench/overload.py)
            ttft = time.perf_counter() - t0
        total = time.perf_counter() - t0
        if close:
            await self.close()
        return ttft, total, status


def request_body(max_tokens: int = MAX_TOKENS) -> bytes:
    return json.dumps({
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()


def split(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def latency(targets: list[Target], n: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    body = request_body(max_tokens)
    clients = {t.name: RawClient(*split(t.url)) for t in targets}
    samples: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "total": []} for k in clients}
    try:
        for _ in range(WARM_UP):  # warm up every path (connections, caches, allocators)
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
    return out


async def throughput(url: str, concurrency: int, seconds: float, max_requests: int,
                     max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Closed loop: ``concurrency`` connections each send the next request when one ends."""
    body = request_body(max_tokens)
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


@dataclass
class Target:
    """One thing the client calls: the worker (``direct``) or a router in front of it."""

    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None  # the router's process (CPU is its and its children's)
    calls: Path | None = None  # where cProfile writes its call counts (--count-calls)


def served(name: str, phases: list[dict[str, Any]], lat: dict[str, Any]) -> int:
    """Requests ``name`` answered in this run: the latency phase's (with its ``WARM_UP``
    requests) and every throughput phase's (answered or failed)."""
    return int(lat["requests_each"] + WARM_UP
               + sum(p["requests"] + p["errors"] for p in phases if p["target"] == name))


def compare(phases: list[dict[str, Any]], concurrencies: list[int], router: str) -> dict[str, Any]:
    """``router`` against the baseline at each concurrency (best phase of each), with each
    target's spread across rounds ((max - min) / mean of its phases): the run-to-run noise."""
    def rps(name: str, c: int) -> list[float]:
        return [p["rps"] for p in phases if p["target"] == name and p["concurrency"] == c]

    def spread(values: list[float]) -> float:
        return (max(values) - min(values)) / statistics.fmean(values) if len(values) > 1 else 0.0

    rows = [{"concurrency": c, "router_rps": max(rps(router, c)), "baseline_rps": max(rps("baseline", c)),
             "ratio": max(rps(router, c)) / max(rps("baseline", c)),
             "router_spread": spread(rps(router, c)), "baseline_spread": spread(rps("baseline", c)),
             "router_cpu_ms_per_request": cpu_ms_per_request(phases, router, c),
             "baseline_cpu_ms_per_request": cpu_ms_per_request(phases, "baseline", c)}
            for c in concurrencies]
    best_router = max(p["rps"] for p in phases if p["target"] == router)
    best_baseline = max(p["rps"] for p in phases if p["target"] == "baseline")
    return {"router": router, "by_concurrency": rows, "max_ratio": best_router / best_baseline}


def cpu_ms_per_request(phases: list[dict[str, Any]], name: str, c: int) -> float | None:
    """The target's own CPU per request (median of its phases at concurrency ``c``), in ms."""
    values = [p["cpu"]["process_cores"][name] * p["wall_s"] / p["requests"] * 1e3
              for p in phases if p["target"] == name and p["concurrency"] == c and p["requests"]
              and name in p["cpu"]["process_cores"]]
    return statistics.median(values) if values else None


def summarize(phases: list[dict[str, Any]], lat: dict[str, Any], names: list[str],
              concurrencies: list[int]) -> list[dict[str, Any]]:
    """Per target: best req/s at each concurrency and its share of direct's, TTFT p50/p99 of that
    phase, CPU per request, and the TTFT the target adds one request at a time."""
    def best(name: str, c: int) -> dict[str, Any]:
        return max((p for p in phases if p["target"] == name and p["concurrency"] == c), key=lambda p: p["rps"])

    def paired(name: str, c: int) -> float:
        """The median over rounds of the target's req/s over direct's in the same round: the
        best phases may come from different rounds, a round's pair shares its machine's state."""
        direct = {p["round"]: p["rps"] for p in phases if p["target"] == "direct" and p["concurrency"] == c}
        return statistics.median(p["rps"] / direct[p["round"]] for p in phases
                                 if p["target"] == name and p["concurrency"] == c and direct.get(p["round"]))

    out = []
    for name in names:
        row: dict[str, Any] = {"target": name, "by_concurrency": []}
        for c in concurrencies:
            b, d = best(name, c), best("direct", c)
            row["by_concurrency"].append({
                "concurrency": c, "rps": b["rps"], "share_of_direct": b["rps"] / d["rps"],
                "paired_share_of_direct": paired(name, c),
                "ttft_p50_ms": b["ttft_p50_ms"], "ttft_p99_ms": b["ttft_p99_ms"],
                "added_ttft_p50_ms": b["ttft_p50_ms"] - d["ttft_p50_ms"],
                "cpu_ms_per_request": cpu_ms_per_request(phases, name, c) if name != "direct" else None,
            })
        if name != "direct":
            row["added_ttft_p50_ms"] = lat[f"{name}_ttft_p50_ms"] - lat["direct_ttft_p50_ms"]
            row["added_ttft_p99_ms"] = lat[f"{name}_ttft_p99_ms"] - lat["direct_ttft_p99_ms"]
        out.append(row)
    return out


def print_summary(rows: list[dict[str, Any]], concurrencies: list[int]) -> None:
    cs = "/".join(str(c) for c in concurrencies)
    print("\nsame run, same client; best phase at each concurrency; % = of calling the worker directly")
    head = (f"{'target':<30}{'req/s at c=' + cs:>22}{'% of direct':>18}{'CPU ms/req':>20}"
            f"{'added TTFT p50/p99 (c=1, seq)':>31}{'TTFT p50 at c=' + str(concurrencies[-1]):>17}")
    print(head)
    print("-" * len(head))
    for r in rows:
        by = r["by_concurrency"]
        rps = "/".join(f"{x['rps']:.0f}" for x in by)
        share = "/".join(f"{x['share_of_direct'] * 100:.0f}" for x in by)
        cpu = "/".join("-" if x["cpu_ms_per_request"] is None else f"{x['cpu_ms_per_request']:.2f}" for x in by)
        added = (f"{r['added_ttft_p50_ms']:.2f}/{r['added_ttft_p99_ms']:.2f} ms" if "added_ttft_p50_ms" in r
                 else "-")
        print(f"{r['target']:<30}{rps:>22}{share:>18}{cpu:>20}{added:>31}{by[-1]['ttft_p50_ms']:>14.2f} ms")
    print("\n% of direct paired by round (median over rounds of the target's phase over the same round's"
          " direct phase):")
    for r in rows:
        paired = "/".join(f"{x['paired_share_of_direct'] * 100:.0f}" for x in r["by_concurrency"])
        print(f"  {r['target']:<28}{paired:>18}")


def print_gc(phases: list[dict[str, Any]], names: list[str], concurrencies: list[int]) -> None:
    """The Rudder routers' collector passes per 1,000 requests at each concurrency (all their
    phases): a request path that leaves reference cycles behind shows here (decision 114)."""
    rows = []
    for name in names:
        per = []
        for c in concurrencies:
            ps = [p for p in phases if p["target"] == name and p["concurrency"] == c and "gc_collections" in p]
            served = sum(p["requests"] + p["errors"] for p in ps)
            per.append(f"{1000 * sum(p['gc_collections'] for p in ps) / served:.2f}" if ps and served else "-")
        if any(x != "-" for x in per):
            rows.append(f"  {name:<28}{'/'.join(per)}")
    if rows:
        print(f"\nGC collections per 1,000 requests (the router's python_gc_collections_total), "
              f"c={'/'.join(str(c) for c in concurrencies)}:")
        print("\n".join(rows))


# -- the Rust router (bench-only virtual environment) ------------------------------------------------

VENVS = Path.home() / ".cache" / "rudder"
# package on PyPI → the module its launcher runs (``python -m``)
RUST_ROUTERS: dict[str, str] = {"vllm-router": "vllm_router.launch_router"}


def rust_python(package: str) -> Path:
    """The Python of a virtual environment holding ``package`` (a Rust router from PyPI), made
    under ~/.cache/rudder/ on first use and reused: never a dependency of the product."""
    venv = VENVS / f"bench-{package}"
    python = venv / "bin" / "python"
    module = RUST_ROUTERS[package]
    if python.exists() and subprocess.run([str(python), "-c", f"import {module.rsplit('.', 1)[0]}"],
                                          capture_output=True).returncode == 0:
        return python
    print(f"installing {package} into {venv} (bench only; reused next time)", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", package], check=True)
    return python


async def start_granian(bus: LocalBus, mode: str, log: Path) -> Target:
    """Rudder's router app (``--mode``) served by granian's ASGI interface instead of uvicorn:
    the HTTP server chosen by measurement (issue 16). granian is not a dependency of the product:
    ``pip install granian`` into the environment that runs the bench."""
    try:
        import granian  # noqa: F401
    except ImportError as exc:
        raise SystemExit("--servers granian needs granian in this environment: pip install granian") from exc
    port = free_port()
    env = {**router_env(bus, MODEL, port, mode=mode), **STARTUP}
    proc = spawn([sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--host", "127.0.0.1",
                  "--port", str(port), "--loop", "uvloop", "--workers", "1", "--http", "1", "--no-ws",
                  "--log-level", "warning", "router.app:asgi_app"], env, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until(url + "/health")
        await wait_until(url + "/v1/models", lambda body: body["data"][0].get("workers", 0) >= 1)
    except BaseException:
        stop_all([proc])  # not a target yet: nobody else stops it
        raise
    return Target(f"rudder {mode} (granian)", url, proc)


def start_rust(package: str, python: Path, policy: str, worker_url: str, log: Path | None) -> Target:
    port = free_port()
    cmd = [str(python), "-m", RUST_ROUTERS[package], "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", worker_url, "--policy", policy, "--log-level", "warning",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # one each
    proc = spawn(cmd, {}, log=log)
    return Target(f"{package} {policy}", f"http://127.0.0.1:{port}", proc)


FLOORS = {"python floor": [], "python floor (asgi)": ["--asgi"], "python floor (+work)": ["--work", MODEL]}


def start_floor(worker_url: str, log: Path | None, *, name: str, count_calls: Path | None = None) -> Target:
    """A Python floor (``bench/python_floor.py``): the least a reverse proxy in Python does per
    request, with none of a router's work (what Rudder costs above it is its own); ``+work``: the
    raw one doing Rudder's pure per-request work (parse, tokens, hashes, a real scheduler's
    selection, first-token and end commands) from its callbacks."""
    port = free_port()
    script = Path(__file__).resolve().parent / "python_floor.py"
    proc = spawn([*python_command(count_calls), str(script), "--port", str(port), "--upstream", worker_url,
                  *FLOORS[name]], {}, log=log)
    return Target(name, f"http://127.0.0.1:{port}", proc, count_calls)


async def wait_ok(url: str, *, within: float = 60.0) -> None:
    """Poll GET ``url`` until it answers 200 (any body)."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url, timeout=1)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {within:.0f}s")


def start_profiler(pid: int, path: Path, seconds: float, *, native: bool = False) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not found; no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", "200", "--format", "speedscope", "--output", str(path),
                             *(["--native"] if native else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def gc_collections(url: str) -> float | None:
    """The collector's passes so far in a Rudder router (``python_gc_collections_total``, every
    generation, from its /metrics), or None from one that does not report them (a router that
    does has collected at least once: its start's ``gc.collect()``)."""
    name = "python_gc_collections_total"
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            return (await metric_sums(client, url, [name]))[name] or None
    except httpx.HTTPError:
        return None


def process_tree(proc: subprocess.Popen[bytes]) -> list[int]:
    try:
        return [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return [proc.pid]


async def main(args: argparse.Namespace) -> None:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    policies = [p for p in args.rust_policies.split(",") if p] if args.rust != "none" else []
    rust = rust_python(args.rust) if policies else None
    with tempfile.TemporaryDirectory(prefix="po-") as tmp:
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        server = LocalBus(Path(tmp))
        server.start()
        fleet = Fleet(server, MODEL, 1, mock={"speedup_ratio": args.speedup}, launcher=args.launcher)
        routers: list[Router] = []
        targets: list[Target] = []
        try:
            await fleet.start()
            targets.append(Target("direct", fleet.urls[0]))
            counts = Path(args.count_calls) if args.count_calls else None
            if counts is not None:
                counts.mkdir(parents=True, exist_ok=True)

            def counted(name: str, counting: bool = True) -> Path | None:
                return counts / f"{name.replace(' ', '_')}.prof" if counts is not None and counting else None

            for mode in modes:
                calls = counted(f"rudder {mode}", mode == args.mode)
                r = Router(server, MODEL, mode=mode, launcher=args.launcher, log=log_dir / f"rudder-{mode}.log",
                           count_calls=calls, env=STARTUP)
                routers.append(r)
                await r.ready(1)
                targets.append(Target(f"rudder {mode}", r.url, r.proc, calls))
            if args.asgi:  # the same router with its express path off: every request a task, ASGI
                r = Router(server, MODEL, mode=args.mode, launcher=args.launcher,
                           log=log_dir / f"rudder-{args.mode}-asgi.log", count_calls=counted("asgi path"),
                           env={**STARTUP, "RUDDER_EXPRESS_PATH": "false"})
                routers.append(r)
                await r.ready(1)
                targets.append(Target(f"rudder {args.mode} (asgi path)", r.url, r.proc, counted("asgi path")))
            if "granian" in args.servers.split(","):
                targets.append(await start_granian(server, args.mode, log_dir / "rudder-granian.log"))
            if args.baseline:
                calls = counted("baseline")
                r = Router(server, MODEL, mode=args.mode, launcher=args.launcher, src=Path(args.baseline),
                           count_calls=calls, env=STARTUP)
                routers.append(r)
                await r.ready(1)
                targets.append(Target("baseline", r.url, r.proc, calls))
            for name in FLOORS if args.floor else ():
                log_name = name.replace(" (", "-").replace(")", "").replace(" ", "-").replace("+", "")
                t = start_floor(fleet.urls[0], log_dir / f"{log_name}.log", name=name, count_calls=counted(name))
                targets.append(t)
                await wait_ok(t.url + "/health")
            for policy in policies:
                assert rust is not None
                t = start_rust(args.rust, rust, policy, fleet.urls[0], log_dir / f"rust-{policy}.log")
                targets.append(t)
                await wait_ok(t.url + "/health")
            names = [t.name for t in targets]
            for t in targets:  # counting from here: what each served, not its start-up
                if t.calls is not None and t.proc is not None:
                    os.kill(t.proc.pid, signal.SIGUSR1)

            lat = await latency(targets, args.requests, args.max_tokens)
            print(f"latency, {args.requests} sequential requests to each target (alternating):")
            print(f"{'':<30}{'TTFT p50':>10}{'TTFT p99':>10}{'total p50':>11}{'total p99':>11}"
                  f"{'added TTFT p50':>16}{'p99':>8}")
            for name in names:
                added = ("" if name == "direct" else
                         f"{lat[f'{name}_ttft_p50_ms'] - lat['direct_ttft_p50_ms']:>14.2f}ms"
                         f"{lat[f'{name}_ttft_p99_ms'] - lat['direct_ttft_p99_ms']:>6.2f}ms")
                print(f"{name:<30}{lat[f'{name}_ttft_p50_ms']:>8.2f}ms{lat[f'{name}_ttft_p99_ms']:>8.2f}ms"
                      f"{lat[f'{name}_total_p50_ms']:>9.2f}ms{lat[f'{name}_total_p99_ms']:>9.2f}ms{added}")

            pids = {t.name: process_tree(t.proc) for t in targets if t.proc is not None}
            pids.update({"worker": [fleet.procs[0].pid], "client": [os.getpid()],
                         "nats": [server.server.proc.pid] if server.server.proc else []})
            profiled = next((t for t in targets if t.name == f"rudder {args.mode}"), None)
            phases: list[dict[str, Any]] = []
            for rnd in range(args.rounds):
                for c in concurrencies:
                    for t in targets:
                        prof = None
                        if (args.profile and profiled is not None and t is profiled and rnd == args.rounds - 1
                                and c == max(concurrencies) and profiled.proc is not None):
                            prof_dir = Path(args.profile)
                            prof = [start_profiler(profiled.proc.pid, prof_dir / "router.json", args.seconds,
                                                   native=args.profile_native),
                                    start_profiler(fleet.procs[0].pid, prof_dir / "worker.json", args.seconds)]
                        rudder = t.name.startswith("rudder") or t.name == "baseline"
                        gc_before = await gc_collections(t.url) if rudder else None
                        sampler = CpuSampler(pids)
                        sampler.start()
                        res = await throughput(t.url, c, args.seconds, args.max_requests, args.max_tokens)
                        res["cpu"] = sampler.stop()
                        gc_after = await gc_collections(t.url) if gc_before is not None else None
                        if gc_before is not None and gc_after is not None:
                            res["gc_collections"] = gc_after - gc_before
                        res["target"] = t.name
                        res["round"] = rnd
                        phases.append(res)
                        print(f"  round {rnd} c={c} {t.name}: {res['rps']:.0f} req/s, "
                              f"TTFT p50 {res['ttft_p50_ms']:.2f} ms", flush=True)
                        for p in prof or []:
                            if p is not None:
                                p.wait(args.seconds + 30)
            print(f"\nthroughput, closed loop, {args.seconds:.0f} s phases, best of {args.rounds} rounds:")
            print(f"{'target':<30}{'conc':>6}{'req/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
                  f"{'CPU own':>9}{'worker':>8}{'client':>8}{'machine':>9}")
            for c in concurrencies:
                for name in names:
                    rows = [p for p in phases if p["target"] == name and p["concurrency"] == c]
                    p = max(rows, key=lambda p: p["rps"])
                    pc = p["cpu"]["process_cores"]
                    own = f"{pc[name]:>9.2f}" if name in pc else f"{'-':>9}"
                    print(f"{name:<30}{c:>6}{p['rps']:>9.0f}{p['ttft_p50_ms']:>8.2f}ms{p['ttft_p99_ms']:>8.2f}ms"
                          f"{own}{pc['worker']:>8.2f}{pc['client']:>8.2f}{p['cpu']['machine_busy_pct']:>8.0f}%")
            summary = summarize(phases, lat, names, concurrencies)
            print_summary(summary, concurrencies)
            print_gc(phases, names, concurrencies)
            main_router = f"rudder {args.mode}"
            comparison = compare(phases, concurrencies, main_router) if args.baseline else None
            if comparison is not None:
                print(f"\n{main_router} / baseline (best phase each), and each target's spread across rounds:")
                for row in comparison["by_concurrency"]:
                    print(f"  concurrency {row['concurrency']:>3}: {row['ratio'] * 100:6.1f}%  "
                          f"(router spread {row['router_spread'] * 100:.1f}%, "
                          f"baseline spread {row['baseline_spread'] * 100:.1f}%); CPU per request "
                          f"{row['router_cpu_ms_per_request']:.3f} vs {row['baseline_cpu_ms_per_request']:.3f} ms")
            best = {name: max(p["rps"] for p in phases if p["target"] == name) for name in names}
            print("\nmax req/s: " + ", ".join(f"{n} {best[n]:.0f} ({best[n] / best['direct'] * 100:.0f}%)"
                                             for n in names))
        finally:
            # Every target's process (Rudder's, granian's, the Rust routers'), then any router that
            # never became a target (it did not get ready).
            stop_all(t.proc for t in targets if t.proc is not None)
            for r in routers:
                r.stop()
            fleet.stop()
            server.stop()
    call_counts = {t.name: python_calls(t.calls, served(t.name, phases, lat)) for t in targets
                   if t.calls is not None and t.calls.exists()}
    if call_counts:
        print("\nPython function calls per request (cProfile; a count, steady on a busy machine; this "
              "run's timings of these targets are not to be read):")
        for name, counted_calls in call_counts.items():
            print(f"  {name:<28}{counted_calls['calls_per_request']:>9.0f}   top: "
                  + ", ".join(f"{row['function']} {row['calls_per_request']:.1f}" for row in counted_calls["top"][:4]))
    out = {
        "benchmark": "proxy_overhead", **machine(), "mode": args.mode, "modes": modes, "launcher": args.launcher,
        "servers": args.servers.split(","), "python_floor": args.floor,
        "rust_router": {"package": args.rust, "policies": policies,
                        "version": rust_version(rust, args.rust) if rust is not None else None},
        "speedup_ratio": args.speedup, "prompt_chars": len(PROMPT), "max_tokens": args.max_tokens,
        "seconds": args.seconds, "rounds": args.rounds,
        "note": ("streamed /v1/completions; TTFT = send -> first body chunk; latency phase alternates "
                 "the targets one request at a time; throughput = closed loop, best phase; CPU per "
                 "request = the router process tree's CPU over the phase / its requests (median)"),
        "latency": lat, "throughput_phases": phases, "summary": summary,
        "max_rps": {**best, "router": best.get(main_router, 0.0),
                    "router_share_of_direct": best.get(main_router, 0.0) / best["direct"]},
    }
    if comparison is not None:
        out["baseline"] = {"src": args.baseline, **comparison}
    if call_counts:
        out["python_calls"] = call_counts
    path = write_result(args.output, out)
    print(f"wrote {path}")


def rust_version(python: Path, package: str) -> str:
    r = subprocess.run([str(python), "-m", "pip", "show", package], capture_output=True, text=True)
    return next((line.split(":", 1)[1].strip() for line in r.stdout.splitlines() if line.startswith("Version:")),
                "unknown")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="sequential requests each way (latency)")
    p.add_argument("--concurrency", default="1,8,32", help="closed-loop concurrencies (throughput)")
    p.add_argument("--seconds", type=float, default=5.0, help="length of one throughput phase")
    p.add_argument("--max-requests", type=int, default=20000, help="cap per throughput phase")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--speedup", type=float, default=1000.0, help="mock speedup_ratio")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help="output tokens per request (a streamed chunk each: more measures the relay per chunk)")
    p.add_argument("--mode", default="kv", help="the Rudder mode profiled and compared with --baseline")
    p.add_argument("--modes", default="kv,round_robin", help="Rudder routers, one per mode")
    p.add_argument("--asgi", action="store_true",
                   help="also a --mode router with its express path off (RUDDER_EXPRESS_PATH=false)")
    p.add_argument("--rust", default="vllm-router", choices=(*RUST_ROUTERS, "none"),
                   help="a Rust router from PyPI, in a bench-only venv under ~/.cache/rudder/")
    p.add_argument("--rust-policies", default="round_robin,cache_aware", help="one Rust router per policy")
    p.add_argument("--log-dir", default="", help="keep the routers' logs here")
    p.add_argument("--launcher", default="cli", choices=("cli", "module"),
                   help="cli = rudder serve (uvloop, as deployed); module = python -m (asyncio loop)")
    p.add_argument("--profile", default="", help="py-spy speedscope profiles of Rudder --mode and the worker here")
    p.add_argument("--profile-native", action="store_true", help="the router's profile with native frames")
    p.add_argument("--servers", default="uvicorn",
                   help="uvicorn (as shipped), or uvicorn,granian: also Rudder --mode under granian's ASGI server")
    p.add_argument("--floor", action="store_true",
                   help="also the Python floors (bench/python_floor.py): a bare reverse proxy in Python, "
                        "on raw protocols, as an ASGI app under uvicorn, and on raw protocols doing "
                        "Rudder's pure per-request work")
    p.add_argument("--count-calls", default="",
                   help="run Rudder --mode, the baseline and the floors under cProfile, their profiles here, and "
                        "report Python function calls per request (a count: steady where timings are noise)")
    p.add_argument("--baseline", default="", help="also run a Rudder router from this checkout (e.g. /work/main)")
    p.add_argument("--output", default="proxy_overhead")
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.baseline:
        arguments.baseline = str(Path(arguments.baseline).resolve())
    if arguments.profile:
        Path(arguments.profile).mkdir(parents=True, exist_ok=True)
    asyncio.run(main(arguments))
