"""The vLLM engine's event path end to end, without vLLM: a stand-in publisher speaks vLLM's ZMQ
protocol (PUB batches + ROUTER replay) and a stand-in HTTP server answers /health and /metrics.
The worker attaches to it and publishes canonical KV events on real NATS; gaps are replayed and a
sequence restart clears the cache. (The real-vLLM test is test_worker_vllm_real.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from controlplane.protocol.events import KvCleared, KvEvent, KvStored, decode_kv_dump, decode_kv_event
from controlplane.protocol.hashing import block_hashes
from controlplane.protocol.subjects import kv_subject, kvdump_subject
from tests import buskit
from worker.agent import Worker
from worker.engines.vllm import _free_port
from worker.httpserver import HttpServer
from worker.settings import VllmEngineSettings, WorkerSettings

MODEL = "tiny-vllm"
BS = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)
METRICS = """vllm:num_requests_running{engine="0",model_name="tiny-vllm"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny-vllm"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-vllm"} 0.5
vllm:cache_config_info{block_size="4",num_gpu_blocks="100"} 1.0
"""


class StandInVllm:
    """vLLM's KV-event publisher protocol, driven by the test."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.events = f"tcp://127.0.0.1:{_free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
        # Like vLLM with a plain tcp://host:port endpoint: the publisher connects, the worker binds.
        self.pub.connect(self.events)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.replay_endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []

    def batch(self, seq: int, events: list[Any]) -> bytes:
        payload: bytes = msgpack.packb([1.0, events, 0])
        self.buffer.append((seq, payload))
        return payload

    async def publish(self, seq: int, events: list[Any]) -> None:
        await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), self.batch(seq, events)])

    async def serve_replays(self) -> None:
        while True:
            client, _, start_bytes = await self.router.recv_multipart()
            start = int.from_bytes(start_bytes, "big", signed=True)
            self.replays.append(start)
            for seq, payload in self.buffer:
                if seq >= start:
                    await self.router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"),
                                                      payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


HEALTH = {"ok": True}  # what the stand-in's /health answers (vLLM asks its engine core)


async def health(request: Request) -> Response:
    return PlainTextResponse("", status_code=200 if HEALTH["ok"] else 500)


async def metrics(request: Request) -> Response:
    return PlainTextResponse(METRICS)


@contextlib.asynccontextmanager
async def stand_in() -> AsyncIterator[tuple[StandInVllm, str]]:
    vllm = StandInVllm()
    http = HttpServer(Starlette(routes=[Route("/health", health), Route("/metrics", metrics)]),
                      host="127.0.0.1", port=0)
    await http.start()
    replays = asyncio.create_task(vllm.serve_replays())
    try:
        yield vllm, f"http://127.0.0.1:{http.port}"
    finally:
        replays.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await replays
        await http.stop()
        vllm.close()


def attached(nats_url: str, vllm: StandInVllm, url: str) -> WorkerSettings:
    """A vLLM worker's settings, attached to the stand-in (heartbeats and polls every 0.2 s)."""
    s: WorkerSettings = buskit.worker_settings(  # type: ignore[assignment]
        nats_url=nats_url, model=MODEL, engine="vllm", heartbeat_s=0.2,
        vllm=VllmEngineSettings(attach_url=url, kv_events_endpoint=vllm.events,
                                kv_replay_endpoint=vllm.replay_endpoint, block_size=BS,
                                metrics_interval_s=0.2),
    )
    return s


