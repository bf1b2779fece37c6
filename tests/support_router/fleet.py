"""A small real fleet (mock-engine workers and one in-process router) on any bus URL, for tests
that vary the bus (TLS, a cluster given as a URL list)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from tests.support_router.workers import InProcessRouter, mock_workers, router_settings, wait_for


@contextlib.asynccontextmanager
async def mock_fleet(nats_url: str, model: str, *, workers: int = 1, nats_ca: Path | None = None,
                     stream_replicas: int = 1) -> AsyncIterator[InProcessRouter]:
    async with mock_workers(nats_url, model, workers, nats_ca=nats_ca, stream_replicas=stream_replicas):
        settings = router_settings(nats_url, model, nats_ca=nats_ca, stream_replicas=stream_replicas)
        router = await InProcessRouter(settings).start()
        try:
            await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == workers, within=15)
            yield router
        finally:
            await router.stop()


async def chat(router_url: str, model: str, text: str = "hello") -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=20) as http:
        r = await http.post(f"{router_url}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body
