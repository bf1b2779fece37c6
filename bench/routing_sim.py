"""Routing quality in simulated time: ``routing_quality.py``'s trace, noise-free, in seconds.

The same seeded multi-turn trace is replayed through the router's pure core (``router.scheduler``
driven through its dispatch, as the actor does) in front of mock engines' pure schedulers
(``worker.engines.mock.scheduler`` with their block pools and timing model), on one virtual clock:
no process, no network, no timer. What a real run adds is left out on purpose (HTTP and bus
latencies, timer jitter, CPU contention); what it keeps is every routing decision and every
engine step, so two costs are compared on exactly the same arrivals and a change in the mean TTFT
is the router's doing, not the machine's (``routing_quality.py`` moves by ±5 % between runs of the
same code). Use it to compare costs; quote ``routing_quality.py`` for what the product does.

The simulated system:

- each worker: one dp rank, the mock's default engine settings and timing model (``--speedup``
  as in routing_quality.py, half of it for the slow half of a ``--hetero`` pool), advertised in its
  membership record; a heartbeat with its load every second, its KV events delivered to the
  router ``--kv-delay-ms`` after the step that produced them;
- the router: the chosen mode at its startup values (plus a mode's own overrides, as in
  routing_quality.py), its 0.2 s tick, the first token and the end of each request reported as
  the HTTP side reports them (TTFT measured from the send to the worker, mean inter-token time);
- the client: a session's next turn is sent its think time after the previous answer ended;
- ``--routers N``: N router replicas (each its own scheduler, rng and calibration), every request
  sent to the next one (round robin, no affinity), each hearing every heartbeat and KV event;
  ``--peer-sync-ms T`` has them share their bookings as the router process does (router.peersync:
  a snapshot every T ms when changed, at least every 0.5 s while non-empty, delivered
  ``--hop-ms`` later; 0 = not shared);
- the calibration fits (``--fits``): ``inline`` (the default) refits as observations come, every
  ``REFIT_EVERY`` of them; ``background`` as a router process does (router.fitting): the actor only
  records, and a round every ``FIT_INTERVAL_S`` of virtual time fits what is due (same code).

    python bench/routing_sim.py                          # the loaded trace, every mode
    python bench/routing_sim.py --modes kv-time,'kv-blocks:{"prefill_load_scale":10}' --hetero
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, write_result
from bench.routing_quality import (
    BLOCK,
    MODES,
    Result,
    Session,
    TraceConfig,
    Turn,
    build_trace,
    split_modes,
)
from bench.routing_quality import summarize as quality_summary
from controlplane.protocol.events import (
    KvDumpReply,
    KvEvent,
    MembershipEvent,
    MembershipOp,
    RouterRole,
    WorkerRecord,
)
from controlplane.protocol.hashing import chain_hashes
from controlplane.protocol.policy import ALL_CACHE_INPUTS, CacheInput, PolicyKind, startup_values
from controlplane.protocol.signing import Keyring
from controlplane.protocol.tokenizer import encode_chat
from router.commands import (
    ApplyFits,
    ApplyKvEvents,
    ApplyMembership,
    ApplyPeerLoad,
    LoadKvDump,
    RequestDone,
    RequestFirstToken,
    RoutingRequest,
    SelectWorker,
    TakeBookings,
    TakeFitWindows,
    Tick,
)
from router.fitting import FIT_INTERVAL_S, fit_all
from router.scheduler import Scheduler
from router.settings import RoutingMode
from worker.engines.mock.blocks import KvData
from worker.engines.mock.engine import RankEngine
from worker.engines.mock.scheduler import Batch, Seq
from worker.engines.mock.timing import GENERIC_TIMING, TimingModel
from worker.settings import MockEngineSettings

MODEL = "sim-model"
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
HEARTBEAT_S = 1.0
TICK_S = 0.2


@dataclass
class Outcome:
    session: int
    turn: int
    sent: float
    worker: int = 0
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_ttft_ms: float | None = None


@dataclass
class _Running:
    outcome: Outcome
    booking: str
    arrived: float  # at the worker
    session: Session
    index: int  # the turn's index in its session
    router: Scheduler  # the replica that routed it


@dataclass
class SimWorker:
    wid: int
    rank: RankEngine
    record: WorkerRecord
    event_ids: Callable[[], int]
    batch: Batch | None = None
    running: dict[Seq, _Running] = field(default_factory=dict)


def _drained_per_step(dp_rank: int, data: KvData, tier: CacheInput = CacheInput.DEVICE) -> None:
    """A rank's KV sink, unused: the simulation drains the block pool after each step itself
    (Simulation._flush_kv), where the engine's loop would pass its events to the sink."""


