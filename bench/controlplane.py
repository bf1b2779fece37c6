"""Control-plane write throughput and latency, beside a bare JetStream CAS publish.

Starts a real nats-server and PostgreSQL (embedded), runs the control plane in its own process
(uvicorn), then, at each concurrency, has N clients each patch their own model in a loop (every
PATCH carries the right expected_revision, so every one is accepted) for a fixed time. The
baseline does the same with bare CAS publishes straight to JetStream, in the same run. The ratio
shows what validation, the admin HTTP layer and the two audit writes cost.

    python bench/controlplane.py [--seconds 5] [--concurrency 1 8 32]

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
from cli.embedded import EmbeddedPostgres, LocalBus, free_port  # noqa: E402
from cli.keys import ensure_keys  # noqa: E402
from controlplane.auth import Role, create_token_sync  # noqa: E402
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


async def bench(bus: LocalBus, admin_url: str, token: str, seconds: float, levels: list[int]) -> list[dict[str, Any]]:
    nc = await connect(bus.options(Identity(IdentityKind.CONTROLPLANE), name="bench-bare-cas"))
    js = nc.jetstream()
    host, port = admin_url.removeprefix("http://").split(":")
    clients: dict[str, KeepAliveClient] = {}
    rows = []

    async def bare(state: dict[str, Any]) -> bool:
        state["n"] += 1
        payload = json.dumps({"model": state["model"], "document": {"router_temperature": state["n"] / 1000}})
        ack = await js.publish(policy_subject(state["model"], "selection"), payload.encode(), headers={
            HDR_EXPECTED_LAST_SUBJECT_SEQ: str(state["revision"]), HDR_MSG_ID: uuid.uuid4().hex})
        state["revision"] = ack.seq
        return True

    async def patch(state: dict[str, Any]) -> bool:
        state["n"] += 1
        http = clients.setdefault(state["model"], KeepAliveClient(host, int(port), token))
        status, body = await http.patch("/router_policy", json.dumps({
            "model": state["model"], "expected_revision": state["revision"],
            "parameters": {"router_temperature": state["n"] / 1000}}).encode())
        if status != 200:
            return False
        state["revision"] = json.loads(body)["revision"]
        return True

    try:
        for c in levels:
            await run_clients(c, min(1.0, seconds), patch)  # warm up
            base = await run_clients(c, seconds, bare)
            full = await run_clients(c, seconds, patch)
            rows.append({"concurrency": c, "bare_cas": base, "controlplane": full,
                         "throughput_ratio": full["accepted_per_s"] / base["accepted_per_s"],
                         "p50_ratio": full["p50_ms"] / base["p50_ms"]})
            print(f"  c={c}: {full['accepted_per_s']:.0f} patches/s (bare {base['accepted_per_s']:.0f}/s)", flush=True)
    finally:
        for c in clients.values():
            c.close()
        await nc.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "controlplane.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rudder-bench-") as tmp:
        nats_srv = LocalBus(Path(tmp))
        pg = EmbeddedPostgres(Path(tmp) / "pg")
        print("starting nats-server and PostgreSQL ...", flush=True)
        nats_srv.start()
        pg.start()
        proc = None
        try:
            db = pg.create_database("rudder")
            upgrade(db)
            token = create_token_sync(db, "bench", Role.OPERATOR)
            port = free_port()
            seed, verify_keys, _ = ensure_keys(Path(tmp) / "keys")
            env = dict(os.environ, **nats_srv.env(Identity(IdentityKind.CONTROLPLANE)), RUDDER_DATABASE_URL=db,
                       RUDDER_ADMIN_PORT=str(port), RUDDER_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT),
                       RUDDER_POLICY_SIGNING_KEY=str(seed), RUDDER_POLICY_VERIFY_KEYS=str(verify_keys))
            # RUDDER_BENCH_CP_SCRIPT: run the control plane through another script (e.g. a profiler wrapper)
            script = os.environ.get("RUDDER_BENCH_CP_SCRIPT")
            cmd = [script] if script else ["-m", "cli.main", "serve", "controlplane"]
            proc = subprocess.Popen([sys.executable, *cmd], env=env)
            url = f"http://127.0.0.1:{port}"
            for _ in range(200):
                try:
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            print(f"control plane at {url}; {args.seconds}s per level", flush=True)
            rows = asyncio.run(bench(nats_srv, url, token, args.seconds, args.concurrency))
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            pg.stop()
            nats_srv.stop()
    print()
    print(f"{'conc':>4} | {'patches/s':>9} {'p50 ms':>7} {'p99 ms':>7} | {'bare CAS/s':>10} {'p50 ms':>7} {'p99 ms':>7}"
          f" | {'thr ratio':>9}")
    for row in rows:
        f, b = row["controlplane"], row["bare_cas"]
        print(f"{row['concurrency']:>4} | {f['accepted_per_s']:>9.0f} {f['p50_ms']:>7.2f} {f['p99_ms']:>7.2f} | "
              f"{b['accepted_per_s']:>10.0f} {b['p50_ms']:>7.2f} {b['p99_ms']:>7.2f} | {row['throughput_ratio']:>9.3f}")
    result = {"benchmark": "controlplane", "seconds_per_level": args.seconds, "machine": {
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
