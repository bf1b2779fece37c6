"""The mock engine with a model folder's Hugging Face tokenizer (RUDDER_MOCK__TOKENIZER, issue 9):
it counts and caches real token ids, advertises the folder, and the router, loading the same
folder, predicts exactly the engine's cached_tokens."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.protocol.tokenizer import hf_chat_ids
from router.targets import HDR_PREDICTED_CACHED
from router.tokenize import HfTokenizer
from tests import buskit
from tests.support_router.hf_tokenizer import build_tokenizer_folder
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = pytest.mark.timeout(90)
MODEL = "mock-hf"
BLOCK = 16

transformers = pytest.importorskip("transformers")
worker_agent = pytest.importorskip("worker.agent")
worker_settings = pytest.importorskip("worker.settings")


@pytest.fixture(scope="module")
async def setup(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
    tuple[InProcessRouter, str]
]:
    folder = str(build_tokenizer_folder(Path(tmp_path_factory.mktemp("model"))))
    stop = asyncio.Event()
    ready: list[Any] = []
    tasks = [asyncio.create_task(worker_agent.serve(buskit.worker_settings(
        nats_url=nats_url, model=MODEL, heartbeat_s=0.25,
        mock=worker_settings.MockEngineSettings(speedup_ratio=50.0, block_size=BLOCK, tokenizer=folder),
    ), stop=stop, on_ready=ready.append)) for _ in range(2)]
    await wait_for(lambda: len(ready) == 2 or any(t.done() for t in tasks), within=30)
    for t in tasks:
        if t.done():
            t.result()
    router = await InProcessRouter(router_settings(nats_url, MODEL)).start()
    rt = router.runtime
    await wait_for(lambda: rt.scheduler.view.workers.get(MODEL) == 2)
    await wait_for(lambda: isinstance(rt.tokenizers.loaded(folder), HfTokenizer), within=30)
    yield router, folder
    await router.stop()
    stop.set()
    for t in tasks:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(t, 10)


async def test_mock_counts_real_tokens_and_the_router_predicts_its_cache(
    setup: tuple[InProcessRouter, str],
) -> None:
    router, folder = setup
    assert router.runtime.scheduler.view.tokenizers[MODEL] == frozenset({folder})
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    # Long enough that the owner's cached prefix outweighs, by milliseconds, what a late load
    # report can add to its cost (at a few hundred tokens the margin was a fraction of one).
    system = "Shared instructions for every session of this test, long enough for several blocks. " * 80
    async with httpx.AsyncClient(base_url=router.url, timeout=20) as http:
        msgs: list[dict[str, str]] = [{"role": "system", "content": system}, {"role": "user", "content": "first"}]
        first = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 3})
        assert first.status_code == 200, first.text
        usage = first.json()["usage"]
        # Real token ids: the folder's chat template, not one token per byte.
        assert usage["prompt_tokens"] == len(hf_chat_ids(tok, msgs)) < len(system)
        owner = first.headers["x-worker-instance-id"]
        sched = router.runtime.scheduler
        await wait_for(lambda: sched.inspect(lambda s: s.index.blocks_of((int(owner), 0)) > 0))
        msgs[-1]["content"] = "second"
        second = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 3})
        assert second.status_code == 200, second.text
    assert second.headers["x-worker-instance-id"] == owner
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % BLOCK == 0
    assert int(second.headers[HDR_PREDICTED_CACHED]) == cached
    assert second.json()["choices"][0]["message"]["content"]
