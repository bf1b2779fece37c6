"""Small real workers and routers for the router's integration tests.

:class:`TestWorker` is a real process-local worker: it publishes membership join / heartbeat /
leave and KV ``stored`` events on real NATS (the subjects and payloads of
``controlplane.protocol``), answers ``rudder.kvdump.<id>``, and serves a tiny OpenAI-compatible
endpoint with uvicorn on a free port. It stands in for ``worker/`` until that lands; it mocks
nothing of NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import httpx
import uvicorn
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bus.identities import Identity, IdentityKind
from controlplane.protocol import tokenizer
from controlplane.protocol.events import (
    KvDumpRank,
    KvDumpReply,
    KvEvent,
    KvStored,
    MembershipEvent,
    MembershipOp,
    RankLoad,
    StoredBlock,
    WorkerRecord,
    WorkerRole,
)
from controlplane.protocol.hashing import block_hashes
from controlplane.protocol.subjects import kv_subject, kvdump_subject, membership_subject
from router.app import create_app, uvicorn_options
from router.settings import RouterSettings, new_router_id
from tests import buskit
from tests.policy_keys import session_keys

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def bind_socket(port: int = 0) -> socket.socket:
    """A listening-ready socket on 127.0.0.1:``port`` (0 = the kernel picks). Binding here, before
    the server starts, closes the window in which a port picked by ``free_port`` could be taken by
    an outgoing connection; a taken fixed port fails at once with OSError, not inside uvicorn."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


async def serve_in_task(app: Any, port: int, *, lifespan: str = "on", sock: socket.socket | None = None,
                        **options: Any) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    sock = sock or bind_socket(port)
    # Bounded shutdown: a connection left mid-response must not hold a test's teardown forever.
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan,
                            timeout_graceful_shutdown=3, **options)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 15
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server exited during start")
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        await asyncio.sleep(0.01)
    return server, task