class Simulation:
    """One mode over one trace. Events are (time, order, action) on a heap; ``now`` is seconds."""

    def __init__(self, mode: str, selection: dict[str, Any], speedups: list[float], *,
                 kv_delay_s: float, hop_s: float, seed: int, background_fits: bool = False,
                 generic_prior: bool = False, routers: int = 1, peer_sync_s: float = 0.0) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.hop_s = hop_s
        self.kv_delay_s = kv_delay_s
        startup = {k: startup_values(k) for k in PolicyKind}
        startup[PolicyKind.SELECTION].update(selection)
        self.routers = [Scheduler(
            router_id=f"sim-{i}", models=[MODEL], role=RouterRole.AGGREGATED, mode=RoutingMode(mode),
            kv_events=True, cache_inputs=ALL_CACHE_INPUTS, startup=startup, worker_ttl_s=1e9,
            worker_stale_s=1e9, clock=lambda: self.now, wall=lambda: EPOCH + timedelta(seconds=self.now),
            rng=random.Random(seed + 7919 * i), keyring=Keyring({}), background_fits=background_fits,
            peer_sync=peer_sync_s > 0 and routers > 1,
        ) for i in range(routers)]
        self.router = self.routers[0]
        self._next_router = itertools.count()
        self._synced: list[tuple[int, float, bool, int]] = [(-1, 0.0, False, 0)] * routers
        self.workers: dict[int, SimWorker] = {}
        for i, speedup in enumerate(speedups):
            settings = MockEngineSettings(speedup_ratio=speedup)
            timing = TimingModel.from_settings(settings)
            # The mock engine's rank (block pool and scheduler), driven here instead of by its loop.
            rank = RankEngine(0, settings, timing, kv_sink=_drained_per_step)
            wid = i + 1
            record = WorkerRecord(
                instance_id=wid, model=MODEL, url=f"http://sim-{wid}", block_size=settings.block_size,
                kv_total_blocks=settings.num_blocks, max_num_batched_tokens=settings.max_num_batched_tokens,
                started_at=EPOCH, timing=GENERIC_TIMING if generic_prior else timing.advertised(),
            )
            counter = itertools.count()
            self.workers[wid] = w = SimWorker(wid, rank, record, lambda c=counter: next(c))  # type: ignore[misc]
            self._membership(w, MembershipOp.JOIN)
            # An empty cache as of no event: the first KV event (id 0) applies in order.
            for r in self.routers:
                r._dispatch(LoadKvDump(wid, KvDumpReply(instance_id=wid, last_event_id=-1, ranks=[rank.dump()])))
            self.at(HEARTBEAT_S * (i + 1) / len(speedups), lambda w=w: self._heartbeat(w))  # type: ignore[misc]
        self.at(TICK_S, self._tick)
        if background_fits:
            self.at(FIT_INTERVAL_S, self._fit)
        self.peer_sync_s = peer_sync_s
        if peer_sync_s > 0 and routers > 1:
            self.at(peer_sync_s, self._sync)
        self.outcomes: list[Outcome] = []
        self._ids = itertools.count(1)
        self.pending_sessions = 0

    # -- the clock ------------------------------------------------------------------------------

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._order), action))

    def run(self, sessions: list[Session]) -> list[Outcome]:
        for s in sessions:
            if s.turns:
                self.pending_sessions += 1
                self.at(s.start_s, lambda s=s: self._send(s, 0))  # type: ignore[misc]
        while self._heap and self.pending_sessions:
            self.now, _, action = heapq.heappop(self._heap)
            action()
        return self.outcomes

    # -- router side ------------------------------------------------------------------------------

    def _membership(self, w: SimWorker, op: MembershipOp) -> None:
        event = MembershipEvent(op=op, worker=w.record, load=[w.rank.load()], at=EPOCH + timedelta(seconds=self.now))
        for r in self.routers:
            r._dispatch(ApplyMembership(event))

    def _heartbeat(self, w: SimWorker) -> None:
        self._membership(w, MembershipOp.HEARTBEAT)
        if self.pending_sessions:
            self.at(self.now + HEARTBEAT_S, lambda: self._heartbeat(w))

    def _tick(self) -> None:
        for r in self.routers:
            r._dispatch(Tick())
        if self.pending_sessions:
            self.at(self.now + TICK_S, self._tick)

    def _fit(self) -> None:
        """A round of router.fitting.Fitter, its thread's work done at once."""
        for r in self.routers:
            windows = r._dispatch(TakeFitWindows())
            if windows:
                r._dispatch(ApplyFits(fit_all(windows)))
        if self.pending_sessions:
            self.at(self.now + FIT_INTERVAL_S, self._fit)

    def _send(self, session: Session, index: int) -> None:
        turn: Turn = session.turns[index]
        prompt = encode_chat(turn.messages)
        rid = f"r{next(self._ids)}"
        req = RoutingRequest(request_id=rid, model=MODEL, prompt_tokens=len(prompt),
                             hashes={BLOCK: chain_hashes(prompt, BLOCK)})
        router = self.routers[next(self._next_router) % len(self.routers)]
        sel = router._dispatch(SelectWorker(req, seq=int(rid[1:])))
        out = Outcome(turn.session, turn.turn, self.now, worker=sel.instance_id, prompt_tokens=len(prompt),
                      predicted_ttft_ms=sel.predicted_ttft_ms)
        self.outcomes.append(out)
        w = self.workers[sel.instance_id]
        self.at(self.now + self.hop_s, lambda: self._arrive(w, prompt, turn, _Running(
            out, sel.booking_id, 0.0, session, index, router)))

    # -- worker side ------------------------------------------------------------------------------

    def _arrive(self, w: SimWorker, prompt: list[int], turn: Turn, run: _Running) -> None:
        run.arrived = self.now
        seq = w.rank.scheduler.add(run.booking, prompt, max_tokens=turn.max_tokens)
        w.running[seq] = run
        if w.batch is None:
            self._step(w)

    def _step(self, w: SimWorker) -> None:
        batch = w.rank.scheduler.schedule()
        self._flush_kv(w)
        if not batch:
            w.batch = None
            return
        w.batch = batch
        self.at(self.now + batch.duration_ms / 1000.0, lambda: self._step_done(w))

    def _step_done(self, w: SimWorker) -> None:
        assert w.batch is not None
        for output in w.rank.scheduler.complete(w.batch):
            run = w.running[output.seq]
            out = run.outcome
            out.tokens += 1
            if out.first is None:
                out.first = self.now
                out.cached_tokens = output.seq.cached_tokens
                run.router._dispatch(RequestFirstToken(run.booking, ttft_ms=(self.now - run.arrived) * 1e3))
            if output.finished:
                del w.running[output.seq]
                out.done = self.now
                itl = (self.now - out.first) * 1e3 / (out.tokens - 1) if out.tokens > 1 else None
                run.router._dispatch(RequestDone(run.booking, itl_ms=itl, decode_tokens=out.tokens))
                self._next_turn(run)
        self._flush_kv(w)
        if w.rank.scheduler.has_work:
            self._step(w)
        else:
            w.batch = None

    def _next_turn(self, run: _Running) -> None:
        nxt = run.index + 1
        if nxt < len(run.session.turns):
            think = run.session.turns[nxt].think_s
            self.at(self.now + self.hop_s + think, lambda: self._send(run.session, nxt))
        else:
            self.pending_sessions -= 1

    def _flush_kv(self, w: SimWorker) -> None:
        events = [KvEvent(instance_id=w.wid, event_id=w.event_ids(), data=data)
                  for data in w.rank.pool.drain_events()]
        if events:
            self.at(self.now + self.kv_delay_s, lambda: self._deliver_kv(events))

    def _deliver_kv(self, events: list[KvEvent]) -> None:
        need = [w for r in self.routers for w in r._dispatch(ApplyKvEvents(events))]
        if need:  # a gap cannot happen here (events are delivered in order): a bug
            raise RuntimeError(f"KV events of workers {need} out of order")


    def _sync(self) -> None:
        """Each replica publishes its bookings as router.peersync.LoadSharing does; its peers apply
        them one hop later."""
        for i, r in enumerate(self.routers):
            version, last_at, nonempty, seq = self._synced[i]
            keepalive = nonempty and self.now - last_at >= 0.5
            answer = r._dispatch(TakeBookings(since=-1 if keepalive else version))
            if answer is None:
                continue
            version, ranks = answer.version, answer.ranks
            if not ranks and not nonempty and not answer.finished and not answer.returned:
                self._synced[i] = (version, last_at, nonempty, seq)
                continue
            self._synced[i] = (version, self.now, bool(ranks), seq + 1)
            for peer in self.routers:
                if peer is not r:
                    cmd = ApplyPeerLoad(r.router_id, "sim", seq + 1, dict(ranks), list(answer.finished),
                                        list(answer.returned))
                    self.at(self.now + self.hop_s, lambda p=peer, c=cmd: p._dispatch(c))  # type: ignore[misc]
        if self.pending_sessions:
            self.at(self.now + self.peer_sync_s, self._sync)


