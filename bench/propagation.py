"""Policy propagation: accepted publish -> the last of N router processes applied it.

For N = 1, 4, 8 router replicas (separate ``python -m router`` processes on one real nats-server),
200 patches are published one after another with compare-and-set, as the control plane does; the
latency of a patch is from just before the publish to the arrival of the last replica's ACK on
``rudder.acks.<router_id>`` (a router ACKs after the scheduler applied the revision). The
reference model is measured in the same run: the operator calls each replica's HTTP endpoint in
turn (N small HTTP servers that hold the setting in memory, like the reference router's
``POST /busy_threshold``), so its latency is the sum of N sequential HTTP round trips.

    python bench/propagation.py          # prints a table, writes bench/results/propagation.json
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bus.connect import connect  # noqa: E402
from bus.identities import Identity, IdentityKind  # noqa: E402
from cli.embedded import LocalBus, free_port  # noqa: E402
from controlplane.protocol.events import PolicyEvent, decode_apply_ack  # noqa: E402
from controlplane.protocol.policy import PolicyKind, PolicyOp  # noqa: E402
from controlplane.protocol.subjects import (  # noqa: E402
    ACKS_SUBJECTS,
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_MSG_ID,
    policy_subject,
)

MODEL = "bench/propagation-model"
PATCHES = 200
SIZES = (1, 4, 8)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def reference_server(port: int) -> None:
    """A replica's in-memory admin endpoint, as in the reference router."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    state: dict[str, Any] = {}

    async def set_threshold(request: Request) -> JSONResponse:
        state.update(await request.json())
        return JSONResponse(state)

    app = Starlette(routes=[Route("/busy_threshold", set_threshold, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    full = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.Popen(args, env=full, cwd=str(ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


async def wait_ok(url: str, method: str = "GET", within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                r = await client.request(method, url, json={} if method == "POST" else None, timeout=1)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def measure(bus: LocalBus, n: int, revision: int) -> tuple[dict[str, Any], int]:
    procs: list[subprocess.Popen[bytes]] = []
    router_ids = [f"bench-{n}-{i}" for i in range(n)]
    ports = [free_port() for _ in range(n)]
    ref_ports = [free_port() for _ in range(n)]
    try:
        for rid, port in zip(router_ids, ports, strict=True):
            procs.append(spawn([sys.executable, "-m", "router"], {
                **bus.env(Identity(IdentityKind.ROUTER, router_id=rid)), "RUDDER_MODELS": json.dumps([MODEL]),
                "RUDDER_PORT": str(port), "RUDDER_ROUTER_ID": rid, "RUDDER_LOG_LEVEL": "WARNING",
            }))
        for port in ref_ports:
            procs.append(spawn([sys.executable, __file__, "--reference-server", str(port)], {}))
        for port in ports:
            await wait_ok(f"http://127.0.0.1:{port}/live")
        for port in ref_ports:
            await wait_ok(f"http://127.0.0.1:{port}/busy_threshold", "POST")

        # The publisher stands in for the control plane (its identity); the ACK listener too.
        nc = await connect(bus.options(Identity(IdentityKind.CONTROLPLANE), name="bench-propagation"))
        js = nc.jetstream()
        waiting: dict[int, set[str]] = {}
        done: dict[int, asyncio.Future[float]] = {}

        async def on_ack(msg: Any) -> None:
            ack = decode_apply_ack(msg.data)
            left = waiting.get(ack.revision)
            if left is not None:
                left.discard(ack.router_id)
                if not left and not done[ack.revision].done():
                    done[ack.revision].set_result(time.perf_counter())

        await nc.subscribe(ACKS_SUBJECTS, cb=on_ack)
        await asyncio.sleep(0.3)
        subject = policy_subject(MODEL, PolicyKind.BUSY_THRESHOLD.value)
        bus: list[float] = []
        for i in range(PATCHES):
            doc = {"active_prefill_tokens_threshold": 1000 + i}
            event = PolicyEvent(
                event_id=uuid.uuid4(), model=MODEL, kind=PolicyKind.BUSY_THRESHOLD,
                op=PolicyOp.PATCH, expected_revision=revision, changes=doc, document=doc,
                actor="bench", request_id=uuid.uuid4().hex, at=datetime.now(UTC),
            )
            fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            # Register before the ACKs can arrive: the revision is the next stream sequence.
            info = await js.stream_info("RUDDER_POLICY")
            expected_seq = info.state.last_seq + 1
            waiting[expected_seq] = set(router_ids)
            done[expected_seq] = fut
            t0 = time.perf_counter()
            ack = await js.publish(subject, event.to_bytes(), headers={
                HDR_EXPECTED_LAST_SUBJECT_SEQ: str(revision), HDR_MSG_ID: str(event.event_id),
            })
            assert ack.seq == expected_seq, (ack.seq, expected_seq)
            revision = ack.seq
            t1 = await asyncio.wait_for(fut, 10)
            bus.append(t1 - t0)
        await nc.close()

        ref: list[float] = []
        async with httpx.AsyncClient() as client:
            for port in ref_ports:  # warm the connections
                await client.post(f"http://127.0.0.1:{port}/busy_threshold", json={})
            for i in range(PATCHES):
                t0 = time.perf_counter()
                for port in ref_ports:
                    r = await client.post(f"http://127.0.0.1:{port}/busy_threshold",
                                          json={"active_prefill_tokens_threshold": 1000 + i})
                    r.raise_for_status()
                ref.append(time.perf_counter() - t0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    return {
        "routers": n, "patches": PATCHES,
        "bus_p50_ms": pct(bus, 0.5) * 1e3, "bus_p99_ms": pct(bus, 0.99) * 1e3,
        "bus_max_ms": max(bus) * 1e3,
        "reference_http_p50_ms": pct(ref, 0.5) * 1e3, "reference_http_p99_ms": pct(ref, 0.99) * 1e3,
    }, revision


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalBus(Path(tmp))
        server.start()
        try:
            results = []
            revision = 0
            for n in SIZES:
                result, revision = await measure(server, n, revision)
                results.append(result)
                print(f"N={n}: bus p50 {result['bus_p50_ms']:.2f} ms p99 {result['bus_p99_ms']:.2f} ms | "
                      f"HTTP each replica p50 {result['reference_http_p50_ms']:.2f} ms "
                      f"p99 {result['reference_http_p99_ms']:.2f} ms", flush=True)
        finally:
            server.stop()
    out = {
        "benchmark": "propagation", "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "at": datetime.now(UTC).isoformat(),
        "note": "latency = publish -> last router's ACK; reference = sequential HTTP call to each replica",
        "cases": results,
    }
    path = Path(__file__).parent / "results" / "propagation.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reference-server":
        reference_server(int(sys.argv[2]))
    else:
        asyncio.run(main())
