"""The router tokenizes as a vLLM worker does when the worker advertises its model folder:
the predicted prefix hit of a repeated prompt equals what the worker reports as cached."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from router.tokenize import HfTokenizer
from tests.support_router.hf_tokenizer import build_tokenizer_folder
from tests.support_router.workers import InProcessRouter, TestWorker, router_settings, wait_for

pytestmark = pytest.mark.timeout(60)
MODEL = "hf-folder-model"
BLOCK = 32  # vLLM's CPU backend needs a multiple of 32


@pytest.fixture(scope="module")
async def setup(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
    tuple[InProcessRouter, list[TestWorker], str]
]:
    folder = str(build_tokenizer_folder(Path(tmp_path_factory.mktemp("model"))))
    workers = [await TestWorker(nats_url, MODEL, block_size=BLOCK, tokenizer_folder=folder).start()
               for _ in range(2)]
    router = await InProcessRouter(router_settings(nats_url, MODEL)).start()
    rt = router.runtime
    await wait_for(lambda: rt.scheduler.view.workers.get(MODEL) == 2)
    # Prewarmed from the snapshot, before any request asks for it.
    await wait_for(lambda: isinstance(rt.tokenizers.loaded(folder), HfTokenizer), within=20)
    yield router, workers, folder
    await router.stop()
    for w in workers:
        await w.stop()


async def test_predicted_hit_matches_cached_tokens_with_the_folders_tokenizer(
    setup: tuple[InProcessRouter, list[TestWorker], str],
) -> None:
    router, workers, _ = setup
    hit_rate = router.runtime.metrics.hit_rate.labels(MODEL)
    system = "Shared instructions for every session of this test, long enough for blocks. " * 12
    async with httpx.AsyncClient(base_url=router.url, timeout=20) as http:
        first = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "first"}]})
        assert first.status_code == 200, first.text
        owner = int(first.headers["x-worker-instance-id"])
        assert hit_rate._sum.get() == 0.0
        w = next(x for x in workers if x.instance_id == owner)
        sched = router.runtime.scheduler
        await wait_for(lambda: sched.inspect(lambda s: s.index.blocks_of((owner, 0)) == len(w.stored)))

        second = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "second"}]})
        assert second.status_code == 200, second.text
    assert int(second.headers["x-worker-instance-id"]) == owner
    usage = second.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 4 * BLOCK
    # The router's prediction (hit rate of this request) is exactly the worker's reported hit.
    assert hit_rate._sum.get() == pytest.approx(cached / usage["prompt_tokens"])
