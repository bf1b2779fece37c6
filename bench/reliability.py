"""Reliability report (issue 18, item 5): each fault scenario for a bounded time, checked by the
history checker (tests/reliability/history.py).

Per scenario: a real NATS (JetStream) and PostgreSQL on loopback, one control plane and one router
in this process, three CAS writers on the admin API. One fault is injected a third of the way in;
afterwards the reconciler settles what it left ambiguous and the history is checked.

    python bench/reliability.py [--seconds 6] [--scenario nats_kill ...]

Writes ``bench/results/reliability.json`` and ``bench/results/reliability.md``: per scenario the
faults injected, write attempts (accepted / conflicts / refused / unknown / lost), how long writes
were refused, how long until the router applied a revision written after the fault, and the
checker's verdict. (Scenarios with several routers, a NATS cluster and chat traffic are the
fleet harness's next step: see the issue.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import uuid
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
from tests.reliability.fleet_history import cas_writer, mono, read_back  # noqa: E402
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


def _refused_for(attempts: list[Attempt], fault_at: float) -> float:
    """From the first attempt after the fault began that was not answered (200 or 409) to the
    first one answered after it (0 when none was refused)."""
    after = sorted((a for a in attempts if a.invoked >= fault_at), key=lambda a: a.invoked)
    first_bad = next((a for a in after if a.answer in (Answer.REFUSED, Answer.UNKNOWN)), None)
    if first_bad is None:
        return 0.0
    first_good = next((a for a in after if a.invoked > first_bad.invoked
                       and a.answer in (Answer.ACCEPTED, Answer.CONFLICT)), None)
    end = first_good.completed if first_good is not None and first_good.completed else after[-1].invoked
    return max(0.0, end - first_bad.invoked)


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
            "writes_refused_s": round(_refused_for(attempts, fault_at), 3),
            "router_on_new_writes_after_s": None if converge is None else round(converge, 3),
            "reconcile_ok": report.ok, "verdict": str(verdict),
        }
    finally:
        nats.stop(kill=True)
        pg.stop(mode="immediate")


def _markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# Reliability report", "", f"Run {meta['at']} on {meta['machine']} ({meta['seconds']} s per scenario; "
             "`python bench/reliability.py`).", "",
             "| scenario | attempts | accepted | conflicts | refused | unknown | lost | writes refused (s) | "
             "router on a post-fault write after (s) | reconcile | checker |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['scenario']} | {r['attempts']} | {r['accepted']} | {r['conflict']} | {r['refused']} | "
                     f"{r['unknown']} | {r['lost']} | {r['writes_refused_s']} | {r['router_on_new_writes_after_s']} "
                     f"| {'ok' if r['reconcile_ok'] else 'PROBLEMS'} | {r['verdict']} |")
    return "\n".join(lines) + "\n"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--scenario", nargs="*", choices=sorted(SCENARIOS), default=sorted(SCENARIOS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reliability")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="rudder-reliability-") as tmp:
        os.chmod(tmp, 0o755)  # (PostgreSQL runs as its own system user when we are root)
        for name in args.scenario:
            result = await run_scenario(name, SCENARIOS[name], args.seconds, Path(tmp))
            print(json.dumps(result))
            results.append(result)
    meta = {"at": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "seconds": args.seconds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(results, meta))
    print(_markdown(results, meta))


if __name__ == "__main__":
    asyncio.run(main())
