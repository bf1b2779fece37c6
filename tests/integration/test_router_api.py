"""The router's OpenAI API against real NATS and small real workers (tests/support_router)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests import buskit
from tests.support_router.workers import (
    InProcessRouter,
    MockWorker,
    held,
    mock_answer,
    routed_workers,
    router_settings,
    start_worker,
    wait_busy,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)
MODEL = "org/chat-model:v1.5"


@pytest.fixture(scope="module")
async def fleet(nats_url: str) -> AsyncIterator[tuple[InProcessRouter, list[MockWorker]]]:
    async with routed_workers(nats_url, MODEL, 3) as fleet:
        yield fleet


async def test_openai_client_chat_non_streaming(fleet: tuple[InProcessRouter, list[MockWorker]]) -> None:
    router, workers = fleet
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}]
    )
    text = raw.parse().choices[0].message.content
    assert text == mock_answer()
    served = [w for w in workers if int(raw.headers["x-worker-instance-id"]) == w.instance_id]
    assert len(served) == 1
    assert served[0].requests[-1]["messages"] == [{"role": "user", "content": "hello there"}]
    assert served[0].requests[-1]["nvext"]["backend_instance_id"] == served[0].instance_id
    await client.close()


async def test_openai_client_chat_streaming(fleet: tuple[InProcessRouter, list[MockWorker]]) -> None:
    router, workers = fleet
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "stream me"}], stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in raw.parse() if c.choices]
    text = "".join(pieces)
    assert text == mock_answer()
    assert int(raw.headers["x-worker-instance-id"]) in {w.instance_id for w in workers}
    # The booking is freed after the stream ends.
    sched = router.runtime.scheduler
    await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0))
    await client.close()


async def test_openai_client_completion(fleet: tuple[InProcessRouter, list[MockWorker]]) -> None:
    router, _ = fleet
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    reply = await client.completions.create(model=MODEL, prompt="once upon a time")
    assert reply.choices[0].text == mock_answer()
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.close()


async def test_a_stream_of_slow_tokens_arrives_whole_and_in_order_and_every_chunk_is_counted(nats_url: str) -> None:
    """A worker at its real pace (a token every few ms): each token reaches the router in its own
    read, and all but the first and the last are written to the client from the worker
    connection's callback (router.cycle.DirectCycle.push), not from the request's task. The client
    gets every token in order, each chunk after the first is counted as an inter-token time, and
    the booking is freed at the end."""
    tokens = 40
    model = "org/paced-model"  # not the module fleet's: this router sees its one worker only
    async with routed_workers(nats_url, model, 1, workers={"mock": {"speedup_ratio": 1.0}}) as (router, _):
        itl = router.runtime.metrics.model(model).itl
        events: list[str] = []
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as http, http.stream(
            "POST", "/v1/completions",
            json={"model": model, "prompt": "count along", "max_tokens": tokens, "stream": True},
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        assert events[-1] == "[DONE]"
        text = "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1]) if c["choices"])
        assert text == mock_answer(tokens)
        gaps = sum(itl.counts)
        assert tokens // 2 <= gaps <= tokens  # a token a chunk, near enough (the last with the usage)
        sched = router.runtime.scheduler
        await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0))


async def test_same_prefix_goes_to_the_worker_that_cached_it(
    fleet: tuple[InProcessRouter, list[MockWorker]],
) -> None:
    router, workers = fleet
    # ~7,000 tokens, 437 blocks of 16: recomputing them costs a worker without them ~2.5 ms more
    # (predicted, at the fleet's speedup) than the owner's uncached tail, well above what a late
    # load report of the owner adds. At ~700 tokens the margin was 0.21 ms, and a loaded CI run
    # once lost it (the second request went to a worker without the prefix).
    prompt = "the same long shared system prompt " * 200
    async with httpx.AsyncClient(base_url=router.url) as http:
        first = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert first.status_code == 200
        assert "server" not in first.headers and "date" in first.headers  # no server software named
        owner = int(first.headers["x-worker-instance-id"])
        # Wait until the router has indexed the worker's KV event.
        sched = router.runtime.scheduler
        from controlplane.protocol.hashing import chain_hashes
        from controlplane.protocol.tokenizer import encode
        hashes = chain_hashes(encode(prompt), 16)
        await wait_for(lambda: sched.inspect(lambda s: (owner, 0) in s.index.overlaps(hashes)))
        for _ in range(5):
            again = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + " more"})
            assert int(again.headers["x-worker-instance-id"]) == owner
    assert any(w.instance_id == owner for w in workers)


async def test_errors_use_the_openai_shape(fleet: tuple[InProcessRouter, list[MockWorker]]) -> None:
    router, _ = fleet
    async with httpx.AsyncClient(base_url=router.url) as http:
        r = await http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
        assert r.status_code == 404
        assert r.json() == {"error": {
            "message": "The model `nope` does not exist on this router",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found",
        }}
        r = await http.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert r.json()["error"]["param"] == "body"
        # A client's model names are not metric labels: a hundred unknown ones add no series.
        def series(text: str) -> set[str]:
            return {line.split(" ")[0] for line in text.splitlines() if line.startswith("rudder_router_")}
        before = series((await http.get("/metrics")).text)
        for i in range(100):
            r = await http.post("/v1/completions", json={"model": f"made-up-{i}", "prompt": "x"})
            assert r.status_code == 404
        after = series((await http.get("/metrics")).text)
        assert not any("made-up" in s for s in after)
        assert len(after - before) <= 2, sorted(after - before)  # the 404s' own (model="") series
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


async def test_health_live_metrics(fleet: tuple[InProcessRouter, list[MockWorker]]) -> None:
    router, _ = fleet
    async with httpx.AsyncClient(base_url=router.url) as http:
        assert (await http.get("/live")).status_code == 200
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["workers"] == {MODEL: 3}
        for path in ("/health", "/live"):  # a load balancer's HEAD check: the status, no body
            head = await http.head(path)
            assert (head.status_code, head.content) == (200, b""), path
        await http.post("/v1/completions", json={"model": MODEL, "prompt": "metrics please " * 4})

        async def open_returns() -> bool:  # the finished request is expected back (router.returns)
            text = (await http.get("/metrics")).text
            found = re.search(r'^rudder_router_expected_returns\{stat="open"\} (\S+)$', text, re.M)
            return found is not None and float(found.group(1)) >= 1

        await wait_for(open_returns)
        text = (await http.get("/metrics")).text
    assert 'rudder_router_expected_returns{stat="fraction"}' in text
    for name in ("rudder_router_requests_total", "rudder_router_ttft_seconds_bucket",
                 "rudder_router_routing_overhead_seconds_bucket",
                 "rudder_router_predicted_kv_hit_rate_bucket", "rudder_router_applied_revision",
                 "rudder_router_rejections_total", "rudder_router_itl_seconds",
                 # the standard Python exporter's: CPU, memory, collector passes
                 "process_cpu_seconds_total", "process_resident_memory_bytes",
                 'python_gc_collections_total{generation="0"}', "python_info"):
        assert name in text, name


async def test_busy_workers_are_skipped_and_all_busy_is_529(nats_url: str) -> None:
    from controlplane.protocol.policy import PolicyKind
    from tests.support_router.policy import publish_policy

    model = "busy-model"
    # One sequence at a time: a long generation runs and a 5000-token prompt waits behind it
    # (5000 active prefill tokens) for far longer than the test.
    loadable = {"max_num_seqs": 1, "speedup_ratio": 5.0}
    a = await start_worker(nats_url, model, mock=loadable)
    b = await start_worker(nats_url, model, mock=loadable)
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    busy_load = ["a long generation", "q" * 5000]

    nc = await buskit.admin_connect(nats_url)
    try:
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 2)
        async with held(a, busy_load, max_tokens=50_000):
            await publish_policy(nc.jetstream(), model, {"active_prefill_tokens_threshold": 1000},
                                 expected_revision=0, kind=PolicyKind.BUSY_THRESHOLD)
            await wait_for(lambda: router.runtime.scheduler.view.applied[f"{model}|busy_threshold"].revision > 0)
            await wait_busy(router, model, a.instance_id)  # a heartbeat carried a's load
            async with httpx.AsyncClient(base_url=router.url) as http:
                for _ in range(5):
                    r = await http.post("/v1/completions", json={"model": model, "prompt": "x"})
                    assert int(r.headers["x-worker-instance-id"]) == b.instance_id
                async with held(b, busy_load, max_tokens=50_000):
                    await wait_busy(router, model, b.instance_id)
                    r = await http.post("/v1/completions", json={"model": model, "prompt": "x"})
                    assert r.status_code == 529
                    assert r.json()["error"]["code"] == "overloaded"
    finally:
        await nc.close()
        await router.stop()
        await a.stop()
        await b.stop()


async def test_connection_failure_retries_on_another_worker(nats_url: str) -> None:
    model = "retry-model"
    a = await start_worker(nats_url, model)
    b = await start_worker(nats_url, model)
    router = await InProcessRouter(router_settings(nats_url, model, mode="round_robin")).start()
    try:
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 2)
        await a.stop_http()  # still heartbeating, but its port refuses connections
        async with httpx.AsyncClient(base_url=router.url) as http:
            for _ in range(4):
                r = await http.post("/v1/completions", json={"model": model, "prompt": "x"})
                assert r.status_code == 200
                assert int(r.headers["x-worker-instance-id"]) == b.instance_id
            # a pin to the dead worker is not rerouted
            r = await http.post("/v1/completions", json={
                "model": model, "prompt": "x", "nvext": {"backend_instance_id": a.instance_id}})
            assert r.status_code == 503
        assert len(b.requests) == 4
    finally:
        await router.stop()
        await a.stop()
        await b.stop()


async def test_a_client_that_expects_100_continue_gets_the_answer(
    fleet: tuple[InProcessRouter, list[MockWorker]],
) -> None:
    """curl sends ``Expect: 100-continue`` with a large body: the router answers the client's 100
    itself and does not pass the header on (a worker asked for it answers 100 first, which the
    router took for the answer's head: the client got a 100 and the real answer as its body)."""
    router, _ = fleet
    host, port = router.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "expect " * 400, "max_tokens": 3}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 20)
    finally:
        writer.close()
    if raw.startswith(b"HTTP/1.1 100 "):  # the router's own 100 Continue to the client
        raw = raw.split(b"\r\n\r\n", 1)[1]
    head, _, content = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), raw[:300]
    answer = json.loads(content)
    assert answer["choices"][0]["text"] == mock_answer(3)


