"""Worker agent + mock engine against a real NATS JetStream server.

Membership (join/heartbeat/leave, read live and from the stream), KV events on the core subject
with increasing ids, kvdump, cached_tokens of a repeated prompt, eviction under a small pool,
streaming, dp ranks, roles, and a worker process stopped with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from controlplane.protocol import tokenizer
from controlplane.protocol.events import (
    KvEvent,
    KvRemoved,
    KvStored,
    MembershipEvent,
    MembershipOp,
    decode_kv_dump,
    decode_kv_event,
    decode_membership_event,
)
from controlplane.protocol.hashing import block_hashes
from controlplane.protocol.subjects import (
    STREAM_MEMBERSHIP,
    kv_subject,
    kvdump_subject,
    membership_subject,
)
from tests import buskit
from worker.agent import Worker
from worker.settings import MockEngineSettings, WorkerSettings

MODEL = "test/mock-1.0:latest"
BS = 16


def settings(nats_url: str, **overrides: Any) -> WorkerSettings:
    mock = MockEngineSettings(**{"block_size": BS, "num_blocks": 256, "speedup_ratio": 50.0,
                                 **overrides.pop("mock", {})})
    base: dict[str, Any] = {"nats_url": nats_url, "model": MODEL, "heartbeat_s": 0.2,
                            "mock": mock}
    base.update(overrides)
    return buskit.worker_settings(**base)  # type: ignore[return-value]


class Collector:
    """Messages of one core subscription, decoded."""

    def __init__(self, decode: Callable[[bytes], Any]) -> None:
        self.decode = decode
        self.items: list[Any] = []
        self.changed = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        self.items.append(self.decode(msg.data))
        self.changed.set()

    async def wait_for(self, pred: Callable[[list[Any]], bool], within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while not pred(self.items):
                self.changed.clear()
                await self.changed.wait()


@asynccontextmanager
async def running(nc: NATS, s: WorkerSettings) -> AsyncIterator[tuple[Worker, Collector]]:
    kv = Collector(decode_kv_event)
    sub = await nc.subscribe(kv_subject(s.model, s.instance_id), cb=kv.on_msg)
    await nc.flush()
    async with Worker(s) as w:
        yield w, kv
    await sub.unsubscribe()


def stored(events: list[KvEvent]) -> list[int]:
    return [b.block_hash for e in events if isinstance(e.data, KvStored) for b in e.data.blocks]


def replay(events: list[KvEvent]) -> set[int]:
    """What a router's index holds after applying ``events`` in order."""
    blocks: set[int] = set()
    for e in sorted(events, key=lambda e: e.event_id):
        if isinstance(e.data, KvStored):
            blocks.update(b.block_hash for b in e.data.blocks)
        elif isinstance(e.data, KvRemoved):
            blocks.difference_update(e.data.block_hashes)
        else:
            blocks.clear()
    return blocks


def removed(events: list[KvEvent]) -> list[int]:
    return [h for e in events if isinstance(e.data, KvRemoved) for h in e.data.block_hashes]


@pytest.mark.timeout(30)
async def test_join_heartbeats_and_leave_are_published(nats_url: str, nc: NATS) -> None:
    s = settings(nats_url, dp_size=2)
    seen = Collector(decode_membership_event)
    sub = await nc.subscribe(membership_subject(MODEL, s.instance_id), cb=seen.on_msg)
    js = nc.jetstream()
    async with Worker(s) as w:
        await seen.wait_for(lambda items: sum(e.op is MembershipOp.HEARTBEAT for e in items) >= 2)
        join = seen.items[0]
        assert isinstance(join, MembershipEvent) and join.op is MembershipOp.JOIN
        rec = join.worker
        assert rec.instance_id == s.instance_id and rec.model == MODEL and rec.dp_size == 2
        assert rec.block_size == BS and rec.kv_total_blocks == 256
        assert rec.max_num_batched_tokens == 8192 and rec.tokenizer == tokenizer.NAME
        assert rec.url == w.url and not rec.url.endswith(":0")
        beat = seen.items[-1]
        assert [r.dp_rank for r in beat.load] == [0, 1]
        # The stream keeps the last state of the worker.
        last = await js.get_last_msg(STREAM_MEMBERSHIP, membership_subject(MODEL, s.instance_id))
        assert decode_membership_event(last.data).op in (MembershipOp.JOIN, MembershipOp.HEARTBEAT)
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{w.url}/health")).status_code == 200
    await seen.wait_for(lambda items: items[-1].op is MembershipOp.LEAVE)
    last = await js.get_last_msg(STREAM_MEMBERSHIP, membership_subject(MODEL, s.instance_id))
    assert decode_membership_event(last.data).op is MembershipOp.LEAVE
    info = await js.stream_info(STREAM_MEMBERSHIP)
    assert info.config.max_msgs_per_subject == 1
    await sub.unsubscribe()


