"""The router tokenizes as a vLLM worker does when the worker advertises its model folder:
the predicted prefix hit of a repeated prompt equals what the worker reports as cached. The
workers are mock engines with the folder's tokenizer (RUDDER_MOCK__TOKENIZER); what they count is
checked against the folder's chat template applied directly, as vLLM applies it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from router.tokenize import HfTokenizer
from tests.support_router.hf_tokenizer import build_tokenizer_folder
from tests.support_router.workers import InProcessRouter, MockWorker, mock_workers, router_settings, wait_for

pytestmark = pytest.mark.timeout(60)
MODEL = "hf-folder-model"
BLOCK = 32  # vLLM's CPU backend needs a multiple of 32


@pytest.fixture(scope="module")
async def setup(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
    tuple[InProcessRouter, list[MockWorker], str]
]:
    folder = str(build_tokenizer_folder(Path(tmp_path_factory.mktemp("model"))))
    async with mock_workers(nats_url, MODEL, 2, mock={"block_size": BLOCK, "tokenizer": folder}) as workers:
        router = await InProcessRouter(router_settings(nats_url, MODEL)).start()
        rt = router.runtime
        await wait_for(lambda: rt.scheduler.view.workers.get(MODEL) == 2)
        # Prewarmed from the snapshot, before any request asks for it.
        await wait_for(lambda: isinstance(rt.tokenizers.loaded(folder), HfTokenizer), within=20)
        yield router, workers, folder
        await router.stop()


async def test_predicted_hit_matches_cached_tokens_with_the_folders_tokenizer(
    setup: tuple[InProcessRouter, list[MockWorker], str],
) -> None:
    router, workers, folder = setup
    hit_rate = router.runtime.metrics.hit_rate.labels(MODEL)
    # Long enough that the owner's cached prefix outweighs, by milliseconds, what a late load
    # report can add to its cost (at a few hundred tokens the margin was a fraction of one).
    system = "Shared instructions for every session of this test, long enough for blocks. " * 100
    async with httpx.AsyncClient(base_url=router.url, timeout=20) as http:
        first = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "first"}]})
        assert first.status_code == 200, first.text
        owner = int(first.headers["x-worker-instance-id"])
        assert hit_rate.sum == 0.0
        w = next(x for x in workers if x.instance_id == owner)
        sched = router.runtime.scheduler
        await wait_for(lambda: sched.inspect(lambda s: s.index.blocks_of((owner, 0)) == w.cached_blocks()))

        messages = [{"role": "system", "content": system}, {"role": "user", "content": "second"}]
        second = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert second.status_code == 200, second.text
    assert int(second.headers["x-worker-instance-id"]) == owner
    usage = second.json()["usage"]
    # The worker counted the folder's chat template rendering, as vLLM tokenizes it.
    ref = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    out = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert usage["prompt_tokens"] == len(out if isinstance(out, list) else out["input_ids"])
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 4 * BLOCK
    # The router's prediction (hit rate of this request) is exactly the worker's reported hit.
    assert hit_rate.sum == pytest.approx(cached / usage["prompt_tokens"])