def summarize(outcomes: list[Outcome], turns: dict[tuple[int, int], Turn], hop_s: float) -> dict[str, Any]:
    """routing_quality.py's figures (the same definitions), plus the mean inter-token time; the
    TTFT counts the hop back to the client."""
    results = [Result(o.session, o.turn, o.sent, ttft=o.first - o.sent + hop_s, done=o.done,
                      prompt_tokens=o.prompt_tokens, cached_tokens=o.cached_tokens,
                      completion_tokens=o.tokens, worker=str(o.worker))
               for o in outcomes if o.first is not None]
    span = max(o.done or 0.0 for o in outcomes) - min(o.sent for o in outcomes)
    out = quality_summary(results, span, turns)
    itl = [(o.done - o.first) * 1e3 / (o.tokens - 1) for o in outcomes
           if o.done is not None and o.first is not None and o.tokens > 1]
    out.update(requests=len(outcomes), itl_mean_ms=statistics.fmean(itl) if itl else None)
    return out


def parse_mode(text: str) -> tuple[str, str, dict[str, Any]]:
    name, _, extra = text.partition(":")
    return text, name, json.loads(extra) if extra else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help="as routing_quality.py's --modes")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--speedup", type=float, default=0.1)
    ap.add_argument("--hetero", action="store_true", help="half the workers at half the speed-up ratio")
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--session-rate", type=float, default=2.0)
    ap.add_argument("--seeds", default="7", help="comma-separated trace seeds; each mode runs every one")
    ap.add_argument("--kv-delay-ms", type=float, default=5.0)
    ap.add_argument("--hop-ms", type=float, default=2.0, help="one-way client/router/worker latency")
    ap.add_argument("--fits", choices=("inline", "background"), default="inline",
                    help="calibration fits as observations come, or in rounds as a router process does")
    ap.add_argument("--generic-prior", action="store_true",
                    help="workers advertise the generic prior a vLLM worker does, not their true timing")
    ap.add_argument("--routers", default="1", help="router replicas, comma-separated (1,2,4): each mode with each")
    ap.add_argument("--peer-sync-ms", default="0",
                    help="replicas share their bookings every this many ms (0: not), comma-separated: each")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    speedups = [args.speedup] * args.workers
    if args.hetero:
        speedups[args.workers - args.workers // 2:] = [args.speedup / 2] * (args.workers // 2)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    variants = [(label, name, overrides, n, sync) for label, name, overrides in map(parse_mode, split_modes(args.modes))
                for n in (int(x) for x in args.routers.split(","))
                for sync in ([float(x) for x in args.peer_sync_ms.split(",")] if n > 1 else [0.0])]
    for label, name, overrides, replicas, sync_ms in variants:
        if replicas > 1:
            label = f"{label} x{replicas}" + (f" shared {sync_ms:g} ms" if sync_ms > 0 else "")
        per_seed = []
        for seed in seeds:
            sessions = build_trace(TraceConfig(sessions=args.sessions, session_rate=args.session_rate, seed=seed))
            turns = {(t.session, t.turn): t for s in sessions for t in s.turns}
            t0 = time.perf_counter()
            sim = Simulation(name, overrides, speedups, kv_delay_s=args.kv_delay_ms / 1e3,
                             hop_s=args.hop_ms / 1e3, seed=seed, background_fits=args.fits == "background",
                             generic_prior=args.generic_prior, routers=replicas, peer_sync_s=sync_ms / 1e3)
            res = summarize(sim.run(sessions), turns, args.hop_ms / 1e3)
            res["seed"], res["wall_s"] = seed, time.perf_counter() - t0
            per_seed.append(res)
            print(f"  {label} seed {seed}: TTFT mean {res['ttft_mean_ms']:.0f} ms, "
                  f"{res['of_oracle'] * 100:.1f} % of the oracle ({res['wall_s']:.1f} s)", flush=True)
        rows.append({"mode": label, "seeds": per_seed,
                     "ttft_mean_ms": statistics.fmean(r["ttft_mean_ms"] for r in per_seed),
                     "ttft_first_turn_mean_ms": statistics.fmean(r["ttft_first_turn_mean_ms"] for r in per_seed),
                     "ttft_later_turns_mean_ms": statistics.fmean(r["ttft_later_turns_mean_ms"] for r in per_seed),
                     "ttft_p90_ms": statistics.fmean(r["ttft_p90_ms"] for r in per_seed),
                     "itl_mean_ms": statistics.fmean(r["itl_mean_ms"] for r in per_seed),
                     "of_oracle": statistics.fmean(r["of_oracle"] for r in per_seed),
                     "ttft_floor_ms": statistics.fmean(r["ttft_floor_ms"] for r in per_seed)})
    base = next((r for r in rows if r["mode"] == rows[0]["mode"]), rows[0])
    print(f"\nsimulated: {args.workers} workers{' (heterogeneous)' if args.hetero else ''}, fits {args.fits}"
          f"{', generic prior' if args.generic_prior else ''}, "
          f"{args.sessions} sessions at {args.session_rate}/s, seeds {seeds}; "
          f"TTFT floor {rows[0]['ttft_floor_ms']:.0f} ms; ratio = first row's mean / row's mean")
    head = (f"{'mode':<44}{'TTFT mean':>10}{'first':>8}{'later':>8}{'p90':>8}{'ITL':>7}{'of oracle':>10}"
            f"{'ratio':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['mode'][:44]:<44}{r['ttft_mean_ms']:>8.0f}ms{r['ttft_first_turn_mean_ms']:>8.0f}"
              f"{r['ttft_later_turns_mean_ms']:>8.0f}{r['ttft_p90_ms']:>8.0f}{r['itl_mean_ms']:>7.1f}"
              f"{r['of_oracle'] * 100:>9.1f}%"
              f"{base['ttft_mean_ms'] / r['ttft_mean_ms']:>6.2f}x")
    write_result("routing_sim" if args.output is None else args.output, {
        "benchmark": "routing_sim", **machine(), "workers": args.workers, "speedups": speedups,
        "sessions": args.sessions, "session_rate": args.session_rate, "seeds": seeds,
        "kv_delay_ms": args.kv_delay_ms, "hop_ms": args.hop_ms, "fits": args.fits,
        "generic_prior": args.generic_prior, "routers": args.routers, "peer_sync_ms": args.peer_sync_ms,
        "modes": rows,
    })


if __name__ == "__main__":
    main()
