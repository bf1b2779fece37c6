"""Policy propagation: accepted publish -> the last of N router processes applied it.

For N router replicas (separate ``python -m router`` processes; default N = 1, 8, 32), patches
are published one after another with compare-and-set and a signature, as the control plane does;
the latency of a patch is from just before the publish to the arrival of the last replica's ACK
on ``rudder.acks.<router_id>`` (a router ACKs after its scheduler applied the revision).
Baselines measured in the same run:

- **bare fan-out**: N processes that only hold an ordered JetStream consumer on the same subject
  and answer each message on their ACK subject (no verify, no apply, no status): what JetStream
  itself costs. Aim: routers' p99 at most 3x the bare fan-out's at 8 and 32.
- **security off**: the same with every process on one all-rights identity over plaintext (the
  bus still authenticates: Rudder has no anonymous mode; signatures stay on) vs **on**: scoped
  identities and TLS. Aim: ≤ 1 ms more p99.
- **HTTP each replica** (``--reference``): the operator calling every replica's in-memory
  endpoint in turn, as with the reference router.

``--ha`` runs on a 3-node JetStream cluster (R3, fsync always). ``--wide 1000`` also times a
router serving 1000 models from spawn to ready (aim: under 2 s).

    python bench/propagation.py [--routers 1,8,32] [--ha] [--security both|on|off] [--wide 1000]
"""

from __future__ import annotations

import argparse
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

from bench.common import policy_key_files  # noqa: E402
from bus.connect import connect  # noqa: E402
from bus.identities import Identity, IdentityKind  # noqa: E402
from bus.keyfiles import load_signing_key  # noqa: E402
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


class Case:
    """One bus set-up: who the processes connect as (scoped identities or one all-rights identity)."""

    def __init__(self, bus: LocalBus, *, scoped: bool) -> None:
        self.bus = bus
        self.scoped = scoped

    def env(self, identity: Identity) -> dict[str, str]:
        return self.bus.env(identity if self.scoped else Identity(IdentityKind.ADMIN))

    def options(self, identity: Identity, name: str) -> Any:
        return self.bus.options(identity if self.scoped else Identity(IdentityKind.ADMIN), name=name)


