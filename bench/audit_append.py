"""Audit append throughput: plain serialised inserts vs group commit (DESIGN §4).

The write path does two appends per accepted patch (received, then decision), one after the
other. This measures "patches" = two sequential appends per simulated request, at several
concurrencies, with the chain lock and a real commit (fsync on) per transaction, against an
embedded PostgreSQL started for the run (or ``--url`` for an existing, migrated-on-the-fly one).

    python bench/audit_append.py [--seconds 5] [--concurrency 1 8 32] [--url postgresql+asyncpg://...]

Prints a table and writes ``bench/results/audit_append.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import migrations  # noqa: E402
from cli.embedded import EmbeddedPostgres  # noqa: E402
from controlplane.audit.records import AuditEntry, AuditStage, Decision  # noqa: E402
from controlplane.audit.store import AuditStore  # noqa: E402


def entry(stage: AuditStage, event_id: uuid.UUID) -> AuditEntry:
    decision = Decision.PENDING if stage is AuditStage.RECEIVED else Decision.ACCEPTED
    return AuditEntry(
        event_id=event_id, stage=stage, decision=decision, actor="bench", roles=["operator"],
        auth_method="token", source_ip="127.0.0.1", user_agent="bench/1",
        request_id=uuid.uuid4().hex, model="meta-llama/Llama-3.1-8B-Instruct", kind="selection",
        op="patch", expected_revision=41, head_revision=41,
        new_revision=42 if decision is Decision.ACCEPTED else None,
        changes={"overlap_score_credit": 0.8}, before={"overlap_score_credit": 1.0},
        after={"overlap_score_credit": 0.8}, at=datetime.now(UTC),
    )


async def run_case(url: str, *, group_commit: bool, concurrency: int, seconds: float,
                   pool_size: int) -> dict[str, Any]:
    store = AuditStore.from_url(url, pool_size=pool_size, timeout_s=5.0,
                                group_commit=group_commit)
    latencies: list[float] = []
    patches = 0
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal patches
        while time.perf_counter() < deadline:
            event_id = uuid.uuid4()
            t0 = time.perf_counter()
            await store.append(entry(AuditStage.RECEIVED, event_id))
            await store.append(entry(AuditStage.DECISION, event_id))
            latencies.append(time.perf_counter() - t0)
            patches += 1

    try:
        await store.ping()
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        verify = await store.verify()
    finally:
        await store.close()
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else latencies * 99
    return {
        "mode": "group_commit" if group_commit else "serialised",
        "concurrency": concurrency,
        "patches": patches,
        "appends": 2 * patches,
        "seconds": round(elapsed, 3),
        "patches_per_s": round(patches / elapsed, 1),
        "appends_per_s": round(2 * patches / elapsed, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "chain_ok": verify.ok,
    }


async def bench(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    await migrations.upgrade_async(url)
    results = []
    for group_commit in (False, True):
        for concurrency in args.concurrency:
            result = await run_case(url, group_commit=group_commit, concurrency=concurrency,
                                    seconds=args.seconds, pool_size=max(10, concurrency))
            results.append(result)
            print(f"{result['mode']:>13} c={concurrency:<3} {result['appends_per_s']:>9.1f} "
                  f"appends/s  p50 {result['p50_ms']:.2f} ms  p99 {result['p99_ms']:.2f} ms",
                  file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--url", default=None, help="existing database (default: embedded)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "audit_append.json"))
    args = parser.parse_args()

    server = None
    with tempfile.TemporaryDirectory(prefix="rudder-bench-") as tmp:
        url = args.url
        if url is None:
            server = EmbeddedPostgres(Path(tmp) / "pgdata")
            server.start()
            url = server.create_database("bench")
        try:
            results = asyncio.run(bench(url, args))
        finally:
            if server is not None:
                server.stop(mode="immediate")

    header = f"{'mode':<13} {'conc':>4} {'appends/s':>10} {'patches/s':>10} {'p50 ms':>8} " \
             f"{'p99 ms':>8} {'chain':>6}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['mode']:<13} {r['concurrency']:>4} {r['appends_per_s']:>10.1f} "
              f"{r['patches_per_s']:>10.1f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
              f"{'ok' if r['chain_ok'] else 'BROKEN':>6}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "audit_append",
        "command": " ".join(["python bench/audit_append.py", *sys.argv[1:]]),
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "postgres": "embedded" if args.url is None else "external",
        "note": "one 'patch' = 2 sequential appends (received + decision); fsync on",
        "results": results,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
