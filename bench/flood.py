"""Flood from one worker credential: do chats to the other workers stay fast, and the router's
memory bounded? (issue 17, "Must show").

One embedded nats-server, three mock workers (``rudder serve worker``, each with its own
credential) and one router (``rudder serve router``, its caps and rate limits at their defaults
unless ``--kv-cap`` / ``--router-env`` say otherwise), each its own process on 127.0.0.1. One of
the workers is hostile: a further process (this file with ``--flooder``) holds *its* credential
and publishes on its own subjects, which NATS lets through:

- ``heartbeat``: its own membership record re-sent ~10k times a second (500 per 50 ms);
- ``kv``: KV ``stored`` events of 2,000 blocks it never computed, 20 per 50 ms (~800k claimed
  blocks/s), each with a fresh event id (tests/support_router/hostile.py builds both, for the
  claims tests too).

Phases, in one run: ``quiet`` (no flood), ``heartbeat`` and ``kv`` (the flood runs, is first seen
dropped on the router's ``/metrics``, then chats are timed while it goes on; it is stopped when the
phase ends, or after ``--max-flood-seconds`` in any case). In each phase a closed loop of
``--concurrency`` clients sends non-streamed chats with distinct prompts for ``--seconds`` and at
least ``--min-chats`` chats; latencies are split by the worker that answered (the router's debug
header): the figure is the honest workers' p50/p99/max, and the ratio flood p99 / quiet p99.
Alongside: the router's RSS (``/proc``, sampled every 100 ms: before, peak per phase), the blocks
its prefix index holds of the hostile worker against its cap, the drops it counts
(``rudder_router_bus_dropped_total``), the workers it lists, and nats-server's slow consumers.

    python bench/flood.py                      # table on stdout, bench/results/flood.json
    python bench/flood.py --seconds 3 --min-chats 50 --output flood_smoke   # a quick look
    python bench/flood.py --profile /tmp/prof  # + a py-spy profile of the router in each flood
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CpuSampler, Fleet, Router, machine, pct, spawn, stop_all, write_result
from bus.connect import BusOptions, connect
from bus.identities import Identity, IdentityKind
from cli.embedded import LocalBus
from controlplane.protocol.events import MembershipEvent
from controlplane.protocol.subjects import STREAM_MEMBERSHIP, membership_subject
from tests.support_router.hostile import KvFlood, forged_heartbeat, heartbeat_step, kv_step, publishing

MODEL = "bench-flood"
SCRIPT = Path(__file__).resolve()
FLOODS = ("heartbeat", "kv")
_DROP = re.compile(r'^rudder_router_bus_dropped_total\{kind="([^"]+)",reason="([^"]+)"\} (\S+)$', re.M)
_HELD = re.compile(r'^rudder_router_prefix_index_blocks\{instance_id="(\d+)",model="[^"]*"\} (\S+)$', re.M)
_REFUSED = re.compile(r"^rudder_router_prefix_index_refused_blocks_total (\S+)$", re.M)


# -- the flooder (a process of its own, holding the hostile worker's credential) -----------------

async def flood(args: argparse.Namespace, beat: bytes) -> dict[str, float]:
    """Publish ``args.flooder`` messages until SIGTERM or ``--max-flood-seconds``; how many."""
    opts = BusOptions.from_settings(nats_url=os.environ["RUDDER_NATS_URL"],
                                    nats_creds=Path(os.environ["RUDDER_NATS_CREDS"]), nats_ca=None,
                                    name="bench-flooder")
    nc = await connect(opts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    sent = 0
    if args.flooder == "heartbeat":
        inner = heartbeat_step(nc, MODEL, args.instance_id, beat, per_step=500)
        per = 500
    else:
        inner = kv_step(nc, MODEL, args.instance_id, KvFlood(args.instance_id, blocks=2000), per_step=20)
        per = 20

    async def step() -> None:
        nonlocal sent
        await inner()
        sent += per

    t0 = time.monotonic()
    try:
        async with publishing(step):
            await asyncio.wait_for(stop.wait(), args.max_flood_seconds)
    except TimeoutError:
        pass
    finally:
        wall = time.monotonic() - t0
        await nc.close()
    return {"messages": sent, "seconds": wall}


def run_flooder(args: argparse.Namespace) -> None:
    beat = Path(args.heartbeat_file).read_bytes() if args.flooder == "heartbeat" else b""
    Path(args.report).write_text(json.dumps(asyncio.run(flood(args, beat))))


# -- what the router shows -----------------------------------------------------------------------

@dataclass
class Scrape:
    drops: dict[str, float]  # "kind/reason" → count
    held: dict[int, float]  # instance id → blocks in the prefix index
    refused: float
    slow_consumers: int


async def scrape(http: httpx.AsyncClient, router: str, monitor: str) -> Scrape:
    text = (await http.get(router + "/metrics", timeout=10)).text
    varz = (await http.get(monitor + "/varz", timeout=10)).json()
    refused = _REFUSED.search(text)
    return Scrape(drops={f"{k}/{r}": float(v) for k, r, v in _DROP.findall(text)},
                  held={int(w): float(v) for w, v in _HELD.findall(text)},
                  refused=float(refused.group(1)) if refused else 0.0,
                  slow_consumers=int(varz.get("slow_consumers", 0)))


def rss_bytes(pids: list[int]) -> int:
    """Resident set of these processes, from /proc/<pid>/status (VmRSS, kB)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


