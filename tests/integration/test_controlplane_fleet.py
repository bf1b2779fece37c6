"""The control plane's view of the fleet: router status from RUDDER_ROUTERS, ACK/NACKs recorded in
the audit database, workers from RUDDER_MEMBERSHIP, the legacy threshold API (real NATS + Postgres)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from nats.aio.client import Client as NATS

from bus.client import Bus
from controlplane.fleet import FleetView
from controlplane.protocol.events import (
    AckStatus,
    AppliedDocument,
    ApplyAck,
    MembershipEvent,
    MembershipOp,
    RouterStatus,
    WorkerRecord,
    doc_key,
)
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import BUCKET_ROUTERS, acks_subject, membership_subject
from tests import buskit
from tests.integration.cp_support import Tokens, client, controlplane

pytestmark = pytest.mark.timeout(120)


async def eventually(check: Callable[[], object], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_router_status_acks_and_nacks_are_shown_and_recorded(nats_url: str, db: str, tokens: Tokens,
                                                                   nc: NATS) -> None:
    model = f"fleet/{uuid.uuid4().hex[:6]}"
    async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as op, \
            client(cp, tokens.auditor) as auditor:
        r = await op.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                    "parameters": {"router_temperature": 0.2}})
        assert r.status_code == 200, r.text
        rev = r.json()["revision"]
        now = datetime.now(UTC)
        kv = await nc.jetstream().key_value(BUCKET_ROUTERS)
        key = doc_key(model, PolicyKind.SELECTION)
        in_sync = RouterStatus(router_id="r-a", models=[model], cache_inputs=["device", "host", "disk", "shared"],
                               applied={key: AppliedDocument(revision=rev, effective={"router_temperature": 0.2})},
                               started_at=now, heartbeat_at=now)
        behind = RouterStatus(router_id="r-b", models=[model], cache_inputs=["device"],
                              applied={key: AppliedDocument(revision=0, effective={"router_temperature": 0.0},
                                                            last_nack="host_cache_hit_weight needs host",
                                                            last_nack_revision=rev)},
                              started_at=now, heartbeat_at=now)
        await kv.put("r-a", in_sync.to_bytes())
        await kv.put("r-b", behind.to_bytes())
        await eventually(lambda: len(cp.controlplane.fleet.live_routers(model)) == 2)
        for status, router in ((AckStatus.ACK, "r-a"), (AckStatus.NACK, "r-b")):
            ack = ApplyAck(router_id=router, model=model, kind=PolicyKind.SELECTION, revision=rev, status=status,
                           detail="" if status is AckStatus.ACK else "host_cache_hit_weight needs host",
                           at=datetime.now(UTC))
            await nc.publish(acks_subject(router), ack.to_bytes())
        await nc.flush()

        docs = (await op.get("/router_policy", params={"model": model})).json()["documents"]
        selection = next(d for d in docs if d["kind"] == "selection")
        routers = {r["router_id"]: r for r in selection["routers"]}
        assert routers["r-a"]["applied_revision"] == rev and routers["r-a"]["in_sync"] is True
        assert routers["r-b"]["in_sync"] is False
        assert routers["r-b"]["last_nack"] == "host_cache_hit_weight needs host"
        listing = (await op.get("/routers", params={"model": model})).json()
        assert {r["router_id"] for r in listing["routers"]} == {"r-a", "r-b"}
        assert listing["heads"][key] == rev

        acks: list[dict[str, object]] = []

        async def fetch() -> None:
            nonlocal acks
            acks = (await auditor.get("/routers/acks", params={"model": model})).json()["acks"]

        for _ in range(100):
            await fetch()
            if len(acks) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted((a["router_id"], a["status"]) for a in acks) == [("r-a", "ACK"), ("r-b", "NACK")]
        assert (await op.get("/routers/acks")).status_code == 403  # operators are not auditors


async def test_workers_listing_and_threshold_alias(nats_url: str, db: str, tokens: Tokens, nc: NATS) -> None:
    model = f"fleet/{uuid.uuid4().hex[:6]}"
    now = datetime.now(UTC)
    worker = WorkerRecord(instance_id=2**64 - 1, model=model, url="http://127.0.0.1:1", block_size=64,
                          kv_total_blocks=1024, max_num_batched_tokens=8192, started_at=now)
    async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as op:
        await nc.jetstream().publish(membership_subject(model, worker.instance_id),
                                     MembershipEvent(op=MembershipOp.JOIN, worker=worker, at=now).to_bytes())
        await eventually(lambda: cp.controlplane.fleet.serves(model))
        workers = (await op.get("/workers", params={"model": model})).json()["workers"]
        assert [w["instance_id"] for w in workers] == [2**64 - 1]
        # the model is known (a live worker serves it): no create flag needed
        r = await op.post("/busy_threshold", json={"model": model, "active_decode_blocks_threshold": 0.9})
        assert r.status_code == 200, r.text
        assert r.json()["thresholds"] == {"active_decode_blocks_threshold": 0.9}
        r = await op.post("/router_policy/busy_threshold", json={"model": model,
                                                                 "active_prefill_tokens_threshold": 512})
        assert r.json()["thresholds"] == {"active_decode_blocks_threshold": 0.9,
                                          "active_prefill_tokens_threshold": 512}
        read_alias = (await op.get("/busy_threshold", params={"model": model})).json()
        read_new = (await op.get("/router_policy/busy_threshold", params={"model": model})).json()
        assert read_alias == read_new and read_new["revision"] == r.json()["revision"]
        # all null = read, publishes nothing
        r2 = await op.post("/busy_threshold", json={"model": model, "active_decode_blocks_threshold": None})
        assert r2.status_code == 200 and r2.json()["revision"] == r.json()["revision"]
        r3 = await op.post("/busy_threshold", json={"model": model, "unset": ["active_decode_blocks_threshold"]})
        assert r3.json()["thresholds"] == {"active_prefill_tokens_threshold": 512}
        r4 = await op.post("/busy_threshold", json={"model": model, "expected_revision": 1,
                                                    "active_decode_blocks_threshold": 0.5})
        assert r4.status_code == 409 and r4.json()["error"]["head_revision"] == r3.json()["revision"]
        r5 = await op.post("/busy_threshold", json={"model": model, "unset": ["bogus"]})
        assert r5.status_code == 422 and r5.json()["error"]["field"] == "unset[0]"
        worker_leave = MembershipEvent(op=MembershipOp.LEAVE, worker=worker, at=datetime.now(UTC))
        await nc.jetstream().publish(membership_subject(model, worker.instance_id), worker_leave.to_bytes())
        await eventually(lambda: not cp.controlplane.fleet.serves(model))


async def test_openapi_served_and_unknown_routes_use_the_error_shape(nats_url: str, db: str, tokens: Tokens) -> None:
    async with controlplane(nats_url, db) as cp, client(cp, tokens.viewer) as http:
        spec = (await http.get("/openapi.json")).json()
        for path in ("/router_policy", "/router_policy/history", "/router_policy/rollback",
                     "/router_policy/busy_threshold", "/busy_threshold", "/audit", "/audit/verify",
                     "/routers", "/workers", "/healthz", "/readyz", "/metrics"):
            assert path in spec["paths"], path
        r = await http.get("/no/such/route")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert r.headers.get("x-request-id")
        r = await http.get("/router_policy", headers={"X-Request-Id": "trace-123"})
        assert r.headers["x-request-id"] == "trace-123"
        metrics = (await http.get("/metrics")).text
        assert 'rudder_admin_requests_total{method="GET",route="/router_policy",status="200"}' in metrics


@pytest.mark.parametrize("skew", [timedelta(hours=1), timedelta(hours=-1)], ids=["+1h", "-1h"])
async def test_a_control_plane_clock_off_the_servers_sees_the_live_fleet(nats_url: str, nc: NATS,
                                                                          skew: timedelta) -> None:
    """B4's twin on a real NATS server: a fleet view whose wall clock is an hour ahead used to
    take every router and worker for dead (their ages were its clock less the server's receive
    time); one an hour behind kept a router that stopped alive. Ages are on the server's clock."""
    model = f"skew/{uuid.uuid4().hex[:6]}"
    bus = await Bus.connect(buskit.options(nats_url, buskit.controlplane_creds()))
    view = FleetView(bus, worker_ttl_s=1.0, router_heartbeat_s=0.2, clock=lambda: datetime.now(UTC) + skew)
    watch = asyncio.create_task(view.watch_routers())
    kv = await nc.jetstream().key_value(BUCKET_ROUTERS)
    rec = WorkerRecord(instance_id=4242, model=model, url="http://127.0.0.1:1", dp_size=1, block_size=16,
                       kv_total_blocks=100, max_num_batched_tokens=64, started_at=datetime.now(UTC))
    routers = ("skew-a", "skew-b")

    async def beat(*names: str) -> None:
        now = datetime.now(UTC)
        for name in names:
            await kv.put(name, RouterStatus(router_id=name, models=[model], started_at=now,
                                            heartbeat_at=now).to_bytes())
        event = MembershipEvent(op=MembershipOp.HEARTBEAT, worker=rec, at=now)
        await nc.jetstream().publish(membership_subject(model, rec.instance_id), event.to_bytes())

    try:
        await beat(*routers)
        await view.start()
        deadline = asyncio.get_running_loop().time() + 5.0
        while not (len(view.live_routers(model)) == 2 and view.live_workers(model)):
            assert asyncio.get_running_loop().time() < deadline, (
                f"clock {skew} off: live routers {view.live_routers(model)}, workers {view.live_workers(model)}")
            await beat(*routers)
            await asyncio.sleep(0.1)
        # skew-b stops; skew-a and the worker go on: skew-b ages out on the server's time.
        deadline = asyncio.get_running_loop().time() + 5.0
        while [r.router_id for r in view.live_routers(model)] != ["skew-a"]:
            assert asyncio.get_running_loop().time() < deadline, view.live_routers(model)
            await beat("skew-a")
            await asyncio.sleep(0.1)
        assert [w.worker.instance_id for w in view.live_workers(model)] == [4242]
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await view.stop()
        await bus.close()
