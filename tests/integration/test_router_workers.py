"""Worker loss, overload status and readiness, against real NATS."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from controlplane.protocol.policy import PolicyKind
from router.app import create_app
from tests import buskit
from tests.support_router.policy import publish_policy
from tests.support_router.workers import (
    InProcessRouter,
    held,
    router_settings,
    start_worker,
    wait_busy,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)


async def test_worker_that_stops_heartbeating_leaves_within_the_ttl(nats_url: str) -> None:
    model = "loss-model"
    a = await start_worker(nats_url, model, heartbeat_s=0.1, bus_link=True)
    b = await start_worker(nats_url, model, heartbeat_s=0.1)
    ttl = 1.5
    router = await InProcessRouter(router_settings(
        nats_url, model, worker_ttl_s=ttl, worker_stale_s=0.4, tick_s=0.05, mode="round_robin",
    )).start()
    sched = router.runtime.scheduler
    pin = {"model": model, "prompt": "x", "nvext": {"backend_instance_id": a.instance_id}}
    try:
        await wait_for(lambda: sched.view.workers.get(model) == 2)
        async with httpx.AsyncClient(base_url=router.url) as http:
            assert (await http.post("/v1/completions", json=pin)).status_code == 200
            a.pause_bus()  # a's link to the bus fails: its heartbeats stop reaching it
            stopped = asyncio.get_running_loop().time()
            # stale: pinned requests get 503, the others go to b
            await wait_for(lambda: sched.inspect(
                lambda s: not s._slots[model][(a.instance_id, 0)].healthy))
            r = await http.post("/v1/completions", json=pin)
            assert r.status_code == 503, r.text
            for _ in range(4):
                r = await http.post("/v1/completions", json={"model": model, "prompt": "x"})
                assert int(r.headers["x-worker-instance-id"]) == b.instance_id
            # gone within the TTL (plus a tick): the pin is now 400, the snapshot lost it
            await wait_for(lambda: sched.inspect(lambda s: s.discovery.get(a.instance_id) is None),
                           within=ttl + 1)
            gone_after = asyncio.get_running_loop().time() - stopped
            assert gone_after <= ttl + 0.5, gone_after
            assert sched.view.workers[model] == 1
            r = await http.post("/v1/completions", json=pin)
            assert r.status_code == 400
            assert r.json()["error"]["message"] == (
                f"nvext.backend_instance_id={a.instance_id} does not identify a known worker"
            )
            assert await sched.inspect(lambda s: s.index.workers() <= {b.instance_id})
    finally:
        await router.stop()
        await a.stop()
        await b.stop()


async def test_leave_removes_worker_and_its_bookings(nats_url: str) -> None:
    model = "leave-model"
    a = await start_worker(nats_url, model)
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    sched = router.runtime.scheduler
    try:
        await wait_for(lambda: sched.view.workers.get(model) == 1)
        from router.commands import RoutingRequest

        await sched.select(RoutingRequest(request_id="held", model=model, prompt_tokens=10, hashes={}))
        assert await sched.inspect(lambda s: len(s.bookings)) == 1
        await a.stop()  # a graceful stop: leave
        await wait_for(lambda: sched.view.workers.get(model) == 0)
        assert await sched.inspect(lambda s: len(s.bookings)) == 0
        async with httpx.AsyncClient(base_url=router.url) as http:
            r = await http.post("/v1/completions", json={"model": model, "prompt": "x"})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "service_unavailable"
    finally:
        await router.stop()


async def test_overload_status_is_configurable_to_503(nats_url: str) -> None:

    model = "legacy-model"
    a = await start_worker(nats_url, model, mock={"num_blocks": 1000, "speedup_ratio": 1.0})
    router = await InProcessRouter(router_settings(nats_url, model, overload_status=503)).start()
    nc = await buskit.admin_connect(nats_url)
    try:
        # A real decode load: a generation whose prompt alone holds 600 of the 1000 KV blocks, at
        # the reference speed (tens of ms a token), for far longer than the test.
        async with held(a, ["x" * 600 * 16], max_tokens=5000):
            await publish_policy(nc.jetstream(), model, {"active_decode_blocks_threshold": 0.5},
                                 expected_revision=0, kind=PolicyKind.BUSY_THRESHOLD)
            sched = router.runtime.scheduler
            await wait_for(lambda: sched.view.workers.get(model) == 1
                           and sched.view.applied[f"{model}|busy_threshold"].revision > 0)
            await wait_busy(router, model, a.instance_id)
            async with httpx.AsyncClient(base_url=router.url) as http:
                r = await http.post("/v1/completions", json={"model": model, "prompt": "x"})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "1"
    finally:
        await nc.close()
        await router.stop()
        await a.stop()


async def test_health_is_503_until_first_discovery() -> None:
    app = create_app(router_settings("nats://127.0.0.1:1", "m"))  # lifespan not run: not started
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://r") as http:
        r = await http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        assert (await http.get("/live")).status_code == 200