@dataclass
class Watch:
    """Samples the router's RSS and the workers it lists, every 100 ms, while a phase runs."""

    pids: list[int]
    router: str
    rss_peak: int = 0
    listed: list[int] = field(default_factory=list)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=5) as http:
            n = 0
            while True:
                self.rss_peak = max(self.rss_peak, rss_bytes(self.pids))
                if n % 5 == 0:  # the listed workers twice a second
                    try:
                        body = (await http.get(self.router + "/v1/models")).json()
                        self.listed.append(int(body["data"][0].get("workers", 0)))
                    except (httpx.HTTPError, ValueError, KeyError, IndexError):
                        self.listed.append(-1)
                n += 1
                await asyncio.sleep(0.1)


# -- the chats -----------------------------------------------------------------------------------

async def chats(router: str, *, concurrency: int, seconds: float, min_chats: int, max_tokens: int,
                max_seconds: float) -> tuple[dict[int, list[float]], Counter[int], float]:
    """Closed loop: latencies (s) by the worker that answered, and errors by status (0 = no answer)."""
    by_worker: dict[int, list[float]] = {}
    errors: Counter[int] = Counter()
    t0 = time.perf_counter()
    stop_at, give_up = t0 + seconds, t0 + max_seconds

    def done() -> int:
        return sum(len(v) for v in by_worker.values()) + sum(errors.values())

    async def loop(http: httpx.AsyncClient) -> None:
        while (time.perf_counter() < stop_at or done() < min_chats) and time.perf_counter() < give_up:
            body = {"model": MODEL, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} what is a flood?"}]}
            start = time.perf_counter()
            try:
                r = await http.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                errors[0] += 1
                continue
            took = time.perf_counter() - start
            if r.status_code != 200:
                errors[r.status_code] += 1
                continue
            by_worker.setdefault(int(r.headers["x-worker-instance-id"]), []).append(took)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=router, timeout=30, limits=limits) as http:
        await asyncio.gather(*(loop(http) for _ in range(concurrency)))
    return by_worker, errors, time.perf_counter() - t0


def latency(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50_ms": pct(values, 0.5) * 1e3, "p99_ms": pct(values, 0.99) * 1e3,
            "max_ms": max(values, default=float("nan")) * 1e3}


# -- one run -------------------------------------------------------------------------------------

async def hostile_heartbeat(bus: LocalBus, instance_id: int) -> bytes:
    """The hostile worker's own last heartbeat, read back from the membership stream (as the bus
    admin), re-stamped: what its credential's holder would re-send."""
    nc = await connect(bus.options(Identity(IdentityKind.ADMIN), name="bench-flood-admin"))
    try:
        msg = await nc.jetstream().get_last_msg(STREAM_MEMBERSHIP, membership_subject(MODEL, instance_id))
        assert msg.data is not None
        return forged_heartbeat(MembershipEvent.model_validate_json(msg.data).worker)
    finally:
        await nc.close()