async def test_metrics_show_the_requests_in_flight_on_each_worker(nats_url: str) -> None:
    """``rudder_router_requests_in_flight{model,instance_id}``: a stream in progress counts on the
    worker that serves it and on no other, every known worker has a series, and the count is 0
    once the stream has ended."""
    model = "org/in-flight:v1"  # not the module's fleet's model: its workers would count here too
    async with routed_workers(nats_url, model, 2, workers={"mock": {"speedup_ratio": 1.0}}) as (router, workers):
        def in_flight(text: str) -> dict[str, float]:
            return {m.group(1): float(m.group(2)) for m in re.finditer(
                r'rudder_router_requests_in_flight\{instance_id="(\d+)",model="[^"]+"\} (\S+)', text)}

        async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json={
                    "model": model, "prompt": "in flight", "max_tokens": 400, "stream": True}) as stream:
                worker = stream.headers["x-worker-instance-id"]
                chunks = stream.aiter_bytes()
                await anext(chunks)  # the stream has begun
                during = in_flight((await http.get("/metrics")).text)
                async for _ in chunks:
                    pass
            after = in_flight((await http.get("/metrics")).text)
        ids = {str(w.instance_id) for w in workers}
        assert set(during) == ids and set(after) == ids
        assert during[worker] == 1 and sum(during.values()) == 1
        assert sum(after.values()) == 0
