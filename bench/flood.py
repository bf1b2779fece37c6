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

For each flood kind, one flooder process runs and is paused and resumed (SIGUSR1 / SIGUSR2):
``--rounds`` times a quiet window, then a flood window (each starts once the router's
``rate_limited`` drop count stands still, or grows again), so both kinds of window see the same
machine (other sessions load it; a quiet phase a minute earlier is no baseline). In each window a
closed loop of ``--concurrency`` clients sends non-streamed chats with distinct prompts for
``--seconds`` (and, over the rounds, at least ``--min-chats``); latencies are split by the worker
that answered (the router's debug header): the figure is the honest workers' p50/p99/max over the
pooled windows, and the ratio flood p99 / quiet p99. Alongside: the router's RSS (``/proc``,
sampled every 100 ms: before, peak), the blocks its prefix index holds of the hostile worker
(``rudder_router_prefix_index_blocks``) against its cap, the drops it counts
(``rudder_router_bus_dropped_total``), the fewest workers it listed, nats-server's slow consumers.

    python bench/flood.py                      # table on stdout, bench/results/flood.json
    python bench/flood.py --seconds 2 --rounds 2 --min-chats 40 --output flood_smoke  # a quick look
    python bench/flood.py --floods kv --router-env kv_event_bytes_per_s=1048576   # other limits
    python bench/flood.py --router-src /work/main --output flood_before   # the router of another tree
    python bench/flood.py --profile /tmp/prof  # + py-spy profiles of the router (last flood window)
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
    """Publish ``args.flooder`` messages until SIGTERM or ``--max-flood-seconds`` (SIGUSR1 pauses,
    SIGUSR2 resumes); how many, over how many seconds of flooding."""
    opts = BusOptions.from_settings(nats_url=os.environ["RUDDER_NATS_URL"],
                                    nats_creds=Path(os.environ["RUDDER_NATS_CREDS"]), nats_ca=None,
                                    name="bench-flooder")
    nc = await connect(opts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    on = [True]
    flooding = [0.0, time.monotonic()]  # seconds flooded before the last resume, last resume

    def pause() -> None:
        if on[0]:
            flooding[0] += time.monotonic() - flooding[1]
        on[0] = False

    def resume() -> None:
        if not on[0]:
            flooding[1] = time.monotonic()
        on[0] = True

    loop.add_signal_handler(signal.SIGUSR1, pause)
    loop.add_signal_handler(signal.SIGUSR2, resume)
    sent = 0
    if args.flooder == "heartbeat":
        inner = heartbeat_step(nc, MODEL, args.instance_id, beat, per_step=500)
        per = 500
    else:
        inner = kv_step(nc, MODEL, args.instance_id, KvFlood(args.instance_id, blocks=2000), per_step=20)
        per = 20

    async def step() -> None:
        nonlocal sent
        if on[0]:
            await inner()
            sent += per

    try:
        async with publishing(step):
            await asyncio.wait_for(stop.wait(), args.max_flood_seconds)
    except TimeoutError:
        pass
    finally:
        pause()
        await nc.close()
    return {"messages": sent, "seconds": flooding[0]}


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

timeline: list[tuple[float, float]] = []  # (sent, s after the window began; took, s) of the last window


async def chats(router: str, *, concurrency: int, seconds: float, min_chats: int, max_tokens: int,
                max_seconds: float) -> tuple[dict[int, list[float]], Counter[int], float]:
    """Closed loop: latencies (s) by the worker that answered, and errors by status (0 = no answer)."""
    by_worker: dict[int, list[float]] = {}
    errors: Counter[int] = Counter()
    timeline.clear()
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
            timeline.append((start - t0, took))

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


async def window(args: argparse.Namespace, router: Router, cpu_pids: dict[str, list[int]],
                 chats_min: int, profile: Path | None) -> dict[str, Any]:
    """One window of chats (``--seconds``, at least ``chats_min``), with CPU per process."""
    prof = start_profiler(router.proc.pid, profile, args.seconds) if profile is not None else None
    sampler = CpuSampler(cpu_pids)
    sampler.start()
    by_worker, errors, wall = await chats(router.url, concurrency=args.concurrency, seconds=args.seconds,
                                          min_chats=chats_min, max_tokens=args.max_tokens,
                                          max_seconds=max(30.0, 4 * args.seconds))
    cpu = sampler.stop()
    if prof is not None:
        prof.wait(args.seconds + 30)
    slow = sorted(timeline, key=lambda x: -x[1])[:5]  # when the slowest chats were sent
    return {"by_worker": by_worker, "errors": errors, "wall_s": wall, "cpu": cpu,
            "slowest": [(round(at, 3), round(took * 1e3, 1)) for at, took in slow]}


async def settle(http: httpx.AsyncClient, router: Router, monitor: str, key: str, *, flooding: bool) -> float:
    """Wait until the router's ``key`` drop count grows (``flooding``) or stands still for 0.5 s
    (the flood paused and what was in flight drained); the seconds it took."""
    t0 = time.monotonic()
    last = (await scrape(http, router.url, monitor)).drops.get(key, 0)
    still_since = time.monotonic()
    while time.monotonic() - t0 < 30:
        await asyncio.sleep(0.1)
        now = (await scrape(http, router.url, monitor)).drops.get(key, 0)
        if flooding and now > last:
            return time.monotonic() - t0
        if not flooding:
            if now != last:
                still_since = time.monotonic()
            elif time.monotonic() - still_since >= 0.5:
                return time.monotonic() - t0
        last = now
    raise RuntimeError(f"the router's {key} drops did not {'grow' if flooding else 'settle'} within 30 s")


def summary(name: str, windows: list[dict[str, Any]], hostile: int) -> dict[str, Any]:
    by_worker: dict[int, list[float]] = {}
    errors: Counter[int] = Counter()
    for w in windows:
        for wid, v in w["by_worker"].items():
            by_worker.setdefault(wid, []).extend(v)
        errors.update(w["errors"])
    honest = [t for wid, v in by_worker.items() if wid != hostile for t in v]
    total = sum(len(v) for v in by_worker.values())
    cores = [w["cpu"]["process_cores"] for w in windows]
    return {
        "phase": name, "windows": len(windows), "wall_s": sum(w["wall_s"] for w in windows), "chats": total,
        "errors": {str(k): v for k, v in errors.items()},
        "honest": latency(honest), "hostile": latency(by_worker.get(hostile, [])),
        "hostile_share": len(by_worker.get(hostile, [])) / max(1, total),
        "cpu_cores": {k: sum(c.get(k, 0.0) for c in cores) / len(cores) for k in cores[0]},
        "machine_busy_pct": sum(w["cpu"]["machine_busy_pct"] for w in windows) / len(windows),
        "slowest_by_window": [w["slowest"] for w in windows],
    }


async def campaign(kind: str, args: argparse.Namespace, *, router: Router, monitor: str, bus: LocalBus,
                   fleet: Fleet, pids: list[int], tmp: Path) -> dict[str, Any]:
    """One flood kind: the flooder starts, then ``--rounds`` times a quiet window (flood paused)
    and a flood window, so both see the same machine (others share it); the pooled figures."""
    hostile = fleet.instance_ids[0]
    report = tmp / f"flood-{kind}.json"
    key = ("membership" if kind == "heartbeat" else "kv") + "/rate_limited"
    per_window = -(-args.min_chats // args.rounds)
    quiet: list[dict[str, Any]] = []
    flooded: list[dict[str, Any]] = []
    async with httpx.AsyncClient() as http:
        before = await scrape(http, router.url, monitor)
        rss_before = rss_bytes(pids)
        watch = Watch(pids, router.url, rss_peak=rss_before)
        cmd = [sys.executable, str(SCRIPT), "--flooder", kind, "--instance-id", str(hostile),
               "--heartbeat-file", str(tmp / "beat"), "--report", str(report),
               "--max-flood-seconds", str(args.max_flood_seconds)]
        env = bus.env(Identity(IdentityKind.WORKER, model=MODEL, instance_id=hostile))
        flooder = spawn(cmd, env, log=tmp / f"flooder-{kind}.log")
        cpu_pids = {"router": pids, "workers": [p.pid for p in fleet.procs], "flooder": [flooder.pid],
                    "nats": [bus.server.proc.pid] if bus.server.proc else []}
        watcher = asyncio.create_task(watch.run())
        seen = 0.0
        try:
            seen = await settle(http, router, monitor, key, flooding=True)
            for rnd in range(args.rounds):
                os.kill(flooder.pid, signal.SIGUSR1)
                await settle(http, router, monitor, key, flooding=False)
                quiet.append(await window(args, router, cpu_pids, per_window, None))
                os.kill(flooder.pid, signal.SIGUSR2)
                await settle(http, router, monitor, key, flooding=True)
                profile = (Path(args.profile) / f"router-{kind}.json"
                           if args.profile and rnd == args.rounds - 1 else None)
                flooded.append(await window(args, router, cpu_pids, per_window, profile))
                print(f"    {kind} round {rnd}: honest p99 quiet "
                      f"{summary('', quiet[-1:], hostile)['honest']['p99_ms']:.1f} ms, flood "
                      f"{summary('', flooded[-1:], hostile)['honest']['p99_ms']:.1f} ms", flush=True)
        finally:
            stop_all([flooder])
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        after = await scrape(http, router.url, monitor)
    sent = json.loads(report.read_text()) if report.exists() else None
    keys = sorted(set(before.drops) | set(after.drops))
    q, f = summary("quiet", quiet, hostile), summary(kind, flooded, hostile)
    return {
        "flood": kind, "quiet": q, "flooded": f, "p99_ratio": f["honest"]["p99_ms"] / q["honest"]["p99_ms"],
        "listed_workers_min": min(watch.listed, default=-1),
        "rss_before_mb": rss_before / 2**20, "rss_peak_mb": watch.rss_peak / 2**20,
        "rss_after_mb": rss_bytes(pids) / 2**20,
        "hostile_index_blocks": after.held.get(hostile, 0.0),
        "honest_index_blocks": {str(w): after.held.get(w, 0.0) for w in fleet.instance_ids[1:]},
        "index_refused_blocks": after.refused - before.refused,
        "drops": {k: after.drops.get(k, 0) - before.drops.get(k, 0) for k in keys
                  if after.drops.get(k, 0) != before.drops.get(k, 0)},
        "nats_slow_consumers": after.slow_consumers - before.slow_consumers,
        "flooder": None if sent is None else {
            **sent, "per_s": sent["messages"] / max(sent["seconds"], 1e-9), "seen_dropped_after_s": seen},
    }


async def main(args: argparse.Namespace) -> None:
    floods = [f for f in args.floods.split(",") if f]
    if not set(floods) <= set(FLOODS):
        raise SystemExit(f"--floods: each of {', '.join(FLOODS)}, not {args.floods!r}")
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
            router = Router(bus, MODEL, log=log_dir / "router.log", env=router_env,
                            src=Path(args.router_src) if args.router_src else None)
            await router.ready(3)
            pids = [router.proc.pid]
            try:
                pids += [c.pid for c in psutil.Process(router.proc.pid).children(recursive=True)]
            except psutil.Error:
                pass
            beat = await hostile_heartbeat(bus, fleet.instance_ids[0])
            (tmp / "beat").write_bytes(beat)
            # warm up every path (connections, tokenizer, allocators) before the first figure
            await chats(router.url, concurrency=args.concurrency, seconds=1, min_chats=50,
                        max_tokens=args.max_tokens, max_seconds=30)
            rss_start = rss_bytes(pids)
            for kind in floods:
                res = await campaign(kind, args, router=router, monitor=monitor, bus=bus, fleet=fleet,
                                     pids=pids, tmp=tmp)
                results.append(res)
                print(f"  {kind}: honest p99 {res['quiet']['honest']['p99_ms']:.1f} ms quiet, "
                      f"{res['flooded']['honest']['p99_ms']:.1f} ms flooded (x{res['p99_ratio']:.2f}); "
                      f"RSS peak {res['rss_peak_mb']:.0f} MB", flush=True)
        finally:
            if router is not None:
                router.stop()
            fleet.stop()
            bus.stop()
    print_table(results, cap, rss_start)
    out = {
        "benchmark": "flood", **machine(),
        "note": ("3 mock workers (rudder serve worker), one router (rudder serve router), one flooder "
                 "process with worker 0's credential, paused and resumed so quiet and flood windows "
                 "alternate (the machine is shared); chats: non-streamed, distinct prompts, closed loop; "
                 "honest = answered by workers 1-2; p99_ratio = flood p99 / quiet p99 of the honest chats"),
        "router_src": args.router_src or None,
        "settings": {"seconds": args.seconds, "rounds": args.rounds, "min_chats": args.min_chats,
                     "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                     "speedup_ratio": args.speedup, "router_env": router_env, "claim_max_kv_blocks": cap},
        "rss_start_mb": rss_start / 2**20, "p99_ratio": {r["flood"]: r["p99_ratio"] for r in results},
        "floods": results,
    }
    path = write_result(args.output, out)
    print(f"wrote {path}")


def print_table(results: list[dict[str, Any]], cap: int, rss_start: int) -> None:
    print(f"\nchats to the honest workers (ms), quiet and flood windows alternating; router RSS (MB, "
          f"{rss_start / 2**20:.0f} before the floods); the hostile worker's prefix-index blocks (cap {cap})")
    head = (f"{'flood':<10}{'window':<8}{'chats':>7}{'err':>5}{'hostile':>8}{'p50':>8}{'p99':>8}{'max':>8}{'p99 x':>7}"
            f"{'router CPU':>11}{'RSS peak':>10}{'held':>9}{'refused':>10}{'dropped':>10}{'listed':>7}"
            f"{'slow':>6}{'flood/s':>9}")
    print(head)
    print("-" * len(head))
    for r in results:
        dropped = sum(v for k, v in r["drops"].items() if k.endswith("/rate_limited"))
        rate = f"{r['flooder']['per_s']:.0f}" if r["flooder"] else "-"
        for label, s in (("quiet", r["quiet"]), ("flood", r["flooded"])):
            h = s["honest"]
            line = (f"{r['flood']:<10}{label:<8}{s['chats']:>7}{sum(s['errors'].values()):>5}"
                    f"{s['hostile_share'] * 100:>7.0f}%{h['p50_ms']:>8.1f}"
                    f"{h['p99_ms']:>8.1f}{h['max_ms']:>8.1f}")
            cpu = f"{s['cpu_cores'].get('router', 0.0):>11.2f}"
            if label == "quiet":
                print(line + f"{'':>7}" + cpu)
            else:
                print(line + f"{r['p99_ratio']:>7.2f}" + cpu + f"{r['rss_peak_mb']:>10.0f}"
                      f"{r['hostile_index_blocks']:>9.0f}{r['index_refused_blocks']:>10.0f}{dropped:>10.0f}"
                      f"{r['listed_workers_min']:>7}{r['nats_slow_consumers']:>6}{rate:>9}")
    print("hostile = share of chats the hostile worker answered; p50/p99/max: the others' chats; p99 x = flood "
          "p99 / quiet p99; router CPU in cores; flood/s = messages the flooder published while flooding "
          "(heartbeats, or KV events of 2,000 blocks)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="length of one window of chats")
    p.add_argument("--rounds", type=int, default=3, help="quiet + flood windows per flood kind")
    p.add_argument("--min-chats", type=int, default=300,
                   help="at least this many chats per flood kind and window kind (over its rounds)")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--speedup", type=float, default=20.0, help="mock speedup_ratio")
    p.add_argument("--max-flood-seconds", type=float, default=120.0, help="a flood stops after this in any case")
    p.add_argument("--kv-cap", type=int, default=0, help="RUDDER_CLAIM_MAX_KV_BLOCKS (0: the router's default)")
    p.add_argument("--router-env", action="append", default=[], metavar="NAME=VALUE",
                   help="a further router setting, e.g. kv_event_bytes_per_s=2097152 (repeatable)")
    p.add_argument("--floods", default=",".join(FLOODS), help="the flood phases, in this order")
    p.add_argument("--router-src", default="",
                   help="run the router of another checkout (e.g. /work/main: the code before a change)")
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
    if arguments.router_src:
        arguments.router_src = str(Path(arguments.router_src).resolve())
    if arguments.flooder:
        run_flooder(arguments)
    else:
        asyncio.run(main(arguments))
