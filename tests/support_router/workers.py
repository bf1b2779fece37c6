"""Real workers and routers for the router's integration tests, in the test's event loop.

Workers are the product's: :class:`worker.agent.Worker` with the mock engine (the worker protocol
has one implementation). :func:`mock_workers` starts N of them, each with its own instance id and
the credentials issued for it (``tests.buskit``); what a test reads or does to one is real:

- ``requests`` / ``request_headers``: what reached the worker's HTTP API, recorded by an ASGI
  wrapper (:class:`Recorder`) around the engine's own app. The harness serves that wrapper on the
  port the worker advertises (:class:`FrontedMock`), so ``stop_http`` / ``start_http`` close and
  reopen that port for real while the worker keeps heartbeating;
- ``pause_bus`` / ``resume_bus``: with ``bus_link=True`` the worker reaches NATS through a relay
  (:class:`BusLink`) that can hold what the worker sends, as a network fault would: its heartbeats
  and KV events stop reaching the bus until it is resumed;
- :func:`held`: real load, streamed requests sent straight to the engine and held open; the
  engine's settings (speedup ratio, ``max_num_seqs``, ``max_num_batched_tokens``, KV blocks) make
  that load what the test needs;
- ``record``, ``dump()``, ``load()``, ``api.stats``: the agent's and the engine's own state.

:class:`InProcessRouter` is a router app served by uvicorn in the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.protocol.events import KvDumpRank, KvDumpReply, RankLoad, WorkerRecord
from router.app import create_app, uvicorn_options
from router.settings import RouterSettings, new_router_id
from tests import buskit
from tests.policy_keys import session_keys
from worker.agent import Worker
from worker.engines.base import EngineInfo, KvSink
from worker.engines.mock.api import MockApi
from worker.engines.mock.service import MockEngine
from worker.engines.mock.tokenizer import BYTES
from worker.httpserver import advertised_url
from worker.settings import MockEngineSettings, WorkerSettings

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


@dataclasses.dataclass(frozen=True)
class Received:
    """One POST as the worker's app received it (``body``: the parsed JSON, None if not JSON)."""

    path: str
    headers: dict[str, str]
    body: Any