@pytest.mark.timeout(30)
async def test_kv_events_cached_tokens_and_dump(nats_url: str, nc: NATS) -> None:
    s = settings(nats_url)
    prompt = "x" * 37 + "".join(chr(ord("A") + i % 26) for i in range(63))  # 100 tokens
    tokens = tokenizer.encode(prompt)
    expected = block_hashes(tokens, BS)  # 6 full blocks
    async with running(nc, s) as (w, kv), httpx.AsyncClient(base_url=w.url) as http:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        first = (await http.post("/v1/completions", json=body)).json()
        assert first["usage"]["prompt_tokens"] == 100
        assert first["usage"]["completion_tokens"] == 2
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert first["choices"][0]["text"] == "ab"
        await kv.wait_for(lambda items: len(stored(items)) >= 6)
        assert stored(kv.items) == [c for c, _ in expected]
        ev0 = kv.items[0]
        assert isinstance(ev0.data, KvStored) and ev0.data.parent_hash is None
        assert [b.tokens_hash for b in ev0.data.blocks] == [b for _, b in expected]

        second = (await http.post("/v1/completions", json=body)).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS
        # Token ids work as a prompt too, and hit the same blocks.
        third = (await http.post("/v1/completions", json={**body, "prompt": tokens})).json()
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS
        assert len(stored(kv.items)) == 6  # nothing new was stored (the dump below proves no
        ids = [e.event_id for e in kv.items]  # event was still on its way: its last id is ours)
        assert ids == list(range(1, len(ids) + 1))

        msg = await nc.request(kvdump_subject(s.instance_id), b"", timeout=2)
        reply = decode_kv_dump(msg.data)
        assert reply.instance_id == s.instance_id and reply.last_event_id == ids[-1]
        assert not reply.partial and [r.dp_rank for r in reply.ranks] == [0]
        dumped = reply.ranks[0].blocks
        assert {c for _, c, _ in dumped} == replay(kv.items)
        assert [(p, c, t) for p, c, t in dumped] == [
            (expected[i - 1][0] if i else None, c, t) for i, (c, t) in enumerate(expected)
        ]


@pytest.mark.timeout(30)
async def test_small_pool_evicts_and_emits_removed(nats_url: str, nc: NATS) -> None:
    s = settings(nats_url, mock={"num_blocks": 8})
    async with running(nc, s) as (w, kv), httpx.AsyncClient(base_url=w.url) as http:
        for i in range(4):
            prompt = chr(ord("a") + i) * (3 * BS + 5)  # 3 full blocks each
            r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200
        await kv.wait_for(lambda items: len(removed(items)) >= 4)
        gone = removed(kv.items)
        assert set(gone) <= set(stored(kv.items))
        first_blocks = [c for c, _ in block_hashes(tokenizer.encode("a" * (3 * BS + 5)), BS)]
        assert set(first_blocks) & set(gone)  # the oldest prompt went first
        reply = decode_kv_dump((await nc.request(kvdump_subject(s.instance_id), b"",
                                                 timeout=2)).data)
        live = {c for _, c, _ in reply.ranks[0].blocks}
        assert live == replay(kv.items) and len(live) <= 8
        assert reply.last_event_id == kv.items[-1].event_id


