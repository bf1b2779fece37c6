"""Disaggregated serving through the router, against the project's real mock workers (worker/)
with roles ``prefill`` and ``decode``, over real NATS (DESIGN §5, issue 4 item 4)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from controlplane.protocol import tokenizer
from controlplane.protocol.events import WorkerRole
from controlplane.protocol.hashing import block_hashes
from tests.support_router.workers import (
    InProcessRouter,
    MockWorker,
    mock_answer,
    mock_workers,
    router_settings,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)
MODEL = "mock/disagg:1b"
BLOCK = 16
ROLES = [{"role": WorkerRole.PREFILL}, {"role": WorkerRole.PREFILL}, {"role": WorkerRole.DECODE},
         {"role": WorkerRole.DECODE}]


@dataclass
class Fleet:
    router: InProcessRouter
    prefill: list[MockWorker]
    decode: list[MockWorker]
    http: httpx.AsyncClient

    def ids(self, role: str) -> set[int]:
        return {w.instance_id for w in getattr(self, role)}

    def by_id(self, wid: int) -> MockWorker:
        return next(w for w in self.prefill + self.decode if w.instance_id == wid)

    def requests(self, w: MockWorker) -> int:
        return w.api.stats.requests


@pytest.fixture(scope="module")
async def fleet(nats_url: str) -> AsyncIterator[Fleet]:
    async with mock_workers(nats_url, MODEL, each=ROLES, mock={"block_size": BLOCK}) as workers:
        router = await InProcessRouter(router_settings(nats_url, MODEL)).start()
        sched = router.runtime.scheduler
        await wait_for(lambda: sched.view.workers.get(MODEL) == 4, within=10)
        assert await sched.inspect(lambda s: s.chooser.disaggregated(MODEL))
        async with httpx.AsyncClient(base_url=router.url, timeout=20) as http:
            yield Fleet(router, workers[:2], workers[2:], http)
        await router.stop()


def _chat_hashes(messages: list[dict[str, str]]) -> list[int]:
    return [chain for chain, _ in block_hashes(tokenizer.encode_chat(messages), BLOCK)]


async def _no_bookings_left(fleet: Fleet) -> None:
    sched = fleet.router.runtime.scheduler
    await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=5)


async def test_disaggregated_chat_runs_prefill_then_decode(fleet: Fleet) -> None:
    messages = [{"role": "system", "content": "You answer in one word. " * 8},
                {"role": "user", "content": "disaggregated, not streamed"}]
    before = {w.instance_id: fleet.requests(w) for w in fleet.prefill + fleet.decode}
    client = openai.AsyncOpenAI(base_url=fleet.router.url + "/v1", api_key="none", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=5)
    reply = raw.parse()
    await client.close()

    prefill_id = int(raw.headers["x-prefill-instance-id"])
    decode_id = int(raw.headers["x-worker-instance-id"])
    assert prefill_id in fleet.ids("prefill") and decode_id in fleet.ids("decode")
    # The decode worker produced the whole answer; the prefill worker's one token was dropped.
    assert reply.choices[0].message.content == mock_answer(5)
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    after = {w.instance_id: fleet.requests(w) for w in fleet.prefill + fleet.decode}
    assert {wid for wid in after if after[wid] != before[wid]} == {prefill_id, decode_id}

    # The prefill worker's engine computed the prompt: its cache holds every full block, and its
    # KV events put them in the router's index under its id.
    hashes = _chat_hashes(messages)
    cached = {b[1] for rank in fleet.by_id(prefill_id).dump().ranks for b in rank.blocks}
    assert set(hashes) <= cached
    sched = fleet.router.runtime.scheduler
    await wait_for(lambda: sched.inspect(
        lambda s: s.index.overlaps(hashes).get((prefill_id, 0), (0,))[0] == len(hashes)))
    await _no_bookings_left(fleet)


async def test_disaggregated_streaming_chat(fleet: Fleet) -> None:
    messages = [{"role": "user", "content": "disaggregated and streamed " * 4}]
    client = openai.AsyncOpenAI(base_url=fleet.router.url + "/v1", api_key="none", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )
    assert int(raw.headers["x-prefill-instance-id"]) in fleet.ids("prefill")
    assert int(raw.headers["x-worker-instance-id"]) in fleet.ids("decode")
    chunks = [c async for c in raw.parse()]
    await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == mock_answer(6)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    await _no_bookings_left(fleet)
    metrics = (await fleet.http.get("/metrics")).text
    assert 'rudder_router_phase_ttft_seconds_count{model="mock/disagg:1b",phase="prefill"}' in metrics
    assert 'rudder_router_phase_ttft_seconds_count{model="mock/disagg:1b",phase="decode"}' in metrics


async def test_repeated_prompt_goes_to_the_prefill_worker_that_holds_it(fleet: Fleet) -> None:
    # Long enough that the owner's cached prefix outweighs, by milliseconds, what a late load
    # report can add to its cost (at a few hundred tokens the margin was a fraction of one).
    system = "A long shared system prompt for prefix caching. " * 120
    first = await fleet.http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q1"}],
    })
    assert first.status_code == 200, first.text
    owner = int(first.headers["x-prefill-instance-id"])
    hashes = _chat_hashes([{"role": "system", "content": system}])
    sched = fleet.router.runtime.scheduler
    await wait_for(lambda: sched.inspect(
        lambda s: s.index.overlaps(hashes).get((owner, 0), (0,))[0] >= len(hashes) - 1))
    for q in ("q2", "q3"):
        r = await fleet.http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
        })
        assert r.status_code == 200, r.text
        assert int(r.headers["x-prefill-instance-id"]) == owner


async def test_prefill_target_naming_a_decode_worker_is_400_naming_the_pool(fleet: Fleet) -> None:
    decode_id = fleet.decode[0].instance_id
    before = [fleet.requests(w) for w in fleet.prefill + fleet.decode]
    r = await fleet.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "hi", "nvext": {"prefill_worker_id": decode_id},
    })
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == (
        f"nvext.prefill_worker_id={decode_id} does not identify a known worker in the prefill pool"
    )
    assert err["param"] == "nvext.prefill_worker_id" and err["type"] == "invalid_request_error"
    r = await fleet.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"},
                              headers={"x-prefill-instance-id": str(decode_id)})
    assert r.json()["error"]["message"] == (
        f"header x-prefill-instance-id={decode_id} does not identify a known worker in the prefill pool"
    )
    assert [fleet.requests(w) for w in fleet.prefill + fleet.decode] == before


async def test_decode_target_naming_a_prefill_worker_is_400_naming_the_pool(fleet: Fleet) -> None:
    prefill_id = fleet.prefill[0].instance_id
    r = await fleet.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "hi", "nvext": {"decode_worker_id": prefill_id},
    })
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        f"nvext.decode_worker_id={prefill_id} does not identify a known worker in the decode pool"
    )
    await _no_bookings_left(fleet)  # the prefill phase ran and was released


async def test_pinned_prefill_and_decode_targets_are_honoured(fleet: Fleet) -> None:
    for p in fleet.prefill:
        for d in fleet.decode:
            r = await fleet.http.post("/v1/completions", json={
                "model": MODEL, "prompt": "pinned both ways", "max_tokens": 2,
                "nvext": {"prefill_worker_id": p.instance_id, "decode_worker_id": d.instance_id},
            })
            assert r.status_code == 200, r.text
            assert int(r.headers["x-prefill-instance-id"]) == p.instance_id
            assert int(r.headers["x-worker-instance-id"]) == d.instance_id
    # Headers stand for the fields.
    p, d = fleet.prefill[1], fleet.decode[0]
    r = await fleet.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                              headers={"x-prefill-instance-id": str(p.instance_id),
                                       "x-worker-instance-id": str(d.instance_id)})
    assert (int(r.headers["x-prefill-instance-id"]), int(r.headers["x-worker-instance-id"])) == (
        p.instance_id, d.instance_id)


async def test_prefill_error_is_the_answer_and_no_decode_runs(fleet: Fleet) -> None:
    before = [fleet.requests(w) for w in fleet.decode]
    r = await fleet.http.post("/v1/completions", json={"model": MODEL, "prompt": "two", "n": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"
    assert int(r.headers["x-prefill-instance-id"]) in fleet.ids("prefill")
    assert [fleet.requests(w) for w in fleet.decode] == before
    await _no_bookings_left(fleet)


async def test_concurrent_disaggregated_requests_all_complete(fleet: Fleet) -> None:
    async def one(i: int) -> httpx.Response:
        return await fleet.http.post("/v1/completions", json={
            "model": MODEL, "prompt": f"concurrent request {i} " * 10, "max_tokens": 3,
            "stream": i % 2 == 0,
        })

    answers = await asyncio.gather(*(one(i) for i in range(16)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    assert {int(r.headers["x-worker-instance-id"]) for r in answers} <= fleet.ids("decode")
    await _no_bookings_left(fleet)


# -- what each phase is sent, and retries per phase (what the workers received) ---------------------

RMODEL = "disagg-recorded"


@dataclass
class Recorded:
    router: InProcessRouter
    prefill: list[MockWorker]
    decode: list[MockWorker]
    http: httpx.AsyncClient


# The second of each pool is ten times slower than the first (their advertised timings say so).
SLOWER = {"speedup_ratio": 5.0}


@pytest.fixture(scope="module")
async def recorded(nats_url: str) -> AsyncIterator[Recorded]:
    async with mock_workers(nats_url, RMODEL, each=[
        {"role": WorkerRole.PREFILL}, {"role": WorkerRole.PREFILL, "mock": SLOWER},
        {"role": WorkerRole.DECODE}, {"role": WorkerRole.DECODE, "mock": SLOWER},
    ]) as workers:
        router = await InProcessRouter(router_settings(nats_url, RMODEL)).start()
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(RMODEL) == 4)
        async with httpx.AsyncClient(base_url=router.url, timeout=20) as http:
            yield Recorded(router, workers[:2], workers[2:], http)
        await router.stop()


async def test_prefill_phase_is_sent_one_token_unstreamed_and_decode_the_request(recorded: Recorded) -> None:
    p, d = recorded.prefill[0], recorded.decode[1]
    messages = [{"role": "user", "content": "hi, long enough for a few KV blocks " * 2}]
    body = {
        "model": RMODEL, "messages": messages, "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": 7, "max_completion_tokens": 7,
        "min_tokens": 2, "nvext": {"prefill_worker_id": p.instance_id, "decode_worker_id": d.instance_id},
    }
    async with recorded.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines()]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == mock_answer(7)
    assert "data: [DONE]" in lines
    sent_p, sent_d = p.requests[-1], d.requests[-1]
    assert sent_p["stream"] is False and "stream_options" not in sent_p and "min_tokens" not in sent_p
    assert sent_p["max_tokens"] == 1 and sent_p["max_completion_tokens"] == 1
    assert sent_p["kv_transfer_params"]["do_remote_decode"] is True
    assert sent_p["nvext"]["backend_instance_id"] == p.instance_id
    assert p.request_headers[-1]["x-worker-instance-id"] == str(p.instance_id)
    # The decode worker gets the client's request, and what the prefill handed over: the prompt's
    # blocks on the prefill engine (the mock engine answers them as vLLM's NixlConnector does).
    assert sent_d["stream"] is True and sent_d["max_tokens"] == 7 and sent_d["min_tokens"] == 2
    assert sent_d["stream_options"] == {"include_usage": True}
    handed = _chat_hashes(messages)
    assert len(handed) >= 2
    assert sent_d["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": str(p.instance_id),
        "remote_block_ids": handed,
    }
    assert sent_d["nvext"]["backend_instance_id"] == d.instance_id


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_connection_failure_before_first_byte_retries_within_the_phase(
    recorded: Recorded, phase: str
) -> None:
    pool = recorded.prefill if phase == "prefill" else recorded.decode
    dead, live = pool
    # The dead worker is the faster one, so the cost picks it first; its HTTP server is down.
    # (Reported load would not do: a real engine serves a new request behind that load.)
    def dead_is_faster(s: Any) -> bool:
        slots = s._slots[RMODEL]
        return bool(slots[(dead.instance_id, 0)].timing.prefill_step_ms(64)
                    < slots[(live.instance_id, 0)].timing.prefill_step_ms(64))

    assert await recorded.router.runtime.scheduler.inspect(dead_is_faster)
    await dead.stop_http()
    metrics = recorded.router.runtime.metrics
    retries = metrics.retries.labels(RMODEL)._value.get()
    try:
        before = len(live.requests)
        r = await recorded.http.post("/v1/completions", json={"model": RMODEL, "prompt": "retry me"})
        assert r.status_code == 200, r.text
        header = "x-prefill-instance-id" if phase == "prefill" else "x-worker-instance-id"
        assert int(r.headers[header]) == live.instance_id
        assert len(live.requests) == before + 1
        assert metrics.retries.labels(RMODEL)._value.get() == retries + 1
        # A pin to the dead worker is never rerouted.
        field = "prefill_worker_id" if phase == "prefill" else "decode_worker_id"
        await wait_for(lambda: recorded.router.runtime.scheduler.inspect(
            lambda s: not s.discovery.get(dead.instance_id).unreachable))
        r = await recorded.http.post("/v1/completions", json={
            "model": RMODEL, "prompt": "pinned", "nvext": {field: dead.instance_id}})
        assert r.status_code == 503, r.text
    finally:
        await dead.start_http()
    sched = recorded.router.runtime.scheduler
    await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=5)
