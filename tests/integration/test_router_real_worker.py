"""The router in front of the project's real mock workers (worker/), over real NATS."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest

from controlplane.protocol.hashing import chain_hashes
from controlplane.protocol.tokenizer import encode, encode_chat
from router.cost.common import NO_OVERLAP
from tests import buskit
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = pytest.mark.timeout(60)
MODEL = "mock/llama:8b"

worker_agent = pytest.importorskip("worker.agent")
worker_settings = pytest.importorskip("worker.settings")


@pytest.fixture(scope="module")
async def mock_fleet(nats_url: str) -> AsyncIterator[tuple[InProcessRouter, list[Any]]]:
    stop = asyncio.Event()
    ready: list[Any] = []
    tasks = []
    for _ in range(2):
        settings = buskit.worker_settings(
            nats_url=nats_url, model=MODEL, heartbeat_s=0.2,
            mock=worker_settings.MockEngineSettings(speedup_ratio=50.0, block_size=16),
        )
        tasks.append(asyncio.create_task(worker_agent.serve(settings, stop=stop, on_ready=ready.append)))
    await wait_for(lambda: len(ready) == 2 or any(t.done() for t in tasks), within=20)
    for t in tasks:
        if t.done():
            t.result()
    router = await InProcessRouter(router_settings(nats_url, MODEL)).start()
    await wait_for(lambda: router.runtime.scheduler.view.workers.get(MODEL) == 2, within=10)
    yield router, ready
    await router.stop()
    stop.set()
    for t in tasks:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(t, 10)


async def test_openai_chat_through_router_to_mock_workers(mock_fleet: tuple[InProcessRouter, list[Any]]) -> None:
    router, _ = mock_fleet
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello again"}], max_tokens=4, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks
    await client.close()


async def test_predicted_hit_matches_the_engines_cached_tokens(
    mock_fleet: tuple[InProcessRouter, list[Any]],
) -> None:
    router, _ = mock_fleet
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    system = "You are a careful assistant. " * 40
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "q1"}]
    first = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
    owner = first.headers["x-worker-instance-id"]
    # Until the engine's KV events for the first prompt's full blocks reached the router.
    blocks = chain_hashes(encode_chat(messages), 16)
    await wait_for(lambda: router.runtime.scheduler.inspect(
        lambda s: s.index.overlaps(blocks).get((int(owner), 0), NO_OVERLAP).device == len(blocks)))
    messages[-1]["content"] = "q2"
    second = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
    assert second.headers["x-worker-instance-id"] == owner
    usage = second.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= len(system) // 2
    # The router's prediction (from the engine's KV events) is exactly what the engine reports.
    assert int(second.headers["x-rudder-predicted-cached-tokens"]) == cached
    assert second.headers["x-rudder-policy-revisions"] == "busy_threshold=0,selection=0"
    await client.close()


async def test_eviction_removes_blocks_from_the_router_index(nats_url: str) -> None:
    """A pool too small for two long prompts: the first prompt's blocks are evicted, the engine
    emits ``removed``, and the router stops predicting a hit for it (and the engine reports none)."""
    model = "evict-model"
    stop = asyncio.Event()
    ready: list[Any] = []
    settings = buskit.worker_settings(
        nats_url=nats_url, model=model, heartbeat_s=0.2,
        mock=worker_settings.MockEngineSettings(speedup_ratio=50.0, block_size=16, num_blocks=40),
    )
    task = asyncio.create_task(worker_agent.serve(settings, stop=stop, on_ready=ready.append))
    await wait_for(lambda: bool(ready) or task.done(), within=20)
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    try:
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 1, within=10)
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)

        async def ask(prompt: str) -> tuple[int, int]:
            raw = await client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=1)
            usage = raw.parse().usage
            assert usage is not None
            details = usage.prompt_tokens_details
            return int(raw.headers["x-rudder-predicted-cached-tokens"]), (details.cached_tokens or 0) if details else 0

        first = "alpha " * 80  # 480 tokens = 30 blocks of 16
        blocks = chain_hashes(encode(first), 16)

        async def indexed(check: Callable[[int], bool]) -> bool:
            """``check`` of the first prompt's blocks the router holds for the worker."""
            found = await router.runtime.scheduler.inspect(lambda s: s.index.overlaps(blocks))
            return check(sum(o.device for o in found.values()))

        await ask(first)
        await wait_for(lambda: indexed(lambda n: n == len(blocks)))  # its KV events reached the router
        predicted, cached = await ask(first)
        assert predicted == cached > 0
        await ask("omega " * 80)  # needs 30 more blocks: most of the first prompt's are evicted
        await wait_for(lambda: indexed(lambda n: n < len(blocks)))  # the removals reached the router
        predicted, cached = await ask(first)
        assert predicted == cached
        assert predicted < 30 * 16 - 16  # the evicted blocks left the index
        await client.close()
    finally:
        await router.stop()
        stop.set()
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def _worker_and_router(nats_url: str, model: str) -> AsyncIterator[tuple[InProcessRouter, Any]]:
    """A mock worker at a slow pace (~100 ms a token) and a router in front of it."""
    stop = asyncio.Event()
    ready: list[Any] = []
    settings = buskit.worker_settings(
        nats_url=nats_url, model=model, heartbeat_s=0.2,
        mock=worker_settings.MockEngineSettings(speedup_ratio=0.5, block_size=16),
    )
    task = asyncio.create_task(worker_agent.serve(settings, stop=stop, on_ready=ready.append))
    await wait_for(lambda: bool(ready) or task.done(), within=20)
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    try:
        yield router, ready[0]
    finally:
        await router.stop()
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_client_gone_before_a_non_streamed_answer_frees_the_booking_and_the_worker(nats_url: str) -> None:
    """A client that disconnects while its non-streamed answer is computed (no byte of it has
    come back: the router waits for the worker's whole answer): the router drops the exchange,
    frees the booking within a moment, counts a 499, and the worker stops computing it. It once
    held both to the end of an answer nobody would read (found by a chaos soak)."""
    model = "gone-whole-model"

    async with _worker_and_router(nats_url, model) as (router, worker):
        sched = router.runtime.scheduler

        async def running() -> float:
            async with httpx.AsyncClient(base_url=worker.url) as http:
                text = (await http.get("/metrics")).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:num_requests_running"))

        await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 1, within=10)
        host, port = router.url.removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"model": model, "prompt": "hello " * 10, "max_tokens": 4000}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 1), within=10)
        await wait_for(lambda: running(), within=10)  # the worker computes it (tens of seconds)
        writer.close()
        await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=3)
        await wait_for(lambda: _is_zero(running()), within=3)
        metrics = router.runtime.metrics.render().decode()
        assert any(line.startswith("rudder_router_requests_total") and 'endpoint="/v1/completions"' in line
                   and 'status="499"' in line for line in metrics.splitlines()), metrics
        assert not any(line.startswith("rudder_router_requests_total") and 'status="200"' in line
                       and not line.endswith(" 0.0") for line in metrics.splitlines()), metrics


async def _is_zero(value: Any) -> bool:
    return await value == 0


async def test_client_gone_mid_stream_frees_the_booking_at_once(nats_url: str) -> None:
    """A client that disconnects while tokens stream: the router closes the worker stream, frees
    the booking within a moment (not at the end of the generation) and counts a 499."""
    model = "gone-model"
    async with _worker_and_router(nats_url, model) as (router, _):
        sched = router.runtime.scheduler
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 1, within=10)
        host, port = router.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"model": model, "prompt": "hello " * 10, "max_tokens": 200, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        got = b""
        while b'"text"' not in got:  # the stream has started
            data = await asyncio.wait_for(reader.read(4096), 10)
            assert data, got
            got += data
        assert await sched.inspect(lambda s: len(s.bookings)) == 1
        writer.close()  # the client goes away ~20 s before the generation would end
        gone_at = asyncio.get_running_loop().time()
        await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=3)
        assert asyncio.get_running_loop().time() - gone_at < 3
        metrics = router.runtime.metrics.render().decode()
        assert any(line.startswith("rudder_router_requests_total") and 'endpoint="/v1/completions"' in line
                   and 'status="499"' in line for line in metrics.splitlines()), metrics
