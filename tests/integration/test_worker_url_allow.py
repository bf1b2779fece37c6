"""A worker cannot point routers at the control plane (issue 17 item 7), against real NATS.

Routers started by ``rudder up`` allow exactly the addresses it starts workers on
(:func:`cli.up.worker_allow_list`). A stolen worker credential announcing the control plane's
address (same host, another port) is dropped (``url_not_allowed``) and no chat is relayed there;
the worker at its own address serves.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from cli.up import worker_allow_list
from tests.integration.test_client_edge import HarvestingWorker
from tests.support_router.workers import InProcessRouter, free_port, router_settings, wait_for

pytestmark = pytest.mark.timeout(60)


async def test_a_worker_url_at_the_control_plane_never_receives_traffic(nats_url: str) -> None:
    model = f"allow/{uuid.uuid4().hex[:6]}"
    worker = HarvestingWorker(nats_url, model)
    admin_api = HarvestingWorker(nats_url, model)  # the "control plane": another port of the host
    async with worker.running(), admin_api.running():
        router = await InProcessRouter(router_settings(
            nats_url, model, worker_url_allow=worker_allow_list([worker.port, free_port()]))).start()
        try:
            await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 1, within=15)
            await wait_for(lambda: router.runtime.drops.totals.get(("membership", "url_not_allowed"), 0) >= 1)
            async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
                for i in range(6):
                    r = await http.post("/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": f"hi {i}"}]})
                    assert r.status_code == 200, r.text
                    assert int(r.headers["x-worker-instance-id"]) == worker.instance_id
        finally:
            await router.stop()
    assert len(worker.received) == 6 and admin_api.received == []
