"""Odd requests against a real router and a mock worker: every field of a valid chat and completion
request replaced, in turn, by values of every JSON type and some edge values, sent streamed and
not. The router never answers with its own internal error (500 ``internal_error``): a request it
cannot route is refused naming the field, one it passes on gets the worker's answer; and nothing
stays booked afterwards. A table, not Hypothesis: the router lives on the test's event loop."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.support_router.workers import InProcessRouter, MockWorker, routed_workers, wait_for

pytestmark = pytest.mark.timeout(180)
MODEL = "org/odd-model:v1"

ODD: list[Any] = [
    None, True, False, 0, -1, 2**63, 1.5, -0.0, 1e308, "", "x", "\u0000\ud7ff\uffff", "é" * 3000, "lone \ud800",
    [], [1, "a", None], [[[]]], {}, {"a": {"b": [1]}}, list(range(3000)),
]
CHAT: dict[str, Any] = {
    "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
    "stream_options": {"include_usage": True}, "nvext": {"ttft_slo_ms": 500}, "temperature": 0.5,
}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "n": 1}


def variants() -> list[tuple[str, str, dict[str, Any]]]:
    out: list[tuple[str, str, dict[str, Any]]] = []
    for path, valid in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        fields = [*valid, "stream"]
        for field in fields:
            for value in ODD:
                body = dict(valid)
                body[field] = value
                out.append((path, f"{field}={json.dumps(value)[:40]}", body))
        for value in ODD:  # inside the message and inside nvext
            out.append((path, f"nvext.backend_instance_id={json.dumps(value)[:40]}",
                        {**valid, "nvext": {"backend_instance_id": value}}))
            if path.endswith("chat/completions"):
                out.append((path, f"messages[0].content={json.dumps(value)[:40]}",
                            {**valid, "messages": [{"role": "user", "content": value}]}))
                out.append((path, f"messages[0]={json.dumps(value)[:40]}", {**valid, "messages": [value]}))
    return out


@pytest.fixture(scope="module")
async def fleet(nats_url: str) -> AsyncIterator[tuple[InProcessRouter, list[MockWorker]]]:
    async with routed_workers(nats_url, MODEL, 1) as fleet:
        yield fleet


async def test_odd_fields_are_refused_or_passed_on_never_an_internal_error(
    fleet: tuple[InProcessRouter, list[MockWorker]],
) -> None:
    router, _ = fleet
    bugs = router.runtime.metrics.rejections.labels("internal_error")
    before = bugs._value.get()
    seen: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        for path, name, body in variants():
            for stream in (False, True):
                sent = {**body, "stream": stream} if "stream" not in body else body
                resp = await http.post(path, content=json.dumps(sent).encode(),  # ASCII: a lone surrogate escaped
                                       headers={"content-type": "application/json"})
                text = resp.text
                seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
                assert resp.status_code != 500, (path, name, text[:300])
                if resp.status_code >= 400 and resp.headers.get("content-type", "").startswith("application/json"):
                    error = resp.json()["error"]
                    assert error["code"] != "internal_error", (path, name, error)
                    if resp.status_code == 400 and error.get("param") is None:
                        pytest.fail(f"{path} {name}: a 400 that names no field: {error}")
    assert bugs._value.get() == before
    assert seen.get(200, 0) > 0 and sum(n for s, n in seen.items() if s >= 400) > 0, seen
    sched = router.runtime.scheduler
    await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=10)


async def test_a_body_nested_deeper_than_the_parser_goes_is_refused_naming_the_body(
    fleet: tuple[InProcessRouter, list[MockWorker]],
) -> None:
    """JSON nested past the parser's recursion limit raised RecursionError, which no refusal caught:
    a 500 ``internal_error``. Small (parsed inline) and large (parsed in a thread), and the mock
    engine called directly, as a client of a worker would."""
    router, workers = fleet
    bugs = router.runtime.metrics.rejections.labels("internal_error")
    before = bugs._value.get()
    head = b'{"model": "%s", "prompt": "x", "max_tokens": 2, "x": ' % MODEL.encode()
    async with httpx.AsyncClient(timeout=30) as http:
        for depth in (5_000, 100_000):
            assert len(head) + 2 * depth > router.runtime.settings.offload_min_bytes or depth == 5_000
            nested = head + b"[" * depth + b"]" * depth + b"}"
            for url in (router.url, workers[0].url):
                r = await http.post(url + "/v1/completions", content=nested,
                                    headers={"content-type": "application/json"})
                assert r.status_code == 400, (url, depth, r.text[:300])
                assert "not valid JSON" in r.json()["error"]["message"]
            assert r.status_code == 400
    assert bugs._value.get() == before


async def test_lone_surrogates_are_refused_naming_the_field(fleet: tuple[InProcessRouter, list[MockWorker]]) -> None:
    """A JSON ``\\ud800`` escape is valid JSON and makes a str that UTF-8 cannot encode: the
    tokenizers raised UnicodeEncodeError (a 500 ``internal_error``), and a 404 quoting such a model
    name failed to render (a bare 500 from the server). The router and the mock engine refuse
    the text naming its field, and render every refusal whatever it quotes."""
    router, workers = fleet
    bugs = router.runtime.metrics.rejections.labels("internal_error")
    before = bugs._value.get()
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": "a \ud800 b", "max_tokens": 2}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["\udfff"], "max_tokens": 2, "stream": True}, 400, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
         400, "messages"),
        ("/v1/completions", {"model": MODEL + "\udfff", "prompt": "x"}, 404, "model"),
    ]
    async with httpx.AsyncClient(timeout=30) as http:
        for base in (router.url, workers[0].url):
            for path, body, status, field in cases:
                r = await http.post(base + path, content=json.dumps(body).encode(),  # ASCII: \ud800 escaped
                                    headers={"content-type": "application/json"})
                assert r.status_code == status, (base, path, body, r.text[:300])
                assert r.json()["error"]["param"] == field, (base, path, r.text[:300])
    assert bugs._value.get() == before


async def test_stream_is_read_as_the_worker_reads_it(fleet: tuple[InProcessRouter, list[MockWorker]]) -> None:
    """A worker (vLLM's ``stream: bool | None``, pydantic's lax mode) streams for ``"true"`` or
    ``1`` and not for ``"false"``; the router read only ``true`` as a stream, so it buffered such a
    stream to its end and answered it whole (its first token counted at the end). The router and
    the mock engine now read the field as vLLM does, and refuse a value vLLM refuses, naming it."""
    router, workers = fleet
    async with httpx.AsyncClient(timeout=30) as http:
        for base in (router.url, workers[0].url):
            for value, streamed in (("true", True), ("yes", True), (1, True), (True, True),
                                    ("false", False), ("off", False), (0, False), (None, False)):
                body = {"model": MODEL, "prompt": "read the stream flag", "max_tokens": 3, "stream": value}
                async with http.stream("POST", base + "/v1/completions", json=body) as resp:
                    content = await resp.aread()
                assert resp.status_code == 200, (base, value, content[:300])
                kind = resp.headers["content-type"]
                if streamed:
                    assert kind.startswith("text/event-stream"), (base, value, kind)
                    assert "content-length" not in resp.headers, (base, value)  # relayed, not read whole
                    assert content.rstrip().endswith(b"data: [DONE]"), (base, value, content[-200:])
                else:
                    assert kind.startswith("application/json"), (base, value, kind)
                    assert json.loads(content)["choices"], (base, value)
            for value in ("x", 2, [], {"a": 1}):
                body = {"model": MODEL, "prompt": "read the stream flag", "max_tokens": 3, "stream": value}
                r = await http.post(base + "/v1/completions", json=body)
                assert r.status_code == 400, (base, value, r.text[:300])
                assert r.json()["error"]["param"] == "stream", (base, value, r.text[:300])
    sched = router.runtime.scheduler
    await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=10)


async def test_concurrent_requests_with_one_client_request_id_are_each_served_and_freed(
    fleet: tuple[InProcessRouter, list[MockWorker]],
) -> None:
    """``x-request-id`` is the client's to choose, so it names no booking on its own: requests
    that share one, in flight together, are each routed, answered and freed (a retrying client or
    a proxy that stamps one id on a whole session does this)."""
    router, _ = fleet
    bugs = router.runtime.metrics.rejections.labels("internal_error")
    before = bugs._value.get()
    sched = router.runtime.scheduler
    body = {"model": MODEL, "prompt": "the same id twice", "max_tokens": 40, "stream": True}
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        async def one() -> tuple[int, str, str]:
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers={"x-request-id": "shared-id"}) as resp:
                text = "".join([line async for line in resp.aiter_lines()])
                return resp.status_code, resp.headers.get("x-request-id", ""), text
        answers = await asyncio.gather(*(one() for _ in range(4)))
    for status, request_id, text in answers:
        assert status == 200, text[:300]
        assert request_id == "shared-id"  # the client's id is kept on its answer
        assert text.endswith("data: [DONE]")
    assert bugs._value.get() == before
    await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=10)


def _router_objects(objects: list[Any]) -> list[str]:
    """The objects of the router's own modules among ``objects`` (types and functions)."""
    names = []
    for obj in objects:
        module = getattr(obj, "__module__", None) if callable(obj) and hasattr(obj, "__code__") \
            else type(obj).__module__
        if isinstance(module, str) and module.startswith("router."):
            names.append(f"{module}.{getattr(obj, '__qualname__', type(obj).__qualname__)}")
    return sorted(set(names))


