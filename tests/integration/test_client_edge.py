"""What a client sends and learns at the router's edge (issue 17 items 2 and 7), against real NATS.

- A client's credentials (``Authorization``, ``Cookie``, ``X-Api-Key``, ``Proxy-Authorization``)
  never reach a worker unless ``RUDDER_FORWARD_CREDENTIAL_HEADERS`` names them. The worker here
  is what the holder of a stolen worker credential would run: its own HTTP server, announced with
  a membership record published on that credential; it records every header it receives.
- Responses name no worker, rank or policy revision and carry no predicted cached tokens or TTFT
  (an oracle of other users' prefixes) unless ``RUDDER_DEBUG_HEADERS`` turns them on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from bus.identities import Identity, IdentityKind
from controlplane.protocol.events import MembershipEvent, MembershipOp, WorkerRecord
from controlplane.protocol.subjects import membership_subject
from tests import buskit
from tests.support_router.workers import InProcessRouter, router_settings, wait_for
from worker.settings import random_instance_id

pytestmark = pytest.mark.timeout(60)

CREDENTIALS = {"Authorization": "Bearer user-secret", "Cookie": "session=user-secret",
               "X-Api-Key": "user-secret", "Proxy-Authorization": "Basic user-secret"}
DEBUG_HEADERS = ("x-worker-instance-id", "x-dp-rank", "x-rudder-predicted-cached-tokens",
                 "x-rudder-policy-revisions", "x-rudder-predicted-ttft-ms")


class HarvestingWorker:
    """An HTTP server answering chats, announced on the bus with a worker credential."""

    def __init__(self, nats_url: str, model: str) -> None:
        self.nats_url = nats_url
        self.model = model
        self.instance_id = random_instance_id()
        self.received: list[dict[str, str]] = []
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request per connection (``connection: close``): the simplest server a thief runs."""
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")[1:]
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
            self.received.append(headers)
            await reader.readexactly(int(headers.get("content-length", "0")))
            body = json.dumps({"id": "x", "object": "chat.completion", "model": self.model, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                         b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = port = server.sockets[0].getsockname()[1]
        rec = WorkerRecord(instance_id=self.instance_id, model=self.model, url=f"http://127.0.0.1:{port}",
                           block_size=16, kv_total_blocks=1024, max_num_batched_tokens=8192,
                           started_at=datetime.now(UTC))
        nc = await buskit.connect_as(self.nats_url, Identity(
            IdentityKind.WORKER, model=self.model, instance_id=self.instance_id))

        async def beat() -> None:
            op = MembershipOp.JOIN
            while True:
                event = MembershipEvent(op=op, worker=rec, at=datetime.now(UTC))
                await nc.jetstream().publish(membership_subject(self.model, self.instance_id), event.to_bytes())
                op = MembershipOp.HEARTBEAT
                await asyncio.sleep(0.2)

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await nc.close()
            server.close()


@contextlib.asynccontextmanager
async def edge(nats_url: str, **router_kw: Any) -> AsyncIterator[tuple[HarvestingWorker, InProcessRouter]]:
    model = f"edge/{uuid.uuid4().hex[:6]}"
    worker = HarvestingWorker(nats_url, model)
    async with worker.running():
        router = await InProcessRouter(router_settings(nats_url, model, **router_kw)).start()
        try:
            await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 1, within=15)
            yield worker, router
        finally:
            await router.stop()


async def _chat(router: InProcessRouter, model: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
        r = await http.post("/v1/chat/completions", headers={**CREDENTIALS, "X-Custom": "kept"}, json={
            "model": model, "messages": [{"role": "user", "content": "a private system prompt " * 20}]})
    assert r.status_code == 200, r.text
    return r


async def test_client_credentials_never_reach_a_worker_by_default(nats_url: str) -> None:
    async with edge(nats_url, debug_headers=False) as (worker, router):
        r = await _chat(router, worker.model)
        got = worker.received[-1]
        assert got["x-custom"] == "kept"
        assert not {k.lower() for k in CREDENTIALS} & set(got), got
        # ... and the answer names no worker, rank or revision, and predicts nothing.
        assert not set(DEBUG_HEADERS) & set(r.headers), dict(r.headers)
        assert r.headers["x-request-id"]


async def test_an_allow_listed_credential_is_forwarded_and_debug_headers_can_be_turned_on(nats_url: str) -> None:
    async with edge(nats_url, debug_headers=True, forward_credential_headers="Authorization") as (worker, router):
        r = await _chat(router, worker.model)
        got = worker.received[-1]
        assert got["authorization"] == CREDENTIALS["Authorization"]
        assert not {"cookie", "x-api-key", "proxy-authorization"} & set(got), got
        assert int(r.headers["x-worker-instance-id"]) == worker.instance_id
        assert "x-rudder-predicted-cached-tokens" in r.headers