@pytest.mark.timeout(30)
async def test_streaming_chat_with_usage_and_dp_ranks(nats_url: str, nc: NATS) -> None:
    s = settings(nats_url, dp_size=2)
    messages = [{"role": "system", "content": "s" * 40}, {"role": "user", "content": "hello"}]
    async with running(nc, s) as (w, kv), httpx.AsyncClient(base_url=w.url) as http:
        body = {"model": MODEL, "messages": messages, "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}, "nvext": {"dp_rank": 1}}
        chunks: list[Any] = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers["x-dp-rank"] == "1"
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
        assert chunks[-1] == "[DONE]"
        parsed = [json.loads(c) for c in chunks[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in parsed if c["choices"])
        assert text == "abcde"
        assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
        assert parsed[-2]["choices"][0]["finish_reason"] == "length"
        usage = parsed[-1]["usage"]
        n_prompt = len(tokenizer.encode_chat(messages))
        assert usage == {"prompt_tokens": n_prompt, "completion_tokens": 5,
                         "total_tokens": n_prompt + 5,
                         "prompt_tokens_details": {"cached_tokens": 0}}
        await kv.wait_for(lambda items: len(items) >= 1)
        assert {e.dp_rank for e in kv.items} == {1}

        # The header wins over the body; the other rank has its own cache.
        plain = {"model": MODEL, "messages": messages, "max_tokens": 2}
        r = await http.post("/v1/chat/completions", json=plain, headers={"x-dp-rank": "0"})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
        r = await http.post("/v1/chat/completions", json=plain, headers={"x-dp-rank": "1"})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (n_prompt - 1) // BS * BS

        bad = await http.post("/v1/chat/completions", json={**plain, "nvext": {"dp_rank": 2}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "dp_rank"
        unknown = await http.post("/v1/chat/completions", json={**plain, "model": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        broken = await http.post("/v1/completions", content=b"{nope")
        assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL
        metrics = (await http.get("/metrics")).text
        assert 'rudder_mock_running{dp_rank="1"}' in metrics
        assert "rudder_mock_requests_total" in metrics


@pytest.mark.timeout(30)
async def test_prefill_and_decode_roles(nats_url: str, nc: NATS) -> None:
    prompt = "p" * (4 * BS + 3)
    pre = settings(nats_url, role="prefill")
    dec = settings(nats_url, role="decode", mock={"kv_transfer_base_ms": 200.0,
                                                  "speedup_ratio": 1.0})
    async with running(nc, pre) as (wp, kvp), running(nc, dec) as (wd, kvd):
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{wp.url}/v1/completions",
                                json={"prompt": prompt, "max_tokens": 50})
            assert r.json()["usage"]["completion_tokens"] == 1
            await kvp.wait_for(lambda items: len(stored(items)) == 4)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            r = await http.post(f"{wd.url}/v1/completions",
                                json={"prompt": prompt, "max_tokens": 3})
            assert loop.time() - t0 >= 0.2  # the simulated KV transfer
            assert r.json()["usage"]["completion_tokens"] == 3
            assert r.json()["choices"][0]["text"] == "abc"
            await kvd.wait_for(lambda items: len(stored(items)) == 4)


@pytest.mark.timeout(30)
async def test_start_fails_fast_without_nats() -> None:
    s = buskit.worker_settings(nats_url="nats://127.0.0.1:1", model=MODEL, nats_connect_timeout_s=1.0)
    with pytest.raises(ConnectionError, match="RUDDER_NATS_URL"):
        async with Worker(s):
            pass


@pytest.mark.timeout(40)
async def test_worker_process_leaves_on_sigterm(nats_url: str, nc: NATS) -> None:
    instance_id = 4242
    seen = Collector(decode_membership_event)
    await nc.subscribe(membership_subject(MODEL, instance_id), cb=seen.on_msg)
    await nc.flush()
    env = {**os.environ, **buskit.worker_env(MODEL, instance_id), "RUDDER_NATS_URL": nats_url,
           "RUDDER_MODEL": MODEL, "RUDDER_HEARTBEAT_S": "0.2",
           "RUDDER_MOCK__SPEEDUP_RATIO": "10"}
    proc = subprocess.Popen(  # noqa: ASYNC220 - the worker must be a real process to signal
        [sys.executable, "-m", "worker"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        await seen.wait_for(lambda items: len(items) >= 2, within=20)
        assert seen.items[0].op is MembershipOp.JOIN
        url = seen.items[0].worker.url
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        await seen.wait_for(lambda items: items[-1].op is MembershipOp.LEAVE, within=10)
        rc = await asyncio.to_thread(proc.wait, 10)
        assert rc == 0, proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
