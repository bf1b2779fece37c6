"""B2, the fleet side: a NATS store out of disk stops every worker heartbeat (they go through
JetStream storage). The router's own status write fails too, so it knows the bus cannot store and
keeps its last-known workers past the outage grace: chats go on. The control plane's view of the
fleet does the same (its store probe fails once the fleet falls silent): it still lists the
router and the worker. After NATS is restarted with space free, heartbeats flow again and the
worker is still there."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.embedded import EmbeddedNats
from migrations import upgrade_async
from tests import buskit
from tests.integration.cp_support import controlplane
from tests.reliability.diskfull import fill_stream, occupy, small_disk
from tests.support_router.workers import InProcessRouter, router_settings, wait_for
from worker import agent
from worker.settings import MockEngineSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
MODEL = "disk/model"
GRACE_S, TTL_S = 3.0, 3.0  # the grace outlasts the router noticing (its status write times out in 2 s)


async def _chat(router_url: str, text: str) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{router_url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2})
        return r.status_code


async def test_workers_stay_while_the_bus_cannot_store(tmp_path: Path, database_url: str,
                                                       database_owner_url: str) -> None:
    await upgrade_async(database_owner_url)
    with small_disk(tmp_path / "disk", 16) as disk:
        server = EmbeddedNats(disk / "nats", auth=buskit.authority().server_config)
        server.start()
        stop = asyncio.Event()
        ready: list[Any] = []
        settings = buskit.worker_settings(nats_url=server.url, model=MODEL, heartbeat_s=0.2,
                                          worker_ttl_s=TTL_S,
                                          mock=MockEngineSettings(speedup_ratio=50.0, block_size=16))
        worker = asyncio.create_task(agent.serve(settings, stop=stop, on_ready=ready.append))  # type: ignore[arg-type]
        router = None
        cp_context = None
        try:
            await asyncio.to_thread(buskit.init_streams, server.url)
            cp_context = controlplane(server.url, database_url, worker_ttl_s=TTL_S, bus_outage_grace_s=GRACE_S,
                                      router_heartbeat_s=0.3)
            cp = (await cp_context.__aenter__()).controlplane
            await wait_for(lambda: bool(ready) or worker.done(), within=30)
            router = await InProcessRouter(router_settings(
                server.url, MODEL, worker_ttl_s=TTL_S, worker_stale_s=1.0, bus_outage_grace_s=GRACE_S,
                heartbeat_s=0.3)).start()
            await wait_for(lambda: router is not None and router.runtime.scheduler.view.workers.get(MODEL) == 1,
                           within=15)
            assert await _chat(router.url, "before") == 200
            await wait_for(lambda: bool(cp.fleet.live_workers(MODEL) and cp.fleet.live_routers(MODEL)), within=10)

            filler = occupy(disk, leave_mb=3)
            admin = await buskit.admin_connect(server.url)
            try:
                assert await fill_stream(admin) > 0
            finally:
                await admin.close()
            # Well past the outage grace and the TTL: the worker is kept, chats go on.
            until = time.monotonic() + GRACE_S + TTL_S + 2.0
            i = 0
            while time.monotonic() < until:
                assert await _chat(router.url, f"during {i}") == 200
                i += 1
                await asyncio.sleep(0.3)
            assert router.runtime.scheduler.view.workers.get(MODEL) == 1
            # The control plane holds its last-known fleet too (it emptied after the grace before).
            assert cp.fleet.holding
            assert [w.worker.model for w in cp.fleet.live_workers(MODEL)] == [MODEL]
            assert len(cp.fleet.live_routers(MODEL)) == 1

            # Space freed and NATS restarted (it does not heal by itself): heartbeats flow again.
            filler.unlink()
            server.stop()
            server.start()
            deadline = time.monotonic() + 20
            async with httpx.AsyncClient(timeout=2) as http:
                while (health := await http.get(f"{router.url}/health")).status_code != 200:
                    assert time.monotonic() < deadline, health.text
                    await asyncio.sleep(0.2)
            await asyncio.sleep(TTL_S)  # the worker is heard again, not just held
            assert router.runtime.scheduler.view.live_workers.get(MODEL) == 1
            assert await _chat(router.url, "after") == 200
        finally:
            if router is not None:
                await router.stop()
            if cp_context is not None:
                await cp_context.__aexit__(None, None, None)
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(worker, 10)
            server.stop(kill=True)