class Recorder:
    """ASGI wrapper: records every POST, once its body has been read, then passes it on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.received: list[Received] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def recording() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self._record(scope, b"".join(chunks))
            return message

        await self.app(scope, recording, send)

    def _record(self, scope: Scope, raw: bytes) -> None:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.received.append(Received(scope["path"], headers, body))


class FrontedMock:
    """The mock engine (an ``Engine`` for the agent) whose app the harness serves, behind a
    :class:`Recorder`, on a port it binds itself and can close and reopen; that port is the URL
    the worker advertises. The engine's own server stays up (``direct_url``, for :func:`held`)."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.mock = MockEngine(settings)
        self.recorder: Recorder | None = None
        self.url = ""  # advertised: the front
        self.direct_url = ""
        self._sock: socket.socket | None = bind_socket(0)
        self.port: int = self._sock.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, kv_sink: KvSink) -> EngineInfo:
        info = await self.mock.start(kv_sink)
        assert self.mock.api is not None
        self.direct_url = info.url
        self.recorder = Recorder(self.mock.api.app)
        try:
            await self.start_http()
        except BaseException:
            await self.mock.stop()
            raise
        s = self.settings
        self.url = advertised_url(host=s.host, port=self.port, advertise_host=s.advertise_host)
        return dataclasses.replace(info, url=self.url)

    async def start_http(self) -> None:
        assert self.recorder is not None and self._server is None
        sock, self._sock = self._sock or bind_socket(self.port), None
        self._server, self._task = await serve_in_task(self.recorder, self.port, lifespan="off", sock=sock)

    async def stop_http(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    async def stop(self) -> None:
        # The front first: requests in flight there drain before the engine stops (as the
        # engine's own server does).
        await self.stop_http()
        if self._sock is not None:
            self._sock.close()
        await self.mock.stop()

    def load(self) -> list[RankLoad]:
        return self.mock.load()

    def dump(self) -> list[KvDumpRank]:
        return self.mock.dump()

    @property
    def partial_view(self) -> bool:
        return False

    def healthy(self) -> bool:  # the engine's (a closed front is the router's to find out)
        return self.mock.healthy()


class BusLink:
    """A TCP relay between one worker and its NATS server (one ``nats://host:port``).

    ``pause`` holds what the worker sends (the server's side still reaches it): its heartbeats and
    KV events stop reaching the bus, as when its network fails, while it keeps running;
    ``resume`` delivers what was held and relays again."""

    def __init__(self, nats_url: str) -> None:
        parts = urlsplit(nats_url)
        if parts.scheme != "nats" or parts.hostname is None or parts.port is None:
            raise ValueError(f"a bus link relays one plain nats://host:port, not {nats_url!r}")
        self._upstream = (parts.hostname, parts.port)
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._relays: set[asyncio.Task[Any]] = set()

    async def start(self) -> str:
        """Listen; returns the URL the worker connects to."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def stop(self) -> None:
        self._open.set()
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()  # (3.12+ waits for the connections closed above)

    async def _relay(self, worker_r: asyncio.StreamReader, worker_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        self._writers.append(worker_w)
        try:
            server_r, server_w = await asyncio.open_connection(*self._upstream)
            self._writers.append(server_w)
            await asyncio.gather(self._pump(worker_r, server_w, gated=True),
                                 self._pump(server_r, worker_w, gated=False))
        except OSError:
            worker_w.close()
        finally:
            self._relays.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, gated: bool) -> None:
        try:
            while data := await reader.read(65536):
                if gated:
                    await self._open.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


class MockWorker:
    """One real worker (agent + mock engine) and what tests read from it or do to it."""

    def __init__(self, settings: WorkerSettings, *, link: BusLink | None = None) -> None:
        self.settings = settings
        self.engine = FrontedMock(settings)
        self.worker = Worker(settings, engine=self.engine)
        self.link = link

    @property
    def instance_id(self) -> int:
        return self.settings.instance_id

    @property
    def url(self) -> str:
        """The URL it advertises (or would: see :meth:`serve_only`)."""
        return self.engine.url

    @property
    def record(self) -> WorkerRecord:
        assert self.worker.record is not None, "the worker is not started"
        return self.worker.record

    @property
    def api(self) -> MockApi:
        assert self.engine.mock.api is not None, "the worker is not started"
        return self.engine.mock.api

    @property
    def received(self) -> list[Received]:
        return [] if self.engine.recorder is None else self.engine.recorder.received

    @property
    def requests(self) -> list[Any]:
        """The bodies of the POSTs that reached the worker's advertised URL, in order."""
        return [r.body for r in self.received]

    @property
    def request_headers(self) -> list[dict[str, str]]:
        return [r.headers for r in self.received]

    def dump(self) -> KvDumpReply:
        """What the worker answers a ``kvdump`` request with."""
        return self.worker.dump()

    def load(self) -> list[RankLoad]:
        """The per-rank load its next heartbeat reports."""
        return self.engine.load()

    def cached_blocks(self) -> int:
        return sum(len(rank.blocks) for rank in self.dump().ranks)

    async def start(self) -> MockWorker:
        try:
            await self.worker.start()
        except BaseException:
            if self.link is not None:
                await self.link.stop()
            raise
        return self

    async def serve_only(self) -> MockWorker:
        """Start the engine and its HTTP API without the agent: a server that never announces
        itself on the bus (its KV events go nowhere)."""
        await self.engine.start(lambda *_: None)
        return self

    async def stop(self) -> None:
        """Leave (through a resumed link), drain, close. Safe to call twice."""
        if self.link is not None:
            self.link.resume()
        await self.worker.stop()
        if self.link is not None:
            await self.link.stop()

    def pause_bus(self) -> None:
        assert self.link is not None, "start the worker with bus_link=True"
        self.link.pause()

    def resume_bus(self) -> None:
        assert self.link is not None, "start the worker with bus_link=True"
        self.link.resume()

    async def stop_http(self) -> None:
        """Close the advertised port (connections are refused); the worker keeps heartbeating."""
        await self.engine.stop_http()

    async def start_http(self) -> None:
        await self.engine.start_http()


# The engine 50 times faster than the reference timings, 16-token blocks, 3 tokens an answer
# unless the request says otherwise.
MOCK_DEFAULTS: dict[str, Any] = {"speedup_ratio": 50.0, "block_size": 16, "default_max_tokens": 3}


def worker_settings(nats_url: str, model: str, **overrides: Any) -> WorkerSettings:
    """A mock worker's settings for router tests: heartbeats every 0.2 s, :data:`MOCK_DEFAULTS`;
    ``mock={...}`` overrides engine settings, other keywords ``WorkerSettings`` fields (an
    ``instance_id`` gets credentials of its own)."""
    mock = {**MOCK_DEFAULTS, **overrides.pop("mock", {})}
    values: dict[str, Any] = {"heartbeat_s": 0.2, **overrides}
    settings = buskit.worker_settings(nats_url=nats_url, model=model, mock=MockEngineSettings(**mock), **values)
    assert isinstance(settings, WorkerSettings)
    return settings


async def start_worker(nats_url: str, model: str, *, bus_link: bool = False, **overrides: Any) -> MockWorker:
    """One started worker (joined: its membership is on the bus). ``bus_link``: through a
    :class:`BusLink`, for ``pause_bus``."""
    if not bus_link:
        return await MockWorker(worker_settings(nats_url, model, **overrides)).start()
    link = BusLink(nats_url)
    try:
        worker = MockWorker(worker_settings(await link.start(), model, **overrides), link=link)
    except BaseException:
        await link.stop()
        raise
    return await worker.start()


def predicted_and_cached(answer: httpx.Response) -> tuple[int, int]:
    """(tokens the router predicted cached, tokens the worker reports cached) for a non-streamed
    answer through a router with its debug headers on; -1 predicted when the header is missing."""
    details = answer.json()["usage"].get("prompt_tokens_details") or {}
    return int(answer.headers.get("x-rudder-predicted-cached-tokens", -1)), int(details.get("cached_tokens") or 0)


async def ask_cached(http: httpx.AsyncClient, model: str, prompt: str) -> tuple[int, int]:
    """:func:`predicted_and_cached` of a 2-token completion of ``prompt`` through the router
    ``http`` is based on; fails unless it is answered 200."""
    r = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return predicted_and_cached(r)


def worker_process(nats_url: str, model: str, log: Path, *, instance_id: int | None = None,
                   speedup: float = 20.0) -> subprocess.Popen[bytes]:
    """A mock worker as a process of its own (``python -m worker``), for tests that kill it: its
    own session (``os.killpg``), output to ``log``, heartbeats every 0.2 s, credentials issued for
    ``instance_id`` (a random one if None)."""
    wid = instance_id if instance_id is not None else secrets.randbelow(2**63) + 1
    env = {**os.environ, **buskit.worker_env(model, wid),
           "RUDDER_NATS_URL": nats_url, "RUDDER_MODEL": model, "RUDDER_PORT": "0",
           "RUDDER_HEARTBEAT_S": "0.2", "RUDDER_MOCK__SPEEDUP_RATIO": str(speedup), "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "worker"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


@contextlib.asynccontextmanager
async def mock_workers(nats_url: str, model: str, n: int = 1, *, each: Sequence[Mapping[str, Any]] = (),
                       **common: Any) -> AsyncIterator[list[MockWorker]]:
    """``n`` workers (or one per entry of ``each``, its keywords over ``common``'s, ``mock``
    merged), started together and stopped (leaving) at the end."""
    specs = [dict(spec) for spec in each] or [{} for _ in range(n)]
    for spec in specs:
        spec["mock"] = {**common.get("mock", {}), **spec.get("mock", {})}
        for key, value in common.items():
            spec.setdefault(key, value)
    started = await asyncio.gather(*(start_worker(nats_url, model, **spec) for spec in specs),
                                   return_exceptions=True)
    workers = [w for w in started if isinstance(w, MockWorker)]
    try:
        for result in started:
            if isinstance(result, BaseException):
                raise result
        yield workers
    finally:
        await asyncio.gather(*(w.stop() for w in workers))


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads, in order, of a whole HTTP/1.1 answer read off a socket: its head,
    then a chunked SSE body."""
    body, out = raw.partition(b"\r\n\r\n")[2], bytearray()
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += body[:size]
        body = body[size + 2:]
    return [line.removeprefix(b"data: ") for line in out.split(b"\n") if line.startswith(b"data: ")]


def mock_answer(tokens: int = MOCK_DEFAULTS["default_max_tokens"]) -> str:
    """What the mock engine answers in ``tokens`` tokens (byte tokenizer)."""
    return BYTES.decode([BYTES.output_token(i) for i in range(tokens)])


def engine_idle(worker: MockWorker) -> bool:
    return all(r.running == 0 and r.waiting == 0 for r in worker.load())


@contextlib.asynccontextmanager
async def held(worker: MockWorker, prompts: Sequence[str], *, max_tokens: int) -> AsyncIterator[None]:
    """Real load on ``worker`` while the block runs: each prompt sent as a streamed completion
    straight to its engine (not through the recorded port), in order, each queued by the engine
    before the next is sent, and held open unread. Then the streams are closed (the engine aborts
    them) and the engine is idle again."""
    async with httpx.AsyncClient(base_url=worker.engine.direct_url, timeout=30) as http, \
            contextlib.AsyncExitStack() as streams:
        for i, prompt in enumerate(prompts):
            resp = await streams.enter_async_context(http.stream("POST", "/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "stream": True}))
            assert resp.status_code == 200, await resp.aread()
            await wait_for(lambda n=i + 1: sum(r.running + r.waiting for r in worker.load()) >= n)
        try:
            yield
        finally:
            await streams.aclose()
            await wait_for(lambda: engine_idle(worker))


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


@contextlib.asynccontextmanager
async def routed_workers(nats_url: str, model: str, n: int = 1, *, workers: Mapping[str, Any] | None = None,
                         **settings: Any) -> AsyncIterator[tuple[InProcessRouter, list[MockWorker]]]:
    """``n`` mock workers (``workers``: :func:`mock_workers`' keywords) and a router
    (``settings`` over :func:`router_settings`) that sees all of them; the router stopped, then
    the workers, at the end."""
    async with mock_workers(nats_url, model, n, **(workers or {})) as workers_:
        router = await InProcessRouter(router_settings(nats_url, model, **settings)).start()
        try:
            await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == n)
            yield router, workers_
        finally:
            await router.stop()


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