async def test_requests_leave_no_reference_cycles_behind(
    fleet: tuple[InProcessRouter, list[MockWorker]],
) -> None:
    """A request's objects are freed by reference counting when it ends: none of the router's is
    left in a reference cycle for the collector (cycles per request cost the router a collection
    every few requests under load; docs/decisions.md 114). Streamed, not streamed and refused
    requests, and a client that leaves mid-answer (its worker connection closed under it),
    everything the collector finds unreachable kept (``DEBUG_SAVEALL``) and read."""
    router, _ = fleet
    sched = router.runtime.scheduler
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        async def warm() -> None:
            for stream in (True, False):
                resp = await http.post("/v1/completions", json={**COMPLETION, "stream": stream})
                assert resp.status_code == 200, resp.text[:300]
        await warm()  # first uses (tokenizer, pools, connections) made before the count
        await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=10)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(5):
                await warm()
                chat = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
                assert chat.status_code == 200, chat.text[:300]
                refused = await http.post("/v1/completions", json={**COMPLETION, "model": 7})
                assert refused.status_code == 400
                async with httpx.AsyncClient(base_url=router.url, timeout=30) as leaving:
                    long = {**COMPLETION, "max_tokens": 2000, "stream": True}
                    async with leaving.stream("POST", "/v1/completions", json=long) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: "):
                                break  # and the client goes
            await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=10)
            gc.collect()
            left = _router_objects(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert left == []


async def test_a_worker_stream_that_breaks_ends_the_answer_with_an_error_event(
    fleet: tuple[InProcessRouter, list[MockWorker]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's connection breaks mid-answer (the router's side of it aborted, as a worker
    that dies does): the client's stream ends with an OpenAI error event (``worker_failed``) and
    no ``[DONE]``, the answer counts as a 502, and its booking is freed."""
    router, _ = fleet
    rt = router.runtime
    opened: list[Any] = []  # what aborts the worker connection: an ASGI-path response
    real_open = rt.proxy.open

    async def spy(*args: Any, **kwargs: Any) -> Any:
        resp = await real_open(*args, **kwargs)
        opened.append(resp)
        return resp

    def relayed() -> list[Any]:  # or the worker connections of the express path's exchanges
        exchanges = [p.exchange for p in router._server.server_state.connections
                     if getattr(p, "exchange", None) is not None]
        return [ex.conn.transport for ex in exchanges if ex.conn is not None]
    monkeypatch.setattr(rt.proxy, "open", spy)
    broke = rt.metrics.requests.labels(MODEL, "/v1/completions", "502")
    before = broke.value
    body = {"model": MODEL, "prompt": "a long answer, cut", "max_tokens": 2000, "stream": True}
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break  # the answer is under way
            (opened or relayed())[0].abort()
            rest = [line async for line in lines if line]
    assert rest, "the stream ended without a word"
    error = json.loads(rest[-1].removeprefix("data: "))
    assert error["error"]["code"] == "worker_failed", rest[-3:]
    assert "data: [DONE]" not in rest
    assert broke.value == before + 1
    await wait_for(lambda: rt.scheduler.inspect(lambda s: len(s.bookings) == 0), within=10)


async def test_an_answer_read_whole_past_the_routers_limit_fails_and_frees_its_booking(nats_url: str) -> None:
    """A non-streamed answer is held whole in the router's memory: past ``max_answer_bytes`` the
    request fails naming its worker and the limit, the worker's connection is closed and the
    booking freed; the same answer streamed is relayed as it comes (never held whole)."""
    model = "org/odd-model-limited:v1"  # its own: the module's fleet serves MODEL meanwhile
    async with routed_workers(nats_url, model, 1, workers={"mock": {"speedup_ratio": 200}},
                              max_answer_bytes=2048) as (router, workers):
        body = {"model": model, "prompt": "a long answer", "max_tokens": 3000}
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text[:300]
            message = r.json()["error"]["message"]
            assert f"worker {workers[0].instance_id} failed" in message and "exceeds 2048 bytes" in message, message
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                content = await resp.aread()
            assert resp.status_code == 200 and content.rstrip().endswith(b"data: [DONE]")
            assert len(content) > 2048
        sched = router.runtime.scheduler
        await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=10)


async def test_the_mock_engine_reads_include_usage_as_vllm_does(
    fleet: tuple[InProcessRouter, list[MockWorker]],
) -> None:
    """``stream_options.include_usage`` is vLLM's ``bool | None = False``, lax: ``"false"`` adds no
    usage chunk (the mock engine read ``bool("false")``, true), ``"yes"`` does, ``"x"`` is refused."""
    _, workers = fleet
    base = {"model": MODEL, "prompt": "usage or not", "max_tokens": 2, "stream": True}
    async with httpx.AsyncClient(base_url=workers[0].url, timeout=30) as http:
        for value, usage in (("false", False), (False, False), ("yes", True), (True, True)):
            r = await http.post("/v1/completions", json={**base, "stream_options": {"include_usage": value}})
            assert r.status_code == 200, r.text[:300]
            assert ('"usage"' in r.text) is usage, (value, r.text[-300:])
        r = await http.post("/v1/completions", json={**base, "stream_options": {"include_usage": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_usage", r.text