class TestWorker:
    __test__ = False

    def __init__(
        self, nats_url: str, model: str, *, instance_id: int | None = None, dp_size: int = 1,
        block_size: int = 16, role: WorkerRole = WorkerRole.AGGREGATED, heartbeat_s: float = 0.2,
        kv_total_blocks: int = 1000, max_num_batched_tokens: int = 8192,
        tokenizer_folder: str | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.model = model
        self.instance_id = instance_id or secrets.randbelow(2**63) + 1
        self.dp_size = dp_size
        self.block_size = block_size
        self.role = role
        self.heartbeat_s = heartbeat_s
        self.kv_total_blocks = kv_total_blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.port = free_port()
        self.load: list[RankLoad] = [RankLoad(dp_rank=r) for r in range(dp_size)]
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []
        self.stored: set[int] = set()
        self.event_id = -1
        self.heartbeating = True
        self.answer_extra: dict[str, Any] = {}  # merged into non-streamed answers
        # A Hugging Face tokenizer folder: advertised, and used as vLLM uses it.
        self.tokenizer_folder = tokenizer_folder
        self._hf: Any = None
        if tokenizer_folder is not None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
        self.nc: NATS | None = None
        self._hb: asyncio.Task[None] | None = None
        self._server: uvicorn.Server | None = None
        self._server_task: asyncio.Task[None] | None = None
        self.started_at = datetime.now(UTC)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            instance_id=self.instance_id, model=self.model, role=self.role, url=self.url,
            dp_size=self.dp_size, block_size=self.block_size, kv_total_blocks=self.kv_total_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens, started_at=self.started_at,
            tokenizer=self.tokenizer_folder or tokenizer.NAME,
        )

    async def publish_membership(self, op: MembershipOp) -> None:
        assert self.nc is not None
        event = MembershipEvent(op=op, worker=self.record(), load=self.load, at=datetime.now(UTC))
        await self.nc.jetstream().publish(membership_subject(self.model, self.instance_id), event.to_bytes())

    async def start(self) -> TestWorker:
        # A worker's own identity: it may publish only its own membership and KV subjects.
        self.nc = await buskit.connect_as(
            self.nats_url, Identity(IdentityKind.WORKER, model=self.model, instance_id=self.instance_id))
        await self.nc.subscribe(kvdump_subject(self.instance_id), cb=self._on_dump)
        await self.start_http()
        await self.publish_membership(MembershipOp.JOIN)
        self._hb = asyncio.create_task(self._heartbeats())
        return self

    async def start_http(self) -> None:
        app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completion, methods=["POST"]),
        ])
        self._server, self._server_task = await serve_in_task(app, self.port, lifespan="off")

    async def stop_http(self) -> None:
        if self._server is not None and self._server_task is not None:
            self._server.should_exit = True
            await self._server_task
            self._server = None

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.heartbeating:
                with contextlib.suppress(Exception):
                    await self.publish_membership(MembershipOp.HEARTBEAT)

    async def stop(self, *, leave: bool = True) -> None:
        if self._hb is not None:
            self._hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb
        if leave and self.nc is not None and self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self.publish_membership(MembershipOp.LEAVE)
        await self.stop_http()
        if self.nc is not None:
            await self.nc.close()

    async def _on_dump(self, msg: Msg) -> None:
        blocks = [(None, h, h) for h in sorted(self.stored)]  # parents unknown here; chain hashes suffice
        reply = KvDumpReply(
            instance_id=self.instance_id, last_event_id=self.event_id,
            ranks=[KvDumpRank(dp_rank=0, blocks=blocks)],
        )
        await msg.respond(reply.to_bytes())

    async def _cache(self, tokens: list[int], dp_rank: int) -> int:
        """Store the prompt's blocks; publish a KV event for the new ones. Returns cached tokens."""
        assert self.nc is not None
        pairs = block_hashes(tokens, self.block_size)
        hit = 0
        for chain, _ in pairs:
            if chain not in self.stored:
                break
            hit += 1
        new = [StoredBlock(block_hash=c, tokens_hash=b) for c, b in pairs if c not in self.stored]
        if new:
            self.stored.update(b.block_hash for b in new)
            self.event_id += 1
            event = KvEvent(
                instance_id=self.instance_id, dp_rank=dp_rank, event_id=self.event_id,
                data=KvStored(parent_hash=None, blocks=new),
            )
            await self.nc.publish(kv_subject(self.model, self.instance_id), event.to_bytes())
        return hit * self.block_size

    async def _handle(self, request: Request, chat: bool) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.request_headers.append(dict(request.headers))
        if self._hf is not None:
            if chat:
                out = self._hf.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
                tokens = list(out if isinstance(out, list) else out["input_ids"])
            else:
                prompt = body["prompt"]
                tokens = list(prompt) if isinstance(prompt, list) else self._hf.encode(prompt, add_special_tokens=True)
        elif chat:
            tokens = tokenizer.encode_chat(body["messages"])
        else:
            prompt = body["prompt"]
            tokens = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
        rank = int((body.get("nvext") or {}).get("dp_rank") or 0)
        cached = await self._cache(tokens, rank)
        text = f"w{self.instance_id}"
        usage = {
            "prompt_tokens": len(tokens), "completion_tokens": 3, "total_tokens": len(tokens) + 3,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return JSONResponse({
                "id": "cmpl-1", "object": obj, "created": created, "model": body["model"],
                "choices": [choice], "usage": usage, **self.answer_extra,
            })

        async def events() -> Any:
            for i, piece in enumerate((text[:1], text[1:], "")):
                choice: dict[str, Any] = {"index": 0, "finish_reason": "stop" if i == 2 else None}
                if chat:
                    choice["delta"] = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
                else:
                    choice["text"] = piece
                chunk = {
                    "id": "cmpl-1", "object": obj + ".chunk" if chat else obj, "created": created,
                    "model": body["model"], "choices": [choice],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.005)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _chat(self, request: Request) -> Response:
        return await self._handle(request, True)

    async def _completion(self, request: Request) -> Response:
        return await self._handle(request, False)


class InProcessRouter:
    """A router app served by uvicorn inside the test's event loop."""

    def __init__(self, settings: RouterSettings) -> None:
        # Bound now, on a port the kernel picks: the advertised URL carries the real port.
        self._sock = bind_socket(0)
        settings = settings.model_copy(update={"port": self._sock.getsockname()[1]})
        self.settings = settings
        self.app = create_app(settings)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def runtime(self) -> Any:
        return self.app.state.runtime

    async def start(self) -> InProcessRouter:
        self._server, self._task = await serve_in_task(self.app, self.settings.port, sock=self._sock,
                                                       **uvicorn_options(self.app))
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task


def router_settings(nats_url: str, model: str, **kw: Any) -> RouterSettings:
    kw.setdefault("port", free_port())
    kw.setdefault("worker_ttl_s", 5.0)
    kw.setdefault("worker_stale_s", 1.0)
    kw.setdefault("heartbeat_s", 0.5)
    kw.setdefault("debug_headers", True)  # tests read which worker answered (x-worker-instance-id)
    kw.setdefault("policy_verify_keys", session_keys().verify_path)
    kw.setdefault("router_id", new_router_id())
    kw.setdefault("nats_creds", buskit.router_creds(kw["router_id"]))
    return RouterSettings(nats_url=nats_url, models=[model], **kw)


async def wait_for(predicate: Any, *, within: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + within
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(interval)


async def wait_busy(router: InProcessRouter, model: str, instance_id: int, busy: bool = True) -> None:
    """Until the router holds the worker's rank 0 busy (its load reached the router and crossed the
    applied threshold), or not."""
    sched = router.runtime.scheduler

    def check(s: Any) -> bool:
        slot = s._slots[model].get((instance_id, 0))
        return slot is not None and slot.busy is busy

    await wait_for(lambda: sched.inspect(check))


def spawn_router(nats_url: str, model: str, *, port: int, router_id: str, command: list[str] | None = None,
                 stderr: IO[bytes] | None = None, **env: str) -> subprocess.Popen[bytes]:
    """A router replica as its own process (``python -m router``, or ``command``); its log goes to
    ``stderr`` if given."""
    full = dict(os.environ)
    full.update({
        "RUDDER_NATS_URL": nats_url, "RUDDER_MODELS": json.dumps([model]), "RUDDER_PORT": str(port),
        "RUDDER_ROUTER_ID": router_id, "RUDDER_HEARTBEAT_S": "0.5", "RUDDER_LOG_LEVEL": "WARNING",
        "RUDDER_DEBUG_HEADERS": "true",
        "RUDDER_NATS_CREDS": str(buskit.router_creds(router_id)),
        "PYTHONPATH": str(ROOT), **session_keys().env(),
    })
    full.update(env)
    return subprocess.Popen(
        command or [sys.executable, "-m", "router"], env=full, cwd=str(ROOT),
        stdout=subprocess.DEVNULL, stderr=stderr or subprocess.DEVNULL, start_new_session=True,
    )


async def wait_http_ok(url: str, *, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url, timeout=1)).status_code == 200:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} did not answer 200 within {within}s")
