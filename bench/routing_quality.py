"""Routing quality: what KV-aware routing buys on multi-turn chat (issue 4 "Speed").

A synthetic trace of multi-turn chat sessions is replayed through one router over 8 mock workers
(separate ``python -m worker`` processes, default timing model, one ``speedup_ratio`` for every
mode) under ``kv-time`` (predicted-time cost), ``kv-blocks`` (block cost; also with
``prefill_load_scale = 10`` for reference), ``round_robin``, ``random`` and ``least_loaded``, every
router at its startup values. A third run replays the loaded trace over a heterogeneous pool (half
the workers at half the speed-up ratio, i.e. twice as slow; ``--hetero-prior generic`` has every
worker advertise the generic prior a vLLM worker advertises instead of its true timing, so the
router must learn each worker's speed from what it observes, ``both`` runs it both ways):

- sessions are split into groups sharing a system prompt; a session's first turn carries a
  private document of a few thousand tokens; every later turn carries all earlier turns plus the
  assistant's previous answers. The mock engine's output is deterministic (``abc…``), so the
  carried history is exactly what the engine cached (generated tokens are cached too, as in vLLM);
- sessions start at Poisson arrival times; a session's next turn is sent an exponential think
  time after its previous answer completed (a turn cannot carry an answer it has not received);
- every request streams (``stream_options.include_usage``); TTFT is measured by the client up to
  the first chunk with content (the role-only chunk does not count); the cached-token fraction
  comes from ``usage.prompt_tokens_details.cached_tokens``;
- the oracle is the best cached fraction any router could reach: an unlimited cache that knows
  every earlier request (prompt and computed answer tokens), counted in whole engine blocks, with
  vLLM's rule that the last prompt token is never a hit;
- each mode gets its own router process and cold workers (``POST /reset_prefix_cache``);
- CPU is sampled (machine and per process): the workers' timing model, not Python, should be the
  bottleneck on the 2-core dev box.

The loaded run is followed by a short low-load ("idle") run for reference.

``--routers 1,2,4`` runs each mode with each number of router replicas (issue 16): every replica
its own process on the same bus and workers, the client sending each request to the next replica
(round robin per request, no session affinity, as an L4 balancer would); a row is ``mode xN``.
``--peer-sync off,on`` runs each multi-replica row both without and with the replicas sharing
their bookings (``RUDDER_PEER_SYNC``; router.peers): ``mode xN`` and ``mode xN shared``, in the same
run (one router runs with the first of the list; off is the router before sharing existed).

    python bench/routing_quality.py            # table on stdout, bench/results/routing_quality.json
    python bench/routing_quality.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.common import CpuSampler, Fleet, Router, machine, metric_sums, pct, write_result
from cli.embedded import LocalBus
from controlplane.protocol.hashing import chain_hashes
from controlplane.protocol.tokenizer import encode_chat
from worker.engines.mock.scheduler import output_token
from worker.engines.mock.timing import TimingModel

MODEL = "bench-rq"
BLOCK = 64  # the mock engine's default block size
_ROUTER_LOGS = itertools.count()
# Every mode at the router's startup values: the predicted-time cost (kv-time), the block cost
# (kv-blocks), and for reference the block cost with the one override an earlier run of this bench
# found to matter on the mock's timing model (docs/benchmarks.md): prefill blocks weigh 10x.
KV_TUNED = 'kv-blocks:{"prefill_load_scale":10}'
MODES = ("kv-time", "kv-blocks", KV_TUNED, "round_robin", "random", "least_loaded")
IDLE_MODES = ("kv-time", "kv-blocks", KV_TUNED, "round_robin")
# The heterogeneous pool: half the workers at half the speed-up ratio (twice as slow).
HETERO_MODES = ("kv-time", "kv-blocks", "least_loaded")
KV_MODES = ("kv", "kv-time", "kv-blocks")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu the of and "
         "to in is that for it as with was on be by this are from or at an which but not have "
         "kernel cache block prefix router worker token batch decode prefill latency").split()


# -- the trace ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceConfig:
    sessions: int = 100
    session_rate: float = 2.0  # sessions started per second (Poisson)
    groups: int = 4  # distinct system prompts
    system_tokens: tuple[int, int] = (800, 1200)
    document_tokens: tuple[int, int] = (2000, 4000)
    turns: tuple[int, int] = (3, 5)
    followup_tokens: tuple[int, int] = (50, 250)
    answer_tokens: tuple[int, int] = (16, 48)
    think_s: float = 2.0  # mean think time between an answer and the next turn
    seed: int = 7


@dataclass
class Turn:
    session: int
    turn: int
    messages: list[dict[str, str]]
    max_tokens: int
    think_s: float  # wait after the previous turn completed (first turn: 0)
    prompt_tokens: int


@dataclass
class Session:
    index: int
    start_s: float
    turns: list[Turn] = field(default_factory=list)


def _text(rng: random.Random, tokens: int) -> str:
    """ASCII words, about ``tokens`` bytes (the mock tokenizer is one token per byte)."""
    out: list[str] = []
    n = 0
    while n < tokens:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:tokens]


def answer_text(max_tokens: int) -> str:
    """What the mock engine answers to a request with ``max_tokens`` (deterministic)."""
    return "".join(chr(output_token(i)) for i in range(max_tokens))


def build_trace(cfg: TraceConfig) -> list[Session]:
    rng = random.Random(cfg.seed)
    systems = [f"You are assistant #{g}. " + _text(rng, rng.randint(*cfg.system_tokens))
               for g in range(cfg.groups)]
    sessions: list[Session] = []
    t = 0.0
    for s in range(cfg.sessions):
        t += rng.expovariate(cfg.session_rate) if s else 0.0
        sess = Session(s, t)
        messages: list[dict[str, str]] = [{"role": "system", "content": systems[rng.randrange(cfg.groups)]}]
        doc = _text(rng, rng.randint(*cfg.document_tokens))
        messages.append({"role": "user", "content": f"Session {s}. Read this document:\n{doc}\n"
                                                    "Summarise it."})
        for k in range(rng.randint(*cfg.turns)):
            if k:
                messages.append({"role": "user", "content": f"Question {k}: "
                                 + _text(rng, rng.randint(*cfg.followup_tokens))})
            max_tokens = rng.randint(*cfg.answer_tokens)
            snapshot = [dict(m) for m in messages]
            sess.turns.append(Turn(s, k, snapshot, max_tokens,
                                   rng.expovariate(1.0 / cfg.think_s) if k else 0.0,
                                   len(encode_chat(snapshot))))
            messages.append({"role": "assistant", "content": answer_text(max_tokens)})
        sessions.append(sess)
    return sessions


def oracle(turns_in_order: list[Turn], block: int = BLOCK, speedup: float = 0.1) -> dict[str, float]:
    """Best cached fraction with an unlimited cache holding every earlier request, and the TTFT
    floor that goes with it.

    A request's computed tokens (prompt + all answer tokens but the last, whose KV the engine
    never computes) are cached in whole blocks; a later prompt hits its longest cached block
    prefix, capped so the last prompt token is computed (vLLM's rule). The floor is the mean of
    each request's prefill of its uncached tokens alone on an idle worker at ``speedup`` (the
    mock's timing model): no queue, no decode pass, no HTTP; what no router can beat."""
    cached: set[int] = set()
    model = TimingModel(speedup_ratio=speedup)
    floors: list[float] = []
    hit = total = 0
    for t in turns_in_order:
        prompt = encode_chat(t.messages)
        chain = chain_hashes(prompt, block)
        limit = (len(prompt) - 1) // block
        n = 0
        while n < limit and chain[n] in cached:
            n += 1
        hit += n * block
        total += len(prompt)
        floors.append(model.prefill_ms(len(prompt) - n * block))
        computed = prompt + [output_token(i) for i in range(t.max_tokens - 1)]
        cached.update(chain_hashes(computed, block))
    return {"cached_tokens": hit, "prompt_tokens": total, "fraction": hit / total if total else 0.0,
            "ttft_floor_mean_ms": statistics.fmean(floors) if floors else 0.0}


def planned_order(sessions: list[Session]) -> list[Turn]:
    """Turns in the order they would arrive if every answer were instant."""
    timed: list[tuple[float, int, Turn]] = []
    for s in sessions:
        t = s.start_s
        for turn in s.turns:
            t += turn.think_s
            timed.append((t, len(timed), turn))
    return [turn for _, _, turn in sorted(timed, key=lambda x: (x[0], x[1]))]


# -- replay -------------------------------------------------------------------------------------


@dataclass
class Result:
    session: int
    turn: int
    sent: float
    ttft: float | None = None
    first_chunk: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: str = ""
    error: str | None = None


async def one_request(client: httpx.AsyncClient, url: str, turn: Turn, t_zero: float) -> Result:
    body = {"model": MODEL, "messages": turn.messages, "max_tokens": turn.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res = Result(turn.session, turn.turn, t0 - t_zero)
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            res.worker = resp.headers.get("x-worker-instance-id", "")
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if res.first_chunk is None:
                    res.first_chunk = now - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    continue
                choices = chunk.get("choices") or []
                if res.ttft is None and choices and choices[0].get("delta", {}).get("content"):
                    res.ttft = now - t0
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.completion_tokens = usage["completion_tokens"]
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.done = time.perf_counter() - t_zero
    return res


async def replay(urls: list[str], sessions: list[Session], *, deadline_s: float) -> tuple[list[Result], float]:
    """Run every session against the routers at ``urls``, the next one for each request (round
    robin per request, no session affinity: an L4 balancer in front of router replicas); returns
    the results and the wall time."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=500)
    results: list[Result] = []
    pick = itertools.cycle(urls)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as client:
        t_zero = time.perf_counter()

        async def run_session(s: Session) -> None:
            await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t_zero)))
            for turn in s.turns:
                if turn.think_s:
                    await asyncio.sleep(turn.think_s)
                if time.perf_counter() - t_zero > deadline_s:
                    return
                res = await one_request(client, next(pick), turn, t_zero)
                results.append(res)
                if res.error:
                    return  # the history would no longer match what the engine cached

        await asyncio.gather(*(run_session(s) for s in sessions))
        wall = time.perf_counter() - t_zero
    return results, wall


def summarize(results: list[Result], wall: float, turns_by_key: dict[tuple[int, int], Turn]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    first = min((r.sent for r in ok), default=0.0)
    last = max((r.done or 0.0 for r in ok), default=0.0)
    span = max(last - first, 1e-9)
    order = [turns_by_key[(r.session, r.turn)] for r in sorted(ok, key=lambda r: r.sent)]
    orc = oracle(order)
    later = [r for r in ok if r.turn > 0]
    per_worker: dict[str, int] = {}
    for r in ok:
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    return {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if r.error][:3],
        "ttft_mean_ms": statistics.fmean(ttft) * 1e3 if ttft else None,
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p90_ms": pct(ttft, 0.9) * 1e3,
        "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "ttft_first_turn_mean_ms": _mean_ms([r.ttft for r in ok if r.turn == 0]),
        "ttft_later_turns_mean_ms": _mean_ms([r.ttft for r in later]),
        "cached_fraction": cached / prompt if prompt else 0.0,
        "later_turns_cached_fraction": (sum(r.cached_tokens for r in later)
                                        / max(1, sum(r.prompt_tokens for r in later))),
        "oracle_fraction": orc["fraction"],
        "of_oracle": (cached / prompt) / orc["fraction"] if prompt and orc["fraction"] else None,
        "ttft_floor_ms": orc["ttft_floor_mean_ms"],  # in the order the requests were sent
        "prompt_tokens": prompt, "cached_tokens": cached,
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "throughput_rps": len(ok) / span,
        "prompt_tokens_per_s": prompt / span,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / span,
        "span_s": span, "wall_s": wall,
        "requests_per_worker": sorted(per_worker.values(), reverse=True),
    }


def _mean_ms(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) * 1e3 if vals else None


async def worker_totals(fleet: Fleet) -> dict[str, float]:
    """Sum of a few mock counters/gauges over the fleet (steps, preemptions, cached blocks)."""
    names = ("rudder_mock_steps", "rudder_mock_preemptions", "rudder_mock_kv_cached_blocks")
    totals = dict.fromkeys(names, 0.0)
    async with httpx.AsyncClient(timeout=5) as client:
        for url in fleet.urls:
            for name, value in (await metric_sums(client, url, names)).items():
                totals[name] += value
    return totals


async def router_timing(url: str) -> dict[str, Any]:
    """The router's per-worker timing fits and TTFT prediction errors, from its /metrics."""
    fits: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient() as client:
        text = (await client.get(url + "/metrics", timeout=5)).text
    for line in text.splitlines():
        for name, label in (("rudder_router_timing_coefficient", "coefficient"),
                            ("rudder_router_ttft_prediction_error_ms", "stat"),
                            ("rudder_router_calibration_samples", "fit")):
            if line.startswith(name + "{"):
                labels = dict(part.split("=", 1) for part in line[len(name) + 1:line.index("}")].split(","))
                wid = labels["instance_id"].strip('"')
                key = labels[label].strip('"')
                key = key if name != "rudder_router_calibration_samples" else f"{key}_samples"
                key = key if name != "rudder_router_ttft_prediction_error_ms" else f"ttft_error_{key}_ms"
                fits.setdefault(wid, {})[key] = float(line.rsplit(" ", 1)[1])
    maes = [f["ttft_error_mae_ms"] for f in fits.values() if "ttft_error_mae_ms" in f]
    p90s = [f["ttft_error_p90_ms"] for f in fits.values() if "ttft_error_p90_ms" in f]
    return {"workers": fits, "mean_worker_mae_ms": statistics.fmean(maes) if maes else None,
            "mean_worker_p90_ms": statistics.fmean(p90s) if p90s else None}


async def run_mode(bus: LocalBus, fleet: Fleet, mode: str, sessions: list[Session],
                   selection: dict[str, float] | None, deadline_s: float, log_dir: Path,
                   nats_pid: int, details: bool = False, replicas: int = 1,
                   peer_sync: bool = True) -> dict[str, Any]:
    await fleet.reset_caches()
    label = mode
    if ":" in mode:  # "kv-blocks:{json}": a kv variant with its own selection overrides
        mode, raw = mode.split(":", 1)
        selection = json.loads(raw)
    kv_events = mode != "kv-approx"  # approximate mode: the router indexes its own decisions
    mode = "kv" if mode == "kv-approx" else mode
    routers = [Router(bus, MODEL, mode=mode, selection=selection if mode in KV_MODES else None,
                      kv_events=kv_events, log=log_dir / f"router-{next(_ROUTER_LOGS)}-{mode}.log",
                      launcher=fleet.launcher, env={"RUDDER_PEER_SYNC": "true" if peer_sync else "false"})
               for _ in range(replicas)]
    try:
        for router in routers:
            await router.ready(fleet.n)
        before = await worker_totals(fleet)
        sampler = CpuSampler({"router": [r.proc.pid for r in routers], "workers": [p.pid for p in fleet.procs],
                              "nats": [nats_pid], "client": [os.getpid()]})
        sampler.start()
        results, wall = await replay([r.url for r in routers], sessions, deadline_s=deadline_s)
        cpu = sampler.stop()
        after = await worker_totals(fleet)
        timing = await router_timing(routers[0].url)
    finally:
        for router in routers:
            router.stop()
    turns_by_key = {(t.session, t.turn): t for s in sessions for t in s.turns}
    out = summarize(results, wall, turns_by_key)
    out["mode"] = label if replicas == 1 else f"{label} x{replicas}" + (" shared" if peer_sync else "")
    out["routers"] = replicas
    out["peer_sync"] = peer_sync
    out["selection_overrides"] = (selection or {}) if mode in KV_MODES else {}
    if details:
        out["details"] = [asdict(r) for r in sorted(results, key=lambda r: r.sent)]
    out["cpu"] = cpu
    out["timing_fit"] = timing
    out["engine"] = {k: after.get(k, 0.0) - (before.get(k, 0.0) if k != "rudder_mock_kv_cached_blocks" else 0.0)
                     for k in after}
    return out


def split_modes(text: str) -> list[str]:
    """Split on commas outside JSON braces."""
    out: list[str] = []
    depth = 0
    cur = ""
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [m for m in [*out, cur] if m]


def print_table(title: str, rows: list[dict[str, Any]], oracle_fraction: float) -> None:
    print(f"\n{title} (trace oracle cached fraction {oracle_fraction:.3f})")
    head = (f"{'mode':<20}{'reqs':>6}{'err':>5}{'TTFT mean':>11}{'p50':>9}{'p90':>9}"
            f"{'cached':>8}{'of oracle':>10}{'req/s':>7}{'tok/s in':>10}{'CPU us':>7}{'others':>7}"
            f"{'vs rr':>7}")
    print(head)
    print("-" * len(head))
    rr = next((r for r in rows if r["mode"] == "round_robin"), None)
    for r in rows:
        speed = (rr["ttft_mean_ms"] / r["ttft_mean_ms"]) if rr and r["ttft_mean_ms"] else float("nan")
        print(f"{r['mode'][:20]:<20}{r['ok']:>6}{r['errors']:>5}{r['ttft_mean_ms']:>9.0f}ms"
              f"{r['ttft_p50_ms']:>7.0f}ms{r['ttft_p90_ms']:>7.0f}ms{r['cached_fraction']:>8.3f}"
              f"{(r['of_oracle'] or 0) * 100:>9.1f}%{r['throughput_rps']:>7.2f}"
              f"{r['prompt_tokens_per_s']:>10.0f}{sum(r['cpu']['process_cores'].values()):>7.2f}"
              f"{r['cpu']['other_processes_cores']:>7.2f}{speed:>6.2f}x")
    print("CPU us / others: cores used by this bench's processes / by other processes on the machine")


async def main(args: argparse.Namespace) -> None:
    loaded = TraceConfig(sessions=args.sessions, session_rate=args.session_rate, seed=args.seed)
    idle = TraceConfig(sessions=args.idle_sessions, session_rate=args.idle_session_rate,
                       think_s=1.0, seed=args.seed + 1)
    selection = json.loads(args.selection) if args.selection else None
    router_counts = [int(n) for n in str(args.routers).split(",")]
    syncs = [v.strip() == "on" for v in str(args.peer_sync).split(",")]
    mock = {"speedup_ratio": args.speedup}
    slow = [{"speedup_ratio": args.speedup / 2}] * (args.workers // 2)
    hetero_speedups = [args.speedup] * (args.workers - len(slow)) + [args.speedup / 2] * len(slow)
    out: dict[str, Any] = {
        "benchmark": "routing_quality", **machine(),
        "workers": args.workers, "launcher": args.launcher, "speedup_ratio": args.speedup,
        "heterogeneous_speedup_ratios": hetero_speedups,
        "kv_selection_overrides": selection or {}, "routers": router_counts, "peer_sync": args.peer_sync,
        "note": ("TTFT = client send -> first chunk with content; cached = usage.prompt_tokens_details."
                 "cached_tokens; oracle = unlimited cache of every earlier request, whole blocks, "
                 "last prompt token never a hit"),
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="rq-") as tmp:
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        server = LocalBus(Path(tmp))
        server.start()
        fleet: Fleet | None = None
        hetero: list[dict[str, Any]] = [{}] * (args.workers - len(slow)) + slow
        generic = [{**w, "advertise_timing": "generic"} for w in hetero]
        scenarios = [
            ("loaded", loaded, split_modes(args.modes), []),
            ("idle", idle, split_modes(args.idle_modes), []),
        ]
        if args.hetero_prior in ("true", "both"):
            scenarios.append(("heterogeneous", loaded, split_modes(args.hetero_modes), hetero))
        if args.hetero_prior in ("generic", "both"):
            scenarios.append(("heterogeneous-generic-prior", loaded, split_modes(args.hetero_modes), generic))
        try:
            assert server.server.proc is not None
            for label, cfg, modes, per_worker in scenarios:
                if cfg.sessions <= 0 or not modes:
                    continue
                if fleet is None or fleet.per_worker != per_worker:
                    if fleet is not None:
                        fleet.stop()
                        await asyncio.sleep(3)  # stopped workers leave (SIGTERM → leave event)
                    fleet = Fleet(server, MODEL, args.workers, mock=mock, log_dir=log_dir,
                                  launcher=args.launcher, per_worker=per_worker)
                    await fleet.start()
                sessions = build_trace(cfg)
                trace_oracle = oracle(planned_order(sessions), speedup=max(hetero_speedups) if per_worker
                                      else args.speedup)
                n_req = sum(len(s.turns) for s in sessions)
                speeds = ", ".join(f"{x:g}" for x in hetero_speedups) if per_worker else f"{args.speedup:g}"
                prior = "generic prior" if label.endswith("generic-prior") else "true timing advertised"
                print(f"{label}: {cfg.sessions} sessions, {n_req} requests, "
                      f"{cfg.session_rate} sessions/s, speedup_ratio {speeds}, {prior}", flush=True)
                rows = []
                runs = [(m, n, sync) for m in modes for n in router_counts
                        for sync in (syncs if n > 1 else syncs[:1])]
                for mode, replicas, sync in runs:
                    row = await run_mode(server, fleet, mode, sessions, selection,
                                         args.deadline, log_dir, server.server.proc.pid, args.details,
                                         replicas=replicas, peer_sync=sync)
                    rows.append(row)
                    print(f"  {row['mode']}: TTFT mean {row['ttft_mean_ms']:.0f} ms, cached "
                          f"{row['cached_fraction']:.3f}, CPU {row['cpu']['machine_busy_pct']:.0f}%, "
                          f"{row['errors']} errors, {row['wall_s']:.0f} s", flush=True)
                print_table(f"{label} ({n_req} requests over {args.workers} workers, TTFT floor "
                            f"{trace_oracle['ttft_floor_mean_ms']:.0f} ms)", rows, trace_oracle["fraction"])
                out["runs"].append({"load": label, "trace": asdict(cfg), "requests": n_req, "prior": prior,
                                    "speedup_ratios": hetero_speedups if per_worker else [args.speedup] * args.workers,
                                    "oracle": trace_oracle, "modes": rows})
        finally:
            if fleet is not None:
                fleet.stop()
            server.stop()
    path = write_result(args.output, out)
    print(f"\nwrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--launcher", default="module", choices=("module", "cli"),
                   help="module = python -m worker|router; cli = rudder serve (uvloop)")
    p.add_argument("--speedup", type=float, default=0.1,
                   help="mock speedup_ratio (< 1 slows the engines so they, not Python, are the bottleneck)")
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--session-rate", type=float, default=2.0, help="sessions started per second")
    p.add_argument("--idle-sessions", type=int, default=12, help="0 skips the low-load run")
    p.add_argument("--idle-modes", default=",".join(IDLE_MODES))
    p.add_argument("--idle-session-rate", type=float, default=0.4)
    p.add_argument("--hetero-modes", default=",".join(HETERO_MODES),
                   help="modes of the heterogeneous-pool run (half the workers twice as slow); '' skips it")
    p.add_argument("--routers", default="1",
                   help="router replicas, comma-separated (e.g. 1,2,4): each mode runs with each count, "
                        "requests spread over the replicas round-robin per request (no session affinity)")
    p.add_argument("--peer-sync", default="on",
                   help="router replicas share their bookings (RUDDER_PEER_SYNC): on, off, or off,on to run "
                        "each multi-replica row both ways")
    p.add_argument("--hetero-prior", default="true", choices=("true", "generic", "both"),
                   help="what the heterogeneous pool's workers advertise: their true timing, the generic "
                        "prior of a vLLM worker (the router learns their speed), or a run of each")
    p.add_argument("--modes", default=",".join(MODES),
                   help='comma-separated; a kv variant may carry its own overrides: '
                        'kv-blocks:{"prefill_load_scale":4}; '
                        'kv-approx[:{...}] = kv without KV events (RUDDER_KV_EVENTS=false)')
    p.add_argument("--selection", default="",
                   help='startup selection overrides for plain kv, kv-time, kv-blocks entries, JSON (RUDDER_SELECTION)')
    p.add_argument("--deadline", type=float, default=150.0, help="no new turn after this many seconds")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--output", default="routing_quality", help="name of the JSON in bench/results/")
    p.add_argument("--details", action="store_true", help="keep every request's record in the JSON")
    p.add_argument("--log-dir", default="", help="keep process logs here")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