def stored(tokens: list[int], hashes: list[int], parent: int | None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU"}


@pytest.mark.timeout(30)
async def test_attached_worker_translates_replays_and_restarts(nats_url: str, nc: NATS) -> None:
    got: list[KvEvent] = []
    changed = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        got.append(decode_kv_event(msg.data))
        changed.set()

    async def wait_for(n: int) -> None:
        async with asyncio.timeout(5):
            while len(got) < n:
                changed.clear()
                await changed.wait()

    tokens = list(range(40, 56))  # 4 blocks of 4
    canon = block_hashes(tokens, BS)
    async with stand_in() as (vllm, url):
        s = attached(nats_url, vllm, url)
        await nc.subscribe(kv_subject(MODEL, s.instance_id), cb=on_msg)
        async with Worker(s) as w:
            assert w.record is not None and w.record.url == url
            assert w.record.kv_total_blocks == 100 and w.record.block_size == BS
            assert w.record.engine == "vllm"
            load = w.engine.load()
            assert load[0].running == 2 and load[0].kv_used_blocks == 50
            # The SUB socket may still be joining: publish until the first batch lands.
            async with asyncio.timeout(5):
                while not got:
                    vllm.buffer.clear()
                    await vllm.publish(0, [stored(tokens[:4], [1000], None)])
                    await asyncio.sleep(0.05)
            first = got[0].data
            assert isinstance(first, KvStored) and first.blocks[0].block_hash == canon[0][0]

            # seq 1 is "lost" on the wire (only buffered for replay); seq 2 reveals the gap.
            vllm.batch(1, [stored(tokens[4:8], [1001], 1000)])
            await vllm.publish(2, [stored(tokens[8:12], [1002], 1001)])
            await wait_for(3)
            assert vllm.replays == [1]
            assert [e.data.blocks[0].block_hash for e in got[:3]
                    if isinstance(e.data, KvStored)] == [c for c, _ in canon[:3]]
            assert [e.event_id for e in got] == [1, 2, 3]

            msg = await nc.request(kvdump_subject(s.instance_id), b"", timeout=2)
            dump = decode_kv_dump(msg.data)
            assert dump.partial  # attached: vLLM may hold blocks it never reported to us
            assert [c for _, c, _ in dump.ranks[0].blocks] == [c for c, _ in canon[:3]]

            # vLLM restarted: numbering starts at 0 again; everything it had is gone.
            await vllm.publish(0, [stored(tokens[:4], [2000], None)])
            await wait_for(5)
            assert isinstance(got[3].data, KvCleared)
            assert isinstance(got[4].data, KvStored)
            dump = decode_kv_dump((await nc.request(kvdump_subject(s.instance_id), b"",
                                                    timeout=2)).data)
            assert [c for _, c, _ in dump.ranks[0].blocks] == [canon[0][0]]


@pytest.mark.timeout(60)
async def test_a_dead_engine_under_a_live_agent_leaves_and_joins_again(nats_url: str) -> None:
    """vLLM's engine dies or hangs while the worker's agent lives on (a CUDA error, a deadlock):
    the agent heartbeated the last load it had read, and routers counted the worker live and sent
    it requests that failed or hung. Now the worker leaves once vLLM's /health fails
    (``HEALTH_FAILURES`` polls in a row), sends no heartbeat while it does, and joins again once it
    answers. A router forgets it at once (not after its stale time, which the bus clock stretches
    when the worker is the only one heartbeating) and takes it back."""
    from tests.support_router.workers import InProcessRouter, router_settings, wait_for

    HEALTH["ok"] = True
    async with stand_in() as (vllm, url):
        s = attached(nats_url, vllm, url)
        router = await InProcessRouter(router_settings(nats_url, MODEL)).start()
        try:
            async with Worker(s) as w:
                sched = router.runtime.scheduler

                def known() -> Any:
                    return sched.inspect(lambda sc: s.instance_id in sc.discovery.workers)

                assert w.engine.healthy()
                await wait_for(lambda: sched.view.live_workers.get(MODEL) == 1, within=10)
                HEALTH["ok"] = False
                await wait_for(lambda: not w.engine.healthy(), within=5)
                await wait_for(lambda: sched.view.live_workers.get(MODEL) == 0, within=5)
                assert not await known()  # left, not merely stale
                HEALTH["ok"] = True
                await wait_for(lambda: sched.view.live_workers.get(MODEL) == 1, within=10)
                assert await known()
        finally:
            HEALTH["ok"] = True
            await router.stop()
