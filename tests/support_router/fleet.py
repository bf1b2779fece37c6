"""A small real fleet (mock-engine workers and one in-process router) on any bus URL, for tests
that vary the bus (TLS, a cluster given as a URL list)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from tests import buskit
from tests.support_router.workers import InProcessRouter, router_settings, wait_for
from worker import agent
from worker.settings import MockEngineSettings


@contextlib.asynccontextmanager
async def mock_fleet(nats_url: str, model: str, *, workers: int = 1, nats_ca: Path | None = None,
                     stream_replicas: int = 1) -> AsyncIterator[InProcessRouter]:
    stop = asyncio.Event()
    ready: list[Any] = []
    tasks = []
    for _ in range(workers):
        settings = buskit.worker_settings(
            nats_url=nats_url, model=model, heartbeat_s=0.2, nats_ca=nats_ca, stream_replicas=stream_replicas,
            mock=MockEngineSettings(speedup_ratio=50.0, block_size=16))
        tasks.append(asyncio.create_task(agent.serve(settings, stop=stop, on_ready=ready.append)))  # type: ignore[arg-type]
    try:
        await wait_for(lambda: len(ready) == workers or any(t.done() for t in tasks), within=30)
        for t in tasks:
            if t.done():
                t.result()
        settings = router_settings(nats_url, model, nats_ca=nats_ca, stream_replicas=stream_replicas)
        router = await InProcessRouter(settings).start()
        try:
            await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == workers, within=15)
            yield router
        finally:
            await router.stop()
    finally:
        stop.set()
        for t in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)


async def chat(router_url: str, model: str, text: str = "hello") -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=20) as http:
        r = await http.post(f"{router_url}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body
