"""The mock engine's HTTP API in process (ASGI, no network): a prefill engine's KV handoff."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from controlplane.protocol import tokenizer
from controlplane.protocol.events import WorkerRole
from controlplane.protocol.hashing import block_hashes
from worker.engines.mock.api import MockApi
from worker.engines.mock.engine import MockCore
from worker.settings import MockEngineSettings

pytestmark = pytest.mark.timeout(30)
BS = 16
ASKED = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}


@asynccontextmanager
async def api(role: WorkerRole) -> AsyncIterator[httpx.AsyncClient]:
    core = MockCore(MockEngineSettings(block_size=BS, num_blocks=64, speedup_ratio=100.0), dp_size=1,
                    role=role, kv_sink=lambda *_: None)
    app = MockApi(core, model="m", instance_id=77).app
    core.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as http:
            yield http
    finally:
        await core.stop()


async def test_prefill_engine_hands_the_prompts_blocks_to_a_remote_decode() -> None:
    prompt = "k" * (3 * BS + 5)  # 3 full blocks and a partial one
    async with api(WorkerRole.PREFILL) as http:
        r = await http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1,
                                                     "kv_transfer_params": ASKED})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        assert body["usage"]["completion_tokens"] == 1
        assert body["kv_transfer_params"] == {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "77",
            "remote_block_ids": [chain for chain, _ in block_hashes(tokenizer.encode(prompt), BS)],
        }
        # Not asked for a remote decode (or asked in a stream): no handoff.
        plain = await http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
        assert plain.status_code == 200 and "kv_transfer_params" not in plain.json()
        streamed = await http.post("/v1/completions", json={"model": "m", "prompt": prompt, "stream": True,
                                                            "kv_transfer_params": ASKED})
        assert streamed.status_code == 200 and "kv_transfer_params" not in streamed.text


@pytest.mark.parametrize("role", [WorkerRole.AGGREGATED, WorkerRole.DECODE])
async def test_only_a_prefill_engine_hands_kv_over(role: WorkerRole) -> None:
    async with api(role) as http:
        r = await http.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 2,
            "kv_transfer_params": ASKED})
        assert r.status_code == 200, r.text
        assert "kv_transfer_params" not in r.json()
