"""Reliability report (issue 18, item 5): each fault scenario for a bounded time, checked by the
history checker (tests/reliability/history.py).

Two kinds of scenario:

- **single** (``nats_kill``, ``nats_restart``, ``postgres_restart``): a real NATS (JetStream) and
  PostgreSQL on loopback, one control plane and one router in this process, three CAS writers on
  the admin API; one fault a third of the way in.
- **fleet** (``fleet_*``): the fleet harness (tests/reliability/fleet.py): a 3-node NATS cluster
  (R3), PostgreSQL, two control planes, three routers and four mock workers as real processes,
  CAS writers (patches, rollbacks, partial thresholds) failing over between the control planes and
  chat clients failing over between the routers; the scenario's faults ``--repeat`` times each,
  ``--gap`` seconds apart. For the NATS faults the raw JetStream leader election is timed in the
  same run (from the leader node's kill, or from the cluster's restart, until a node answers
  ``stream_info`` with a leader), beside how long writes were refused and how long until every
  router applied a write made after the fault.

Afterwards the reconciler settles what the faults left ambiguous and the history is checked.

    python bench/reliability.py [--seconds 6] [--repeat 3] [--scenario nats_kill fleet_partition ...]

Writes ``bench/results/reliability.json`` and ``bench/results/reliability.md``: per scenario the
faults injected, write attempts (accepted / conflicts / refused / unknown / lost), chats (attempted /
failed and why), how long writes were refused, convergence after each fault (p50 / p99 / max), the
leader election where there is one, and the checker's verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bus.identities import Identity, IdentityKind  # noqa: E402
from cli.embedded import EmbeddedNats, EmbeddedPostgres  # noqa: E402
from controlplane.audit.store import AuditStore  # noqa: E402
from migrations import upgrade_async  # noqa: E402
from tests import buskit  # noqa: E402
from tests.conftest import TEST_APP, TEST_OWNER  # noqa: E402
from tests.integration.cp_support import client, controlplane, make_tokens  # noqa: E402
from tests.reliability.fleet import Fleet  # noqa: E402
from tests.reliability.fleet_history import cas_writer, mono, read_back  # noqa: E402
from tests.reliability.fleet_traffic import convergence_s, percentiles, run, writes_refused_s  # noqa: E402
from tests.reliability.history import Answer, Attempt, check  # noqa: E402
from tests.support_router.workers import InProcessRouter, router_settings  # noqa: E402

Fault = Callable[["Servers"], Awaitable[None]]


@dataclass
class Servers:
    nats: EmbeddedNats
    postgres: EmbeddedPostgres


async def nats_kill(s: Servers) -> None:
    assert s.nats.proc is not None
    s.nats.proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(s.nats.proc.wait, 10)
    await asyncio.to_thread(s.nats.start)


async def nats_restart(s: Servers) -> None:
    await asyncio.to_thread(s.nats.stop)
    await asyncio.sleep(0.5)
    await asyncio.to_thread(s.nats.start)


async def postgres_restart(s: Servers) -> None:
    await asyncio.to_thread(s.postgres.stop, mode="immediate")
    await asyncio.sleep(0.5)
    await asyncio.to_thread(s.postgres.start)


SCENARIOS: dict[str, Fault] = {"nats_kill": nats_kill, "nats_restart": nats_restart,
                               "postgres_restart": postgres_restart}

#: Fleet scenarios: the faults (tests/reliability/fleet.py FAULTS) and how long each lasts (s).
FLEET_SCENARIOS: dict[str, list[tuple[str, float]]] = {
    "fleet_nats_node_kill": [("nats_node_kill", 0.5)],
    "fleet_nats_cluster_restart": [("nats_cluster_restart", 0.5)],
    "fleet_controlplane_kill": [("controlplane_kill", 0.5)],
    "fleet_router_kill": [("router_kill", 0.5)],
    "fleet_worker_kill": [("worker_kill", 0.5)],
    "fleet_router_stop": [("router_stop", 3.0)],
    "fleet_partition": [("partition_drop", 3.0), ("partition_stall", 3.0)],
    "fleet_postgres": [("postgres_kill", 0.5), ("postgres_stop", 3.0)],
    "fleet_kv_burst": [("kv_burst", 2.0)],
}


async def run_scenario(name: str, fault: Fault, seconds: float, root: Path) -> dict[str, Any]:
    nats = EmbeddedNats(root / name / "nats", auth=buskit.authority().server_config)
    nats.start()
    pg = EmbeddedPostgres(root / name / "pgdata")
    pg.start()
    try:
        await asyncio.to_thread(buskit.init_streams, nats.url)
        access = pg.provision("rudder", owner=TEST_OWNER, app=TEST_APP)
        await upgrade_async(access.owner_url)
        tokens = await make_tokens(access.app_url)
        model = f"reliability/{name}-{uuid.uuid4().hex[:6]}"
        attempts: list[Attempt] = []
        stop = asyncio.Event()
        store = AuditStore.from_url(access.app_url)
        async with controlplane(nats.url, access.app_url, reconcile_grace_s=0.0) as cp, \
                client(cp, tokens.operator) as http:
            router = await InProcessRouter(router_settings(nats.url, model)).start()
            try:
                writers = [asyncio.create_task(cas_writer(http, model, f"w{i}", stop, attempts)) for i in range(3)]
                await asyncio.sleep(seconds / 3)
                fault_at = mono()
                await fault(Servers(nats, pg))
                back_at = mono()
                await asyncio.sleep(seconds * 2 / 3)
                stop.set()
                await asyncio.gather(*writers)
                nc = await buskit.connect_as(nats.url, Identity(IdentityKind.CONTROLPLANE))
                try:
                    await asyncio.sleep(1.0)  # the last ACKs reach the audit store
                    await cp.controlplane.reconciler.resolve_pending(grace=timedelta(0))
                    report = await cp.controlplane.reconciler.check()
                    history = await read_back(nc, store, model, routers=[router.settings.router_id])
                finally:
                    await nc.close()
            finally:
                await router.stop()
        await store.close()
        history.attempts, history.last_fault_at = attempts, back_at
        verdict = check(history)
        written_after = {a.new_revision: a.completed for a in attempts
                         if a.answer is Answer.ACCEPTED and a.invoked >= back_at and a.new_revision is not None}
        applied_after = [ap.at for ap in history.applies if ap.revision in written_after]
        converge = (min(applied_after) - back_at) if applied_after else None
        counts = {answer.value: sum(a.answer is answer for a in attempts) for answer in Answer}
        return {
            "scenario": name, "seconds": seconds, "faults": 1,
            "fault_took_s": round(back_at - fault_at, 3),
            "attempts": len(attempts), **counts,
            "lost": sum(p.kind == "lost_write" for p in verdict.problems),
            "writes_refused_s": round(writes_refused_s(attempts, fault_at), 3),
            "router_on_new_writes_after_s": None if converge is None else round(converge, 3),
            "reconcile_ok": report.ok, "verdict": str(verdict),
        }
    finally:
        nats.stop(kill=True)
        pg.stop(mode="immediate")


async def run_fleet_scenario(name: str, faults: list[tuple[str, float]], *, repeat: int, gap_s: float,
                             root: Path, keep_dir: Path | None = None) -> dict[str, Any]:
    fleet = Fleet(root / name)
    began = mono()
    try:
        await fleet.start()
        started_in = mono() - began
        result = await run(fleet, faults * repeat, gap_s=gap_s, tail_s=gap_s, pace_s=0.0)
    finally:
        await fleet.stop()
    h = result.history
    verdict = check(h)
    if not verdict.ok:  # keep the evidence: every attempt and apply, for a look at what broke
        evidence = root.parent / f"{name}-history.json" if keep_dir is None else keep_dir / f"{name}-history.json"
        evidence.write_text(json.dumps({
            "verdict": str(verdict), "started_at": result.started_at,
            "faults": [dataclasses.asdict(f) for f in result.faults],
            "attempts": [{**dataclasses.asdict(a), "answer": a.answer.value} for a in h.attempts],
            "applies": [dataclasses.asdict(a) for a in h.applies], "stream": h.stream}, default=str))
        print(f"{name}: history kept in {evidence}", flush=True)
    routers = fleet.names("router")
    per_fault = [{"fault": f.name, "target": f.target, "took_s": round(f.back - f.began, 3),
                  "election_s": None if f.election_s is None else round(f.election_s, 3),
                  "writes_refused_s": round(writes_refused_s(h.attempts, f.began), 3),
                  "convergence_s": _round(convergence_s(h, f, routers))} for f in result.faults]
    counts = {answer.value: sum(a.answer is answer for a in h.attempts) for answer in Answer}
    failed = Counter(c.reason for c in h.chats if not c.ok)
    elections = [f["election_s"] for f in per_fault if f["election_s"] is not None]
    return {
        "scenario": name, "fleet_started_s": round(started_in, 1),
        "run_s": round(result.ended_at - result.started_at, 1), "faults": len(result.faults),
        "fault_kinds": sorted({f"{f.name} {f.target}" if f.name in ("kill", "pause") else f.name
                               for f in result.faults}),
        "attempts": len(h.attempts), **counts,
        "lost": sum(p.kind == "lost_write" for p in verdict.problems),
        "no_definite_answer": dict(result.unknown_why), "unexpected_answers": result.unexpected[:10],
        "kv_events_dropped_by_routers": result.kv_dropped,
        # Each router's prefix index after the faults (tests/reliability/fleet_traffic.kv_truth).
        "kv_index_true": {r: t.ok for r, t in result.kv_truth.items()},
        "chats": len(h.chats), "chats_failed": sum(not c.ok for c in h.chats), "chats_failed_why": dict(failed),
        "chats_passed_over": dict(Counter(f"{r}: {why}" for r, why in result.passed_over)),
        "writes_refused_s": percentiles([f["writes_refused_s"] for f in per_fault]),
        "convergence_s": percentiles([f["convergence_s"] for f in per_fault if f["convergence_s"] is not None]),
        "leader_election_s": percentiles(elections) if elections else None,
        "per_fault": per_fault,
        "reconcile_ok": bool(result.reconcile.get("ok")), "verify_ok": bool(result.verify.get("ok")),
        "reconcile": {k: v for k, v in result.reconcile.items() if v or k in ("ok", "status")},
        "verify": {k: result.verify.get(k) for k in ("status", "took_s", "ok", "checked", "chain", "first_broken_id",
                                                     "reason")},
        "verdict": str(verdict) if not result.unexpected
        else f"{verdict}; unexpected answers: {len(result.unexpected)}",
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _pct(p: dict[str, Any] | None) -> str:
    if not p or p.get("p50") is None:
        return "-"
    return f"{p['p50']} / {p['p99']} / {p['max']}"


def _fleet_markdown(results: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Fleet scenarios", "",
             "3-node NATS cluster (R3, fsync always), PostgreSQL, 2 control planes, 3 routers (one behind the "
             "partition proxy), 4 mock workers, all real processes; 2 selection writers (CAS patches and "
             "rollbacks) and 1 threshold writer (partial CAS writes) at full speed, failing over between the "
             "control planes; 2 chat clients failing over between routers that do not answer or answer 503. "
             "Times in seconds, p50 / p99 / max over the scenario's faults. *Convergence*: from the fault's "
             "end (the process healthy again, the link passing again) until every router applied the first "
             "write accepted after it.", "",
             "| scenario | faults | patches attempted | accepted | conflicts | refused | no answer | lost | "
             "writes refused | convergence | leader election | chats | chats failed (why) | "
             "reconcile / verify / KV index | checker |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['scenario']} | error: {r['error']} |" + " |" * 13)
            continue
        why = ", ".join(f"{k}: {v}" for k, v in r["chats_failed_why"].items()) or "-"
        if r["kv_events_dropped_by_routers"]:
            r["fault_kinds"] = [*r["fault_kinds"], f"{r['kv_events_dropped_by_routers']} KV events dropped by the "
                                                   "routers' rate limit"]
        lines.append(
            f"| {r['scenario']} | {r['faults']} ({', '.join(r['fault_kinds'])}) | {r['attempts']} | {r['accepted']} | "
            f"{r['conflict']} | {r['refused']} | {r['unknown']} | {r['lost']} | {_pct(r['writes_refused_s'])} | "
            f"{_pct(r['convergence_s'])} | {_pct(r['leader_election_s'])} | {r['chats']} | "
            f"{r['chats_failed']} ({why}) | {'ok' if r['reconcile_ok'] else 'PROBLEMS'} / "
            f"{'ok' if r['verify_ok'] else 'PROBLEMS'} / "
            f"{'ok' if all(r['kv_index_true'].values()) else 'PROBLEMS'} | {r['verdict']} |")
    speed = {r["scenario"]: r for r in results if "error" not in r}
    node = speed.get("fleet_nats_node_kill", {}).get("leader_election_s")
    lines += ["", "### Speed: writes refused and routers back on the head, beside the raw leader election", "",
              "| fault | writes refused (p50 / p99 / max) | every router on a post-fault write after | "
              "JetStream leader election (same run) |", "|---|---|---|---|"]
    for name, label in (("fleet_nats_node_kill", "NATS stream-leader node kill -9"),
                        ("fleet_nats_cluster_restart", "whole NATS cluster kill -9 and restart"),
                        ("fleet_controlplane_kill", "control plane kill -9")):
        r = speed.get(name)
        if r is None:
            continue
        election = _pct(r["leader_election_s"]) if r["leader_election_s"] else (
            f"none forced (node kill: {_pct(node)})")
        lines.append(f"| {label} | {_pct(r['writes_refused_s'])} | {_pct(r['convergence_s'])} | {election} |")
    return lines


def _markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    fleet = [r for r in results if r["scenario"].startswith("fleet_")]
    results = [r for r in results if not r["scenario"].startswith("fleet_")]
    lines = ["# Reliability report", "", f"Run {meta['at']} on {meta['machine']} ({meta['cpus']} CPUs; "
             f"single scenarios {meta['seconds']} s each, fleet faults x{meta['repeat']} {meta['gap']} s apart; "
             "`python bench/reliability.py`)" + (
                 f"; {', '.join(meta['rerun'])} run again then, the others at {meta['others_at']}."
                 if meta.get("rerun") else "."), "", "## Single-process scenarios", "",
             "| scenario | attempts | accepted | conflicts | refused | unknown | lost | writes refused (s) | "
             "router on a post-fault write after (s) | reconcile | checker |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['scenario']} | {r['attempts']} | {r['accepted']} | {r['conflict']} | {r['refused']} | "
                     f"{r['unknown']} | {r['lost']} | {r['writes_refused_s']} | {r['router_on_new_writes_after_s']} "
                     f"| {'ok' if r['reconcile_ok'] else 'PROBLEMS'} | {r['verdict']} |")
    if fleet:
        lines += _fleet_markdown(fleet)
    return "\n".join(lines) + "\n"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--repeat", type=int, default=3, help="each fleet fault this many times")
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between fleet faults")
    everything = sorted(SCENARIOS) + list(FLEET_SCENARIOS)
    parser.add_argument("--scenario", nargs="*", choices=everything, default=everything)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reliability")
    parser.add_argument("--update", action="store_true",
                        help="keep the other scenarios' results already in --out (run some again)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="rudder-reliability-") as tmp:
        os.chmod(tmp, 0o755)  # (PostgreSQL runs as its own system user when we are root)
        for name in args.scenario:
            if name in FLEET_SCENARIOS:
                try:
                    result = await run_fleet_scenario(name, FLEET_SCENARIOS[name], repeat=args.repeat,
                                                      gap_s=args.gap, root=Path(tmp), keep_dir=args.out.parent)
                except Exception as exc:  # one scenario's failure must not lose the others' results
                    result = {"scenario": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            else:
                result = await run_scenario(name, SCENARIOS[name], args.seconds, Path(tmp))
            print(json.dumps(result), flush=True)
            results.append(result)
    meta = {"at": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "seconds": args.seconds, "repeat": args.repeat, "gap": args.gap}
    if args.update and args.out.with_suffix(".json").exists():
        ran = {r["scenario"] for r in results}
        before = json.loads(args.out.with_suffix(".json").read_text())
        kept = [r for r in before["results"] if r["scenario"] not in ran]
        order = sorted(SCENARIOS) + list(FLEET_SCENARIOS)
        results = sorted(kept + results, key=lambda r: order.index(r["scenario"]))
        meta["rerun"] = sorted(ran)
        meta["others_at"] = before["meta"].get("others_at") or before["meta"]["at"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(results, meta))
    print(_markdown(results, meta))


if __name__ == "__main__":
    asyncio.run(main())
