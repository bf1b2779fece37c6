"""Readiness and graceful stop of a router (issue 10): /health is 503 until the router is
connected, has the policy heads and sees a worker for each model; on SIGTERM it turns 503 first,
lets a stream in flight finish, and exits with status 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests import buskit
from tests.support_router.workers import InProcessRouter, free_port, router_settings, spawn_router, wait_for
from worker import agent
from worker.settings import MockEngineSettings

pytestmark = pytest.mark.timeout(90)


@contextlib.asynccontextmanager
async def mock_worker(nats_url: str, model: str, **mock: Any) -> AsyncIterator[None]:
    stop, ready = asyncio.Event(), asyncio.Event()
    settings = buskit.worker_settings(nats_url=nats_url, model=model, heartbeat_s=0.2,
                                      mock=MockEngineSettings(block_size=16, **mock))
    task = asyncio.create_task(agent.serve(settings, stop=stop, on_ready=lambda _: ready.set()))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(ready.wait(), 20)
        yield
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


async def test_health_is_503_until_a_worker_serves_each_model(nats_url: str) -> None:
    model = "ready/model"
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    try:
        async with httpx.AsyncClient(base_url=router.url) as http:
            body = (await http.get("/health")).json()
            await wait_for(lambda: router.runtime.policy is not None and router.runtime.policy.loaded.is_set())
            r = await http.get("/health")
            assert r.status_code == 503 and any(w.startswith("workers:") for w in r.json()["waiting_for"]), body
            assert (await http.get("/live")).status_code == 200
            async with mock_worker(nats_url, model, speedup_ratio=50.0):
                async def ready() -> bool:
                    return (await http.get("/health")).status_code == 200
                await wait_for(ready, within=10)
                assert (await http.get("/health")).json()["waiting_for"] == []
    finally:
        await router.stop()


async def test_sigterm_drains_a_stream_in_flight_and_exits_0(nats_url: str) -> None:
    model = "drain/model"
    port = free_port()
    async with mock_worker(nats_url, model, speedup_ratio=1.0):
        proc = spawn_router(nats_url, model, port=port, router_id="r-drain", RUDDER_DRAIN_DELAY_S="1.5")
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                async def ready() -> bool:
                    with contextlib.suppress(httpx.HTTPError):
                        return (await http.get("/health")).status_code == 200
                    return False
                await wait_for(ready, within=30)
                body = {"model": model, "stream": True, "max_tokens": 120,
                        "messages": [{"role": "user", "content": "a long answer please"}]}
                chunks: list[str] = []
                async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                    assert stream.status_code == 200
                    lines = stream.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: {"):
                            chunks.append(line)
                            break
                    proc.send_signal(signal.SIGTERM)
                    # Draining: not ready any more, while the stream goes on.
                    async with httpx.AsyncClient(base_url=url, timeout=2) as probe:
                        async def draining() -> bool:
                            r = await probe.get("/health")
                            return r.status_code == 503 and r.json()["status"] == "draining"
                        await wait_for(draining, within=1.0)
                    async for line in lines:
                        if line.startswith("data: "):
                            chunks.append(line)
                assert chunks[-1] == "data: [DONE]" and len(chunks) > 100
            assert await asyncio.to_thread(proc.wait, 30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
