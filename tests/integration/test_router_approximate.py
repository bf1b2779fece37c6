"""Approximate mode (``--no-kv-events``): the router indexes its own decisions with a TTL, ignores
KV events, and advertises only the ``device`` cache input (DESIGN §3.1, §5)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS

from controlplane.protocol import tokenizer
from controlplane.protocol.events import decode_router_status
from controlplane.protocol.hashing import chain_hashes
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import BUCKET_ROUTERS
from tests.support_router.workers import InProcessRouter, MockWorker, mock_workers, router_settings, wait_for

pytestmark = pytest.mark.timeout(60)
MODEL = "approx-model"
TTL = 1.5


@pytest.fixture(scope="module")
async def approx(nats_url: str) -> AsyncIterator[tuple[InProcessRouter, list[MockWorker]]]:
    async with mock_workers(nats_url, MODEL, 3) as workers:
        router = await InProcessRouter(router_settings(
            nats_url, MODEL, kv_events=False, approx_ttl_s=TTL, tick_s=0.1,
        )).start()
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(MODEL) == 3)
        yield router, workers
        await router.stop()


async def test_startup_cache_weights_other_than_device_are_zero_and_status_says_device_only(
    approx: tuple[InProcessRouter, list[MockWorker]], nc: NATS,
) -> None:
    router, _ = approx
    startup = router.runtime.startup[PolicyKind.SELECTION]
    assert startup["overlap_score_credit"] == 1.0
    assert (startup["host_cache_hit_weight"], startup["disk_cache_hit_weight"],
            startup["shared_cache_multiplier"]) == (0, 0, 0)
    kv = await nc.jetstream().key_value(BUCKET_ROUTERS)
    status = decode_router_status((await kv.get(router.settings.router_id)).value or b"")
    assert [c.value for c in status.cache_inputs] == ["device"]
    assert status.startup["selection"]["host_cache_hit_weight"] == 0
    assert router.runtime.kv is None  # no KV-event subscription at all


async def test_repeated_prompt_goes_to_the_same_worker_until_the_ttl(
    approx: tuple[InProcessRouter, list[MockWorker]],
) -> None:
    router, _ = approx
    sched = router.runtime.scheduler
    # Long enough that the owner's cached prefix outweighs, by milliseconds, what a late load
    # report can add to its cost (at a few hundred tokens the margin was a fraction of one).
    system = "A shared system prompt that repeats across the requests of a session. " * 60

    def body(q: str) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": q}]}

    async with httpx.AsyncClient(base_url=router.url, timeout=20) as http:
        first = await http.post("/v1/chat/completions", json=body("q0"))
        assert first.status_code == 200, first.text
        owner = int(first.headers["x-worker-instance-id"])
        # The index holds what the router decided (the workers' KV events are not read).
        hashes = chain_hashes(tokenizer.encode_chat(body("q0")["messages"]), 16)
        overlap = await sched.inspect(lambda s: s.index.overlaps(hashes))
        assert set(overlap) == {(owner, 0)} and overlap[(owner, 0)].device == len(hashes)
        for i in range(1, 8):
            r = await http.post("/v1/chat/completions", json=body(f"q{i}"))
            assert int(r.headers["x-worker-instance-id"]) == owner, i
        # Entries expire TTL after the last decision that touched them.
        await asyncio.sleep(TTL + 0.3)
        assert await sched.inspect(lambda s: s.index.blocks_of((owner, 0))) == 0
