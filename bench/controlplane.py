"""Control-plane write throughput and latency, beside a bare JetStream CAS publish.

Starts a real nats-server and PostgreSQL (embedded), runs the control plane in its own process
(uvicorn), then, at each concurrency, has N clients each patch their own model in a loop (every
PATCH carries the right expected_revision, so every one is accepted) for a fixed time. The
baseline does the same with bare CAS publishes straight to JetStream, in the same run. The ratio
shows what validation, the admin HTTP layer and the two audit writes cost.

    python bench/controlplane.py [--seconds 5] [--concurrency 1 8 32] [--baseline]

The control plane runs as it ships: as the app database role (not the owner), with signed audit
checkpoints on. ``--baseline`` first runs the configuration before issue 8 in the same run (the
database superuser, checkpoints off) so the two figures sit side by side.

Prints a table and writes bench/results/controlplane.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bus.connect import connect  # noqa: E402
from bus.identities import Identity, IdentityKind  # noqa: E402
from cli.embedded import DatabaseRole, EmbeddedPostgres, LocalBus, free_port, new_password  # noqa: E402
from cli.keys import ensure_key, ensure_keys  # noqa: E402
from controlplane.auth import Role, create_token_sync  # noqa: E402
from controlplane.protocol.signing import Purpose  # noqa: E402
from controlplane.protocol.subjects import HDR_EXPECTED_LAST_SUBJECT_SEQ, HDR_MSG_ID, policy_subject  # noqa: E402
from migrations import upgrade  # noqa: E402


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def run_clients(concurrency: int, seconds: float, one: Any) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def client(i: int) -> None:
        nonlocal errors
        state: dict[str, Any] = {"revision": 0, "n": 0, "model": f"bench/m-{uuid.uuid4().hex[:6]}-{i}"}
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            ok = await one(state)
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {
        "accepted_per_s": len(latencies) / elapsed, "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000, "mean_ms": statistics.fmean(latencies) * 1000 if latencies else 0,
        "count": len(latencies), "errors": errors,
    }


class KeepAliveClient:
    """A minimal HTTP/1.1 keep-alive client on one connection: the load generator shares the two
    cores with the server, so it must cost little (httpx's pool costs more CPU than the server's
    own request handling, and its tail shows up in the server's figures)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def patch(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (f"PATCH {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Patcher:
    """PATCH loops against one control plane, each client on its own keep-alive connection."""

    def __init__(self, admin_url: str, token: str) -> None:
        self.host, port = admin_url.removeprefix("http://").split(":")
        self.port, self.token = int(port), token
        self.clients: dict[str, KeepAliveClient] = {}

    async def __call__(self, state: dict[str, Any]) -> bool:
        state["n"] += 1
        http = self.clients.setdefault(state["model"], KeepAliveClient(self.host, self.port, self.token))
        status, body = await http.patch("/router_policy", json.dumps({
            "model": state["model"], "expected_revision": state["revision"],
            "parameters": {"router_temperature": state["n"] / 1000}}).encode())
        if status != 200:
            return False
        state["revision"] = json.loads(body)["revision"]
        return True

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


async def bench(bus: LocalBus, targets: dict[str, tuple[str, str]], seconds: float,
                levels: list[int], rounds: int = 1) -> dict[str, list[dict[str, Any]]]:
    """At each level: bare CAS, then ``rounds`` rounds over the targets, back to back, each round
    in a rotated order (so a change in the machine's load, or running first or last, weighs on
    every configuration alike). A target's row is its median round; all rounds are kept."""
    nc = await connect(bus.options(Identity(IdentityKind.CONTROLPLANE), name="bench-bare-cas"))
    js = nc.jetstream()
    patchers = {name: Patcher(url, token) for name, (url, token) in targets.items()}
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}

    async def bare(state: dict[str, Any]) -> bool:
        state["n"] += 1
        payload = json.dumps({"model": state["model"], "document": {"router_temperature": state["n"] / 1000}})
        ack = await js.publish(policy_subject(state["model"], "selection"), payload.encode(), headers={
            HDR_EXPECTED_LAST_SUBJECT_SEQ: str(state["revision"]), HDR_MSG_ID: uuid.uuid4().hex})
        state["revision"] = ack.seq
        return True

    try:
        names = list(patchers)
        for c in levels:
            base = await run_clients(c, seconds, bare)
            for patch in patchers.values():
                await run_clients(c, min(1.0, seconds), patch)  # warm up
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    runs[name].append(await run_clients(c, seconds, patchers[name]))
            for name in names:
                ordered = sorted(runs[name], key=lambda x: x["accepted_per_s"])
                full = ordered[len(ordered) // 2]
                out[name].append({"concurrency": c, "bare_cas": base, "controlplane": full,
                                  "rounds_accepted_per_s": [x["accepted_per_s"] for x in runs[name]],
                                  "throughput_ratio": full["accepted_per_s"] / base["accepted_per_s"],
                                  "p50_ratio": full["p50_ms"] / base["p50_ms"]})
                print(f"  c={c} {name}: {full['accepted_per_s']:.0f} patches/s median of "
                      f"{[round(x['accepted_per_s']) for x in runs[name]]} (bare {base['accepted_per_s']:.0f}/s)",
                      flush=True)
    finally:
        for p in patchers.values():
            p.close()
        await nc.close()
    return out


def start_controlplane(bus: LocalBus, db: str, extra_env: dict[str, str], *,
                       scoped: bool = True) -> tuple[subprocess.Popen[bytes], str, str]:
    """A control plane process on ``db`` (its settings in the environment); (proc, url, token).
    ``scoped``: its own identity (else the all-rights one, for the security-off comparison)."""
    token = create_token_sync(db, "bench", Role.OPERATOR)
    port = free_port()
    seed, verify_keys, _ = ensure_keys(bus.data_dir / "keys")
    identity = Identity(IdentityKind.CONTROLPLANE if scoped else IdentityKind.ADMIN)
    env = dict(os.environ, **bus.env(identity), RUDDER_DATABASE_URL=db,
               RUDDER_ADMIN_PORT=str(port), RUDDER_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT),
               RUDDER_POLICY_SIGNING_KEY=str(seed), RUDDER_POLICY_VERIFY_KEYS=str(verify_keys), **extra_env)
    # RUDDER_BENCH_CP_SCRIPT: run the control plane through another script (e.g. a profiler wrapper)
    script = os.environ.get("RUDDER_BENCH_CP_SCRIPT")
    cmd = [script] if script else ["-m", "cli.main", "serve", "controlplane"]
    # cwd: `-m cli.main` resolves from the working directory first, so a bench run from another
    # tree (an A/B against an older commit) must run that tree's control plane, not this one.
    proc = subprocess.Popen([sys.executable, *cmd], env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url, token
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"control plane exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError("control plane did not become ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'conc':>4} | {'patches/s':>9} {'p50 ms':>7} {'p99 ms':>7} | {'bare CAS/s':>10} {'p50 ms':>7} {'p99 ms':>7}"
          f" | {'thr ratio':>9}")
    for row in rows:
        f, b = row["controlplane"], row["bare_cas"]
        print(f"{row['concurrency']:>4} | {f['accepted_per_s']:>9.0f} {f['p50_ms']:>7.2f} {f['p99_ms']:>7.2f} | "
              f"{b['accepted_per_s']:>10.0f} {b['p50_ms']:>7.2f} {b['p99_ms']:>7.2f} | {row['throughput_ratio']:>9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--baseline", action="store_true",
                        help="also run the pre-issue-8 configuration (superuser, no checkpoints), "
                             "interleaved level by level")
    parser.add_argument("--security-off", action="store_true",
                        help="also run a control plane on one all-rights identity over plaintext "
                             "(the shipped one has its own identity and TLS)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds per level over the configurations, in rotated order; the median is kept")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "controlplane.json"))
    args = parser.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="rudder-bench-") as tmp:
        nats_srv = LocalBus(Path(tmp) / "bare")
        pg = EmbeddedPostgres(Path(tmp) / "pg")
        print("starting nats-server and PostgreSQL ...", flush=True)
        nats_srv.start()
        pg.start()
        owner, app = DatabaseRole("rudder_owner", new_password()), DatabaseRole("rudder_app", new_password())
        key = Path(tmp) / "audit-signing.key"
        ensure_key(key, key.with_name("audit-signing.pub"), Purpose.CHECKPOINT)
        targets: dict[str, tuple[str, str]] = {}
        try:
            if args.baseline:
                # Its own database and bus, so its stream and chain never meet the other's.
                old_nats = LocalBus(Path(tmp) / "before", tls=True)
                old_nats.start()
                old = pg.create_database("rudder_before")
                upgrade(old)
                proc, url, token = start_controlplane(old_nats, old, {
                    "RUDDER_AUDIT_CHECKPOINTS": "false", "RUDDER_ALLOW_PRIVILEGED_DATABASE_ROLE": "true"})
                procs.append(proc)
                targets["baseline"] = (url, token)
            # Each control plane on a bus of its own, apart from the bare-CAS load (its reconciler
            # walks the whole policy stream, so sharing the bare publishes' bus would slow it).
            new_nats = LocalBus(Path(tmp) / "shipped", tls=True)
            new_nats.start()
            access = pg.provision("rudder", owner=owner, app=app)
            upgrade(access.owner_url)
            proc, url, token = start_controlplane(new_nats, access.app_url,
                                                  {"RUDDER_AUDIT_SIGNING_KEY": str(key)})
            procs.append(proc)
            targets["shipped"] = (url, token)
            if args.security_off:
                off_nats = LocalBus(Path(tmp) / "security-off")
                off_nats.start()
                off = pg.provision("rudder_off", owner=owner, app=app)
                upgrade(off.owner_url)
                proc, url, token = start_controlplane(off_nats, off.app_url,
                                                      {"RUDDER_AUDIT_SIGNING_KEY": str(key)}, scoped=False)
                procs.append(proc)
                targets["security_off"] = (url, token)
            print(f"{args.seconds}s per level; " + ", ".join(f"{k} at {v[0]}" for k, v in targets.items()),
                  flush=True)
            results = asyncio.run(bench(nats_srv, targets, args.seconds, args.concurrency, args.rounds))
        finally:
            for proc in procs:
                stop(proc)
            pg.stop()
            nats_srv.stop()
            for srv in (locals().get("old_nats"), locals().get("new_nats"), locals().get("off_nats")):
                if srv is not None:
                    srv.stop()
    rows, baseline, off_rows = results["shipped"], results.get("baseline"), results.get("security_off")
    print()
    if baseline is not None:
        print("baseline (database superuser, no checkpoints):")
        print_rows(baseline)
        print("\nas shipped (app role, signed checkpoints on):")
    print_rows(rows)
    if baseline is not None:
        for old_row, new_row in zip(baseline, rows, strict=True):
            change = new_row["controlplane"]["accepted_per_s"] / old_row["controlplane"]["accepted_per_s"] - 1
            print(f"  c={new_row['concurrency']}: accepted patches/s {change:+.1%} vs baseline")
    if off_rows is not None:
        print("\nsecurity off (one all-rights identity, plaintext):")
        print_rows(off_rows)
        for off_row, new_row in zip(off_rows, rows, strict=True):
            change = new_row["controlplane"]["accepted_per_s"] / off_row["controlplane"]["accepted_per_s"] - 1
            print(f"  c={new_row['concurrency']}: accepted patches/s {change:+.1%} with security on vs off")
    result: dict[str, Any] = {
        "benchmark": "controlplane", "seconds_per_level": args.seconds, "rounds": args.rounds,
        "config": "app database role, signed audit checkpoints on (defaults: every 256 rows, 10 s)",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    if off_rows is not None:
        result["security_off"] = {"config": "one all-rights NATS identity over plaintext (signatures on), "
                                            "same run", "rows": off_rows}
    if baseline is not None:
        result["baseline"] = {"config": "database superuser, checkpoints off (before issue 8), same run, "
                                        "interleaved per level", "rows": baseline}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