def stop_procs(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


async def fanout_subscriber() -> None:
    """A bare JetStream subscriber: ordered consumer, answer each message on its ACK subject."""
    from nats.js.api import DeliverPolicy

    from bus.connect import BusOptions

    sid = os.environ["BENCH_ID"]
    opts = BusOptions.from_settings(nats_url=os.environ["RUDDER_NATS_URL"],
                                    nats_creds=Path(os.environ["RUDDER_NATS_CREDS"]),
                                    nats_ca=Path(ca) if (ca := os.environ.get("RUDDER_NATS_CA")) else None,
                                    name=f"bench-fanout-{sid}")
    nc = await connect(opts)
    subject = f"rudder.acks.{sid}"

    async def on_msg(msg: Any) -> None:
        await nc.publish(subject, str(msg.metadata.sequence.stream).encode())

    await nc.jetstream().subscribe(policy_subject(MODEL, PolicyKind.BUSY_THRESHOLD.value),
                                   stream="RUDDER_POLICY", cb=on_msg, ordered_consumer=True,
                                   deliver_policy=DeliverPolicy.NEW, idle_heartbeat=0.5)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def publish_and_wait(case: Case, ids: list[str], patches: int, revision: int,
                           decode: Any) -> tuple[list[float], int]:
    """Publish ``patches`` signed events; each one's latency is until every id answered."""
    nc = await connect(case.options(Identity(IdentityKind.CONTROLPLANE), "bench-propagation"))
    js = nc.jetstream()
    waiting: dict[int, set[str]] = {}
    done: dict[int, asyncio.Future[float]] = {}

    async def on_ack(msg: Any) -> None:
        rid, rev = decode(msg)
        left = waiting.get(rev)
        if left is not None:
            left.discard(rid)
            if not left and not done[rev].done():
                done[rev].set_result(time.perf_counter())

    await nc.subscribe(ACKS_SUBJECTS, cb=on_ack)
    await nc.flush()
    subject = policy_subject(MODEL, PolicyKind.BUSY_THRESHOLD.value)
    signer = load_signing_key(policy_key_files()[0])  # sign as the control plane does
    times: list[float] = []
    try:
        for i in range(patches + 5):  # the first 5 warm up and are not counted
            doc = {"active_prefill_tokens_threshold": 1000 + i}
            event = PolicyEvent(
                event_id=uuid.uuid4(), model=MODEL, kind=PolicyKind.BUSY_THRESHOLD,
                op=PolicyOp.PATCH, expected_revision=revision, changes=doc, document=doc,
                actor="bench", request_id=uuid.uuid4().hex, at=datetime.now(UTC),
            )
            info = await js.stream_info("RUDDER_POLICY")
            expected_seq = info.state.last_seq + 1  # register before the ACKs can arrive
            fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            waiting[expected_seq], done[expected_seq] = set(ids), fut
            payload = event.to_bytes()
            t0 = time.perf_counter()
            ack = await js.publish(subject, payload, headers={
                HDR_EXPECTED_LAST_SUBJECT_SEQ: str(revision), HDR_MSG_ID: str(event.event_id),
                **signer.sign(subject, payload),
            })
            assert ack.seq == expected_seq, (ack.seq, expected_seq)
            revision = ack.seq
            t1 = await asyncio.wait_for(fut, 20)
            if i >= 5:
                times.append(t1 - t0)
    finally:
        await nc.close()
    return times, revision


def _router_ack(msg: Any) -> tuple[str, int]:
    ack = decode_apply_ack(msg.data)
    return ack.router_id, ack.revision


def _fanout_ack(msg: Any) -> tuple[str, int]:
    return msg.subject.rsplit(".", 1)[1], int(msg.data)


async def measure_routers(case: Case, n: int, patches: int, revision: int) -> tuple[list[float], int]:
    procs: list[subprocess.Popen[bytes]] = []
    ids = [f"bench-{n}-{i}" for i in range(n)]
    ports = [free_port() for _ in range(n)]
    try:
        for rid, port in zip(ids, ports, strict=True):
            procs.append(spawn([sys.executable, "-m", "router"], {
                **case.env(Identity(IdentityKind.ROUTER, router_id=rid)), "RUDDER_MODELS": json.dumps([MODEL]),
                "RUDDER_PORT": str(port), "RUDDER_ROUTER_ID": rid, "RUDDER_LOG_LEVEL": "WARNING",
                "RUDDER_POLICY_VERIFY_KEYS": str(policy_key_files()[1]),
                "RUDDER_STREAM_REPLICAS": str(len(case.bus.servers) if len(case.bus.servers) >= 3 else 1),
            }))
        for port in ports:
            await wait_ok(f"http://127.0.0.1:{port}/live")
        await asyncio.sleep(0.5)  # their consumers are live
        return await publish_and_wait(case, ids, patches, revision, _router_ack)
    finally:
        stop_procs(procs)


async def measure_fanout(case: Case, n: int, patches: int, revision: int) -> tuple[list[float], int]:
    procs: list[subprocess.Popen[bytes]] = []
    ids = [f"fan-{n}-{i}" for i in range(n)]
    try:
        for sid in ids:
            full = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_ID=sid,
                        **case.env(Identity(IdentityKind.ROUTER, router_id=sid)))
            procs.append(subprocess.Popen([sys.executable, __file__, "--fanout-subscriber"], env=full,  # noqa: ASYNC220
                                          cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            assert line.strip() == b"ready", line
        return await publish_and_wait(case, ids, patches, revision, _fanout_ack)
    finally:
        stop_procs(procs)


async def measure_reference(n: int, patches: int) -> list[float]:
    procs = []
    ports = [free_port() for _ in range(n)]
    try:
        for port in ports:
            procs.append(spawn([sys.executable, __file__, "--reference-server", str(port)], {}))
        for port in ports:
            await wait_ok(f"http://127.0.0.1:{port}/busy_threshold", "POST")
        ref: list[float] = []
        async with httpx.AsyncClient() as client:
            for port in ports:  # warm the connections
                await client.post(f"http://127.0.0.1:{port}/busy_threshold", json={})
            for i in range(patches):
                t0 = time.perf_counter()
                for port in ports:
                    r = await client.post(f"http://127.0.0.1:{port}/busy_threshold",
                                          json={"active_prefill_tokens_threshold": 1000 + i})
                    r.raise_for_status()
                ref.append(time.perf_counter() - t0)
        return ref
    finally:
        stop_procs(procs)


async def measure_wide(case: Case, models: int) -> float:
    """Seconds from spawning a router that serves ``models`` models until its /health is 200."""
    port = free_port()
    t0 = time.perf_counter()
    proc = spawn([sys.executable, "-m", "router"], {
        **case.env(Identity(IdentityKind.ROUTER, router_id="bench-wide")), "RUDDER_ROUTER_ID": "bench-wide",
        "RUDDER_MODELS": json.dumps([f"wide/model-{i:04d}" for i in range(models)]), "RUDDER_MODE": "round_robin",
        "RUDDER_PORT": str(port), "RUDDER_LOG_LEVEL": "WARNING",
        "RUDDER_POLICY_VERIFY_KEYS": str(policy_key_files()[1]),
        "RUDDER_STREAM_REPLICAS": str(len(case.bus.servers) if len(case.bus.servers) >= 3 else 1),
    })
    try:
        await wait_ok(f"http://127.0.0.1:{port}/live", within=120)
        return time.perf_counter() - t0
    finally:
        stop_procs([proc])


def stats(times: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(times, 0.5) * 1e3, "p99_ms": pct(times, 0.99) * 1e3, "max_ms": max(times) * 1e3}


async def run_bus(tmp: Path, *, ha: bool, tls: bool, scoped: bool, sizes: list[int], patches: int,
                  wide: int, reference: bool) -> dict[str, Any]:
    from bus.streams import BusLayout

    nodes = 3 if ha else 1
    bus = LocalBus(tmp, tls=tls, nodes=nodes)
    bus.start(BusLayout(replicas=3 if ha else 1, history_depth=64))
    case = Case(bus, scoped=scoped)
    security = "security on (scoped, TLS)" if scoped else "security off (one identity, plaintext)"
    label = f"{'ha' if ha else 'single'}/{security}"
    out: dict[str, Any] = {"bus": "3-node R3" if ha else "single node", "scoped_identities": scoped, "tls": tls,
                           "cases": []}
    revision = 0
    try:
        for n in sizes:
            routers, revision = await measure_routers(case, n, patches, revision)
            bare, revision = await measure_fanout(case, n, patches, revision)
            row: dict[str, Any] = {"routers": n, "patches": patches, "router": stats(routers),
                                   "bare_fanout": stats(bare)}
            row["p99_ratio_to_bare"] = row["router"]["p99_ms"] / row["bare_fanout"]["p99_ms"]
            if reference:
                row["http_each_replica"] = stats(await measure_reference(n, patches))
            out["cases"].append(row)
            r, b = row["router"], row["bare_fanout"]
            print(f"{label:<46} N={n:<3} router p50 {r['p50_ms']:6.2f} p99 {r['p99_ms']:6.2f} ms"
                  f" | bare fan-out p50 {b['p50_ms']:6.2f} p99 {b['p99_ms']:6.2f} ms"
                  f" | p99 ratio {row['p99_ratio_to_bare']:.2f}"
                  + (f" | HTTP each p99 {row['http_each_replica']['p99_ms']:.2f} ms" if reference else ""), flush=True)
        if wide:
            out["wide"] = {"models": wide, "ready_s": await measure_wide(case, wide)}
            print(f"{label:<46} router serving {wide} models ready in {out['wide']['ready_s']:.2f} s", flush=True)
    finally:
        bus.stop()
    return out


async def main(args: argparse.Namespace) -> None:
    sizes = [int(x) for x in args.routers.split(",")]
    runs = []
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.security]
    with tempfile.TemporaryDirectory() as tmp:
        for i, scoped in enumerate(modes):
            runs.append(await run_bus(Path(tmp) / f"run{i}", ha=args.ha, tls=scoped, scoped=scoped, sizes=sizes,
                                      patches=args.patches, wide=args.wide if scoped else 0,
                                      reference=args.reference and scoped))
    if len(runs) == 2:
        print("security on vs off (same run):")
        for on, off in zip(runs[0]["cases"], runs[1]["cases"], strict=True):
            print(f"  N={on['routers']:<3} p99 {on['router']['p99_ms']:.2f} vs {off['router']['p99_ms']:.2f} ms"
                  f" (+{on['router']['p99_ms'] - off['router']['p99_ms']:.2f} ms)")
    out = {
        "benchmark": "propagation", "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "at": datetime.now(UTC).isoformat(),
        "note": "latency = signed CAS publish -> last router's ACK; bare fan-out = ordered consumers "
                "answering each message (same identities, same bus)",
        "runs": runs,
    }
    name = "propagation_ha.json" if args.ha else "propagation.json"
    path = Path(__file__).parent / "results" / name
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reference-server":
        reference_server(int(sys.argv[2]))
    elif len(sys.argv) == 2 and sys.argv[1] == "--fanout-subscriber":
        asyncio.run(fanout_subscriber())
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        parser.add_argument("--routers", default="1,8,32")
        parser.add_argument("--patches", type=int, default=100)
        parser.add_argument("--ha", action="store_true")
        parser.add_argument("--security", choices=["both", "on", "off"], default="both")
        parser.add_argument("--wide", type=int, default=1000, help="models for the readiness case (0: skip)")
        parser.add_argument("--reference", action="store_true", help="also time HTTP to each replica")
        asyncio.run(main(parser.parse_args()))