def start_profiler(pid: int, path: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not found; no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
                             "--rate", "100", "--format", "speedscope", "--output", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def phase(name: str, args: argparse.Namespace, *, router: Router, monitor: str, bus: LocalBus,
                fleet: Fleet, pids: list[int], tmp: Path, beat: bytes) -> dict[str, Any]:
    hostile = fleet.instance_ids[0]
    flooder: subprocess.Popen[bytes] | None = None
    report = tmp / f"flood-{name}.json"
    async with httpx.AsyncClient() as http:
        before = await scrape(http, router.url, monitor)
        rss_before = rss_bytes(pids)
        watch = Watch(pids, router.url, rss_peak=rss_before)
        watcher = asyncio.create_task(watch.run())
        flood_seen_s = 0.0
        try:
            if name in FLOODS:
                (tmp / "beat").write_bytes(beat)
                env = {**bus.env(Identity(IdentityKind.WORKER, model=MODEL, instance_id=hostile))}
                cmd = [sys.executable, str(SCRIPT), "--flooder", name,
                       "--instance-id", str(hostile), "--heartbeat-file", str(tmp / "beat"),
                       "--report", str(report), "--max-flood-seconds", str(args.max_flood_seconds)]
                t_flood = time.monotonic()
                flooder = spawn(cmd, env, log=tmp / f"flooder-{name}.log")
                kind = "membership" if name == "heartbeat" else "kv"
                deadline = time.monotonic() + 30
                while True:  # the flood is on once the router counts it dropped
                    now = await scrape(http, router.url, monitor)
                    if now.drops.get(f"{kind}/rate_limited", 0) > before.drops.get(f"{kind}/rate_limited", 0):
                        break
                    if time.monotonic() > deadline or flooder.poll() is not None:
                        raise RuntimeError(f"{name} flood not seen dropped within 30 s (see {tmp})")
                    await asyncio.sleep(0.1)
                flood_seen_s = time.monotonic() - t_flood
            prof = (start_profiler(router.proc.pid, Path(args.profile) / f"router-{name}.json", args.seconds)
                    if args.profile else None)
            sampler = CpuSampler({"router": pids, "workers": [p.pid for p in fleet.procs],
                                  **({"flooder": [flooder.pid]} if flooder else {})})
            sampler.start()
            by_worker, errors, wall = await chats(
                router.url, concurrency=args.concurrency, seconds=args.seconds, min_chats=args.min_chats,
                max_tokens=args.max_tokens, max_seconds=args.max_flood_seconds - flood_seen_s - 5)
            cpu = sampler.stop()
            if prof is not None:
                prof.wait(args.seconds + 30)
        finally:
            if flooder is not None:
                stop_all([flooder])
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        after = await scrape(http, router.url, monitor)
    honest = [t for w, v in by_worker.items() if w != hostile for t in v]
    sent = json.loads(report.read_text()) if report.exists() else None
    keys = sorted(set(before.drops) | set(after.drops))
    return {
        "phase": name, "wall_s": wall, "chats": sum(len(v) for v in by_worker.values()),
        "errors": {str(k): v for k, v in errors.items()},
        "honest": latency(honest), "hostile": latency(by_worker.get(hostile, [])),
        "hostile_share": len(by_worker.get(hostile, [])) / max(1, sum(len(v) for v in by_worker.values())),
        "listed_workers_min": min(watch.listed, default=-1),
        "rss_before_mb": rss_before / 2**20, "rss_peak_mb": watch.rss_peak / 2**20,
        "rss_after_mb": rss_bytes(pids) / 2**20,
        "hostile_index_blocks": after.held.get(hostile, 0.0),
        "honest_index_blocks": {str(w): after.held.get(w, 0.0) for w in fleet.instance_ids[1:]},
        "index_refused_blocks": after.refused - before.refused,
        "drops": {k: after.drops.get(k, 0) - before.drops.get(k, 0) for k in keys
                  if after.drops.get(k, 0) != before.drops.get(k, 0)},
        "nats_slow_consumers": after.slow_consumers - before.slow_consumers,
        "flood": None if sent is None else {**sent, "per_s": sent["messages"] / max(sent["seconds"], 1e-9),
                                            "seen_dropped_after_s": flood_seen_s},
        "cpu": cpu,
    }


async def main(args: argparse.Namespace) -> None:
    floods = [f for f in args.floods.split(",") if f]
    if not set(floods) <= set(FLOODS):
        raise SystemExit(f"--floods: each of {', '.join(FLOODS)}, not {args.floods!r}")
    phases = ["quiet", *floods, *(["after"] if args.after else [])]
    router_env = {f"RUDDER_{k.upper()}": v for k, v in (kv.split("=", 1) for kv in args.router_env)}
    if args.kv_cap:
        router_env["RUDDER_CLAIM_MAX_KV_BLOCKS"] = str(args.kv_cap)
    cap = int(router_env.get("RUDDER_CLAIM_MAX_KV_BLOCKS", 262_144))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flood-") as tmp_name:
        tmp = Path(tmp_name)
        log_dir = Path(args.log_dir) if args.log_dir else tmp
        log_dir.mkdir(parents=True, exist_ok=True)
        bus = LocalBus(tmp / "bus")
        bus.start()
        monitor = f"http://127.0.0.1:{bus.server.monitor_port}"
        fleet = Fleet(bus, MODEL, 3, mock={"speedup_ratio": args.speedup}, log_dir=log_dir)
        router: Router | None = None
        try:
            await fleet.start()
            router = Router(bus, MODEL, log=log_dir / "router.log", env=router_env)
            await router.ready(3)
            pids = [router.proc.pid]
            try:
                pids += [c.pid for c in psutil.Process(router.proc.pid).children(recursive=True)]
            except psutil.Error:
                pass
            beat = await hostile_heartbeat(bus, fleet.instance_ids[0])
            # warm up every path (connections, tokenizer, allocators) before the quiet figure
            await chats(router.url, concurrency=args.concurrency, seconds=1, min_chats=50,
                        max_tokens=args.max_tokens, max_seconds=30)
            rss_start = rss_bytes(pids)
            for name in phases:
                res = await phase(name, args, router=router, monitor=monitor, bus=bus, fleet=fleet,
                                  pids=pids, tmp=tmp, beat=beat)
                results.append(res)
                h = res["honest"]
                print(f"  {name}: {res['chats']} chats, honest p99 {h['p99_ms']:.1f} ms, "
                      f"RSS peak {res['rss_peak_mb']:.0f} MB", flush=True)
        finally:
            if router is not None:
                router.stop()
            fleet.stop()
            bus.stop()
    quiet = results[0]["honest"]["p99_ms"]
    ratios = {r["phase"]: r["honest"]["p99_ms"] / quiet for r in results[1:]}
    print_table(results, ratios, cap, rss_start)
    out = {
        "benchmark": "flood", **machine(),
        "note": ("3 mock workers (rudder serve worker), one router (rudder serve router), one flooder "
                 "process with worker 0's credential; chats: non-streamed, distinct prompts, closed loop; "
                 "honest = answered by workers 1-2; ratio = flood p99 / quiet p99 of the honest chats"),
        "settings": {"seconds": args.seconds, "min_chats": args.min_chats, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "speedup_ratio": args.speedup, "router_env": router_env,
                     "claim_max_kv_blocks": cap},
        "rss_start_mb": rss_start / 2**20, "p99_ratio": ratios, "phases": results,
    }
    path = write_result(args.output, out)
    print(f"wrote {path}")


def print_table(results: list[dict[str, Any]], ratios: dict[str, float], cap: int, rss_start: int) -> None:
    print(f"\nchats to the honest workers (ms), router RSS (MB; {rss_start / 2**20:.0f} before the "
          f"phases), hostile worker's prefix-index blocks (cap {cap})")
    head = (f"{'phase':<10}{'chats':>7}{'err':>5}{'p50':>8}{'p99':>8}{'max':>8}{'p99 x':>7}{'RSS peak':>10}"
            f"{'held':>9}{'refused':>10}{'dropped':>10}{'listed':>7}{'slow':>6}{'flood/s':>10}")
    print(head)
    print("-" * len(head))
    for r in results:
        h = r["honest"]
        dropped = sum(v for k, v in r["drops"].items() if k.endswith("/rate_limited"))
        rate = f"{r['flood']['per_s']:.0f}" if r["flood"] else "-"
        ratio = f"{ratios[r['phase']]:.2f}" if r["phase"] in ratios else "-"
        print(f"{r['phase']:<10}{r['chats']:>7}{sum(r['errors'].values()):>5}{h['p50_ms']:>8.1f}"
              f"{h['p99_ms']:>8.1f}{h['max_ms']:>8.1f}{ratio:>7}{r['rss_peak_mb']:>10.0f}"
              f"{r['hostile_index_blocks']:>9.0f}{r['index_refused_blocks']:>10.0f}{dropped:>10.0f}"
              f"{r['listed_workers_min']:>7}{r['nats_slow_consumers']:>6}{rate:>10}")
    print("p99 x = the phase's honest p99 / the quiet phase's; flood/s = messages the flooder published "
          "(heartbeats, or KV events of 2,000 blocks)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=15.0, help="length of each phase's chats")
    p.add_argument("--min-chats", type=int, default=300, help="at least this many chats per phase")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--speedup", type=float, default=20.0, help="mock speedup_ratio")
    p.add_argument("--max-flood-seconds", type=float, default=120.0, help="a flood stops after this in any case")
    p.add_argument("--kv-cap", type=int, default=0, help="RUDDER_CLAIM_MAX_KV_BLOCKS (0: the router's default)")
    p.add_argument("--router-env", action="append", default=[], metavar="NAME=VALUE",
                   help="a further router setting, e.g. kv_event_bytes_per_s=2097152 (repeatable)")
    p.add_argument("--floods", default=",".join(FLOODS), help="the flood phases, in this order")
    p.add_argument("--after", action="store_true", help="a further quiet phase after the floods")
    p.add_argument("--profile", default="", help="py-spy speedscope profiles of the router here")
    p.add_argument("--log-dir", default="", help="keep the processes' logs here")
    p.add_argument("--output", default="flood")
    # the flooder process
    p.add_argument("--flooder", choices=FLOODS, help=argparse.SUPPRESS)
    p.add_argument("--instance-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--heartbeat-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--report", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.profile:
        Path(arguments.profile).mkdir(parents=True, exist_ok=True)
    if arguments.flooder:
        run_flooder(arguments)
    else:
        asyncio.run(main(arguments))
