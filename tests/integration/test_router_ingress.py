"""The router's ingress limits (docs/router.md, "Ingress limits") over real NATS, with the
project's mock engine as the worker: body limit while reading (the router's memory measured in its
own process), slow clients (slowloris), a full scheduler queue, a client that stops reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest

from router.commands import Inspect
from router.ingress import PROBE_RESERVE
from tests import buskit
from tests.support_router.workers import (
    InProcessRouter,
    free_port,
    mock_answer,
    router_settings,
    spawn_router,
    sse_events,
    wait_for,
    wait_http_ok,
)

pytestmark = pytest.mark.timeout(120)
MODEL = "mock/ingress:1b"
HEADER_TIMEOUT_S = 4.0
BODY_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 1.0
MAX_QUEUED = 8

worker_agent = pytest.importorskip("worker.agent")
worker_settings = pytest.importorskip("worker.settings")


@pytest.fixture(scope="module")
async def fleet(nats_url: str) -> AsyncIterator[InProcessRouter]:
    """One mock worker and a router with short ingress timeouts and a small selection queue."""
    stop = asyncio.Event()
    ready: list[Any] = []
    settings = buskit.worker_settings(
        nats_url=nats_url, model=MODEL, heartbeat_s=0.2,
        mock=worker_settings.MockEngineSettings(speedup_ratio=200.0, block_size=16),
    )
    task = asyncio.create_task(worker_agent.serve(settings, stop=stop, on_ready=ready.append))
    await wait_for(lambda: ready or task.done(), within=20)
    if task.done():
        task.result()
    router = await InProcessRouter(router_settings(
        nats_url, MODEL, header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S,
        write_timeout_s=WRITE_TIMEOUT_S, max_queued_selections=MAX_QUEUED,
    )).start()
    await wait_for(lambda: router.runtime.scheduler.view.workers.get(MODEL) == 1, within=10)
    yield router
    await router.stop()
    stop.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 10)


def _connections(router: InProcessRouter) -> int:
    assert router._server is not None
    return len(router._server.server_state.connections)


def _request(body: dict[str, Any], *, close: bool = True) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + data


async def _read_to_eof(sock: socket.socket, *, within: float) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    async with asyncio.timeout(within):
        while True:
            try:
                data = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                break
            if not data:
                break
            out += data
    return bytes(out)


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def _json_body(raw: bytes) -> Any:
    return json.loads(raw.partition(b"\r\n\r\n")[2])


async def _chat(router: InProcessRouter) -> str:
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=10)
    try:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    finally:
        await client.close()
    assert reply.choices[0].message.content is not None
    return reply.choices[0].message.content


async def test_300_connections_that_never_finish_their_request_do_not_stop_a_chat(
    fleet: InProcessRouter,
) -> None:
    router = fleet
    before = _connections(router)
    slow_heads: list[socket.socket] = []
    slow_bodies: list[socket.socket] = []
    try:
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", router.settings.port))
            if i % 2:  # headers never finished
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nX-Slow: 1")
                slow_heads.append(sock)
            else:  # headers complete, the body never finished
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
                slow_bodies.append(sock)
            sock.setblocking(False)
        await wait_for(lambda: _connections(router) >= before + 300, within=10)
        assert (await _chat(router)).strip() != ""
        # Served while every slow connection was still held open.
        assert _connections(router) >= before + 300
        # And the slow ones do not stay: 408 and closed, heads after the header timeout, bodies
        # after the body timeout.
        heads = await asyncio.gather(*(_read_to_eof(s, within=HEADER_TIMEOUT_S + 10) for s in slow_heads))
        bodies = await asyncio.gather(*(_read_to_eof(s, within=BODY_TIMEOUT_S + 10) for s in slow_bodies))
        assert {_status(r) for r in heads} == {408}
        assert {_status(r) for r in bodies} == {408}
        assert _json_body(bodies[0])["error"]["code"] == "request_timeout"
        await wait_for(lambda: _connections(router) <= before, within=10)
        assert await _chat(router)
    finally:
        for sock in slow_heads + slow_bodies:
            sock.close()


async def test_oversized_request_head_is_refused_with_431(fleet: InProcessRouter) -> None:
    router = fleet
    sock = socket.create_connection(("127.0.0.1", router.settings.port))
    try:
        sock.sendall(b"GET /live HTTP/1.1\r\nHost: router\r\n")
        filler = b"X-Filler: " + b"a" * 1000 + b"\r\n"
        sent = 0
        with contextlib.suppress(OSError):
            while sent < 2 * router.settings.max_header_bytes:
                sock.sendall(filler)
                sent += len(filler)
        sock.setblocking(False)
        raw = await _read_to_eof(sock, within=10)
    finally:
        sock.close()
    assert _status(raw) == 431, raw[:200]


def _answers(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each answer on a connection read to its end (bodies framed by
    Content-Length: the router's non-streamed answers and probes)."""
    out: list[tuple[int, bytes]] = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        out.append((_status(head), rest[:length]))
        raw = rest[length:]
    return out


async def test_an_h2c_upgrade_offer_is_ignored_and_the_request_served_with_its_body(
    fleet: InProcessRouter,
) -> None:
    """Java's and Ktor's HTTP clients offer ``Upgrade: h2c`` on ordinary POSTs. httptools ends such
    a message at its head, and uvicorn served it with an empty body ("body is not valid JSON"),
    or refused the body's bytes as a bad request when they came in a later read (uvicorn #2722).
    The offer is ignored (RFC 9110 §7.8): the body is read, framed by Content-Length or chunked,
    in the same read as the head or later, and a request pipelined after it is served too."""
    router = fleet
    port = router.settings.port
    data = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "over h2c"}],
                       "max_tokens": 3}).encode()
    offer = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n" + offer
    framings = {
        "content-length": (b"Content-Length: %d\r\n\r\n" % len(data), data),
        "chunked": (b"Transfer-Encoding: chunked\r\n\r\n",
                    b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (10, data[:10], len(data) - 10, data[10:])),
    }
    then = b"GET /live HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n"
    assert router._server is not None
    connections = router._server.server_state.connections

    def waiting_for_its_body() -> bool:
        return any(p.cycle is not None and p.cycle.more_body and p.url == b"/v1/chat/completions"
                   for p in connections)

    for (name, (framing, body)), split in [(f, split) for f in framings.items() for split in (False, True)]:
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            if split:  # the head first; the body once the router holds the request's head
                sock.sendall(start + framing)
                await wait_for(waiting_for_its_body, within=5)
                sock.sendall(body + then)
            else:
                sock.sendall(start + framing + body + then)
            sock.setblocking(False)
            raw = await _read_to_eof(sock, within=20)
        finally:
            sock.close()
        answers = _answers(raw)
        assert [status for status, _ in answers] == [200, 200], (name, split, raw[:400])
        assert json.loads(answers[0][1])["choices"][0]["message"]["content"], (name, split)
        assert json.loads(answers[1][1]) == {"status": "ok"}, (name, split)


async def _get(port: int, path: str) -> bytes:
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n".encode())
        sock.setblocking(False)
        return await _read_to_eof(sock, within=10)
    finally:
        sock.close()


async def test_connections_past_the_cap_serve_probes_only_and_past_the_reserve_none(
        nats_url: str, fleet: InProcessRouter) -> None:
    """Past ``max_connections`` a connection may ask for /health, /live and /metrics only (a
    kubelet must still get its answers while clients hold every connection: else the router is
    restarted and taken out of its Service, decision 109); an inference request on it is
    answered 503 and the connection closed; past the reserve a connection is answered 503 and
    closed at once."""
    capped = await InProcessRouter(router_settings(nats_url, MODEL, max_connections=4)).start()
    await wait_for(lambda: capped.runtime.scheduler.view.workers.get(MODEL) == 1, within=10)
    port = capped.settings.port
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    reserve: list[socket.socket] = []
    try:
        await wait_for(lambda: _connections(capped) == 4, within=10)
        for path in ("/live", "/health", "/metrics"):
            raw = await _get(port, path)
            assert _status(raw) == 200, (path, raw[:200])
        assert b"rudder_router_rejections_total" in raw
        extra = socket.create_connection(("127.0.0.1", port))
        extra.sendall(_request({"model": MODEL, "messages": [{"role": "user", "content": "past the cap"}],
                                "max_tokens": 2}, close=False))
        extra.setblocking(False)
        raw = await _read_to_eof(extra, within=10)  # closed after the answer, though keep-alive was asked
        extra.close()
        assert _status(raw) == 503 and _json_body(raw)["error"]["type"] == "service_unavailable"
        assert b"holds its limit of 4 connections" in raw
        # The reserve full too: answered 503 and closed before any request.
        reserve = [socket.create_connection(("127.0.0.1", port)) for _ in range(PROBE_RESERVE)]
        await wait_for(lambda: _connections(capped) == 4 + PROBE_RESERVE, within=10)
        past = socket.create_connection(("127.0.0.1", port))
        past.setblocking(False)
        raw = await _read_to_eof(past, within=10)
        past.close()
        assert _status(raw) == 503 and _json_body(raw)["error"]["type"] == "service_unavailable"
        for sock in held + reserve:
            sock.close()
        await wait_for(lambda: _connections(capped) == 0, within=10)
        # Below the cap again: served.
        assert await _chat(capped)
    finally:
        for sock in held + reserve:
            sock.close()
        await capped.stop()


async def test_full_scheduler_queue_answers_the_overload_status(fleet: InProcessRouter) -> None:
    router = fleet
    n = MAX_QUEUED * 5
    socks = [socket.create_connection(("127.0.0.1", router.settings.port)) for _ in range(n)]
    try:
        before = _connections(router)
        await wait_for(lambda: _connections(router) >= n, within=10)
        assert before >= 0
        request = _request({"model": MODEL, "messages": [{"role": "user", "content": "burst"}],
                            "max_tokens": 2})
        # An idle actor's selections are made at once by their requests (Scheduler.select_now):
        # only a busy actor's wait in its queue. Here it stays busy (a command that queues itself
        # again) until the bound has refused one, so every request of the burst, in the router's
        # socket buffers before its event loop runs again, queues behind the actor's work.
        sched = router.runtime.scheduler
        refused_so_far = router.runtime.metrics.rejections.labels("queue_full")
        until = time.monotonic() + 20

        def busy(s: Any) -> None:
            if refused_so_far._value.get() == 0 and time.monotonic() < until:
                s.submit(Inspect(busy))

        sched.submit(Inspect(busy))
        for sock in socks:
            sock.sendall(request)
        for sock in socks:
            sock.setblocking(False)
        answers = await asyncio.gather(*(_read_to_eof(s, within=30) for s in socks))
    finally:
        for sock in socks:
            sock.close()
    statuses = [_status(a) for a in answers]
    refused = [a for a in answers if _status(a) == router.settings.overload_status]
    assert set(statuses) <= {200, router.settings.overload_status}, statuses
    assert statuses.count(200) >= MAX_QUEUED
    assert refused, "no request was refused although the queue was over its bound"
    error = _json_body(refused[0])["error"]
    assert error["code"] == "queue_full" and error["type"] == "overloaded_error"
    assert b"retry-after: 1" in refused[0].lower()
    # The queue's places were all given back.
    assert await sched.inspect(lambda s: s._queued_selections) == 0
    assert await sched.inspect(lambda s: len(s.bookings)) == 0


async def test_client_that_stops_reading_a_stream_is_closed_and_its_booking_freed(
    fleet: InProcessRouter,
) -> None:
    router = fleet
    sched = router.runtime.scheduler
    rejections = router.runtime.metrics.rejections.labels("write_timeout")
    closed_before = rejections._value.get()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads little
    try:
        sock.connect(("127.0.0.1", router.settings.port))
        sock.sendall(_request({"model": MODEL, "messages": [{"role": "user", "content": "talk"}],
                               "max_tokens": 100_000, "stream": True}))
        # The stream runs (booked), and this client never reads a byte of it.
        await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 1), within=10)
        booked = time.monotonic()
        await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=WRITE_TIMEOUT_S + 15)
        freed_after = time.monotonic() - booked
        assert rejections._value.get() == closed_before + 1
        # The router closed the connection: what the client reads now ends (EOF or reset).
        sock.setblocking(False)
        received = await _read_to_eof(sock, within=10)
        assert received.startswith(b"HTTP/1.1 200")
        assert b"data: [DONE]" not in received  # cut off, not finished
    finally:
        sock.close()
    # The client's buffers fill within about a second (measured: freed 2.0 s after booking with a
    # 1 s write timeout); then the write timeout runs.
    assert freed_after < WRITE_TIMEOUT_S + 5, f"booking freed {freed_after:.1f} s after it was made"
    assert await _chat(router)


async def test_a_client_that_pauses_reading_a_stream_gets_all_of_it_in_order(fleet: InProcessRouter) -> None:
    """A client that stops reading for a while (shorter than the write timeout) in a long stream:
    the router stops writing to it (its buffers are full, so the chunks pushed from the worker
    connection's callback are refused and the relay waits for the client), then goes on; the
    client gets every token, in order, and the stream's end."""
    router = fleet
    assert router._server is not None
    connections = router._server.server_state.connections
    rejections = router.runtime.metrics.rejections.labels("write_timeout")
    closed_before = rejections._value.get()
    tokens = 6_000  # ~1.1 MB of events
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    loop = asyncio.get_running_loop()
    try:
        sock.connect(("127.0.0.1", router.settings.port))
        sock.setblocking(False)
        me = sock.getsockname()
        await wait_for(lambda: any(p.client == me for p in connections))
        # The router's side of this connection with a small kernel buffer (else the kernel takes
        # megabytes on loopback before the router sees the client is not reading).
        (protocol,) = [p for p in connections if p.client == me]
        protocol.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        await loop.sock_sendall(sock, _request({
            "model": MODEL, "messages": [{"role": "user", "content": "talk at length"}],
            "max_tokens": tokens, "stream": True}))
        await wait_for(lambda: protocol.flow.write_paused, within=10)  # not reading: it stopped writing
        await asyncio.sleep(0.3)  # the client goes on not reading for a while (well within 1 s)
        held = protocol.transport.get_write_buffer_size()
        received = await _read_to_eof(sock, within=30)
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 200")
    assert rejections._value.get() == closed_before  # paused, never cut off
    # The router held no more than its buffer's mark (64 KiB) and what one read of the worker
    # brings (up to 256 KiB), not the rest of the stream.
    assert held < 512 * 1024
    events = sse_events(received)
    assert events[-1] == b"[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"])
    assert text == mock_answer(tokens)


async def test_a_large_prompt_is_tokenized_and_hashed_off_the_event_loop(
    fleet: InProcessRouter, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 3 MB prompt keeps the router busy for a long while (parse, ~3 M tokens, ~190 k block
    hashes): that work runs in a thread, and the event loop (the router's, which is this test's)
    serves another client while it is under way. The tokenizing is held until that other client
    has its answer, so the test shows it without timing anything: inline, the loop could not serve
    the other client, and the work would run on the loop's thread. A small body is parsed and
    tokenized inline (a thread hop costs more than the work). The requests pin an unknown worker,
    so the router refuses them after that work, without a worker (the small one on the express
    path, router.express). The spies are where plain Python is called: the ASGI path's
    ``parse_body`` (router.api's global) and the byte tokenizer's encoding
    (controlplane.protocol.tokenizer), which the compiled request path calls through its module;
    the express path parses a body in the same callback as it tokenizes it."""
    import controlplane.protocol.tokenizer as byte_tokenizer
    import router.api as api

    router = fleet
    assert router.settings.offload_min_bytes < 3_000_000
    loop_thread = threading.get_ident()
    other_served = threading.Event()
    parsed: list[tuple[int, int]] = []  # (thread, body bytes), on the ASGI path
    tokenized: list[tuple[int, int, bool]] = []  # (thread, prompt characters, the other client served)
    parse, encode_chat = api.parse_body, byte_tokenizer.encode_chat

    def parse_spy(raw: bytes) -> dict[str, Any]:
        parsed.append((threading.get_ident(), len(raw)))
        return parse(raw)

    def encode_spy(messages: Any) -> list[int]:
        size = len(messages[0]["content"])
        served = other_served.wait(30) if threading.get_ident() != loop_thread else False
        tokenized.append((threading.get_ident(), size, served))
        return encode_chat(messages)

    monkeypatch.setattr(api, "parse_body", parse_spy)
    monkeypatch.setattr(byte_tokenizer, "encode_chat", encode_spy)

    def body(chars: int) -> dict[str, Any]:
        return {"model": MODEL, "messages": [{"role": "user", "content": "y" * chars}]}

    pin = {"x-worker-instance-id": "999"}
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        large = asyncio.create_task(http.post("/v1/chat/completions", json=body(3_000_000), headers=pin))
        await wait_for(lambda: parsed or large.done(), within=30)  # its body is in
        small = await http.post("/v1/chat/completions", json=body(100), headers=pin)
        other_served.set()
        r = await large
    assert small.status_code == 400 and r.status_code == 400 and "999" in r.json()["error"]["message"]
    big = [t for t in parsed if t[1] > 3_000_000]
    assert len(big) == 1 and len(parsed) == 1, parsed  # the small one on the express path
    assert big[0][0] != loop_thread, "the 3 MB body was parsed on the event loop's thread"
    by_size = {size: (thread, served) for thread, size, served in tokenized}
    assert set(by_size) == {3_000_000, 100}, tokenized
    assert by_size[3_000_000][0] != loop_thread, "the 3 MB prompt was tokenized on the event loop's thread"
    assert by_size[3_000_000][1], "the loop did not serve another client while the 3 MB prompt was tokenized"
    assert by_size[100][0] == loop_thread


# ---------------------------------------------------------------------------------------------
# The body limit, measured on a router in its own process


def _upload(port: int, total: int, *, chunked: bool) -> tuple[int, bytes, int]:
    """Send a ``total``-byte body (chunked, or with its Content-Length) until the router answers;
    returns (status, answer, bytes of body sent)."""
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                     f"Content-Type: application/json\r\n{framing}\r\n\r\n".encode())
        piece = b"x" * (1 << 20)
        frame = (b"%x\r\n" % len(piece)) + piece + b"\r\n" if chunked else piece
        sock.setblocking(False)
        sent = 0
        pending = memoryview(b"")
        ended = False
        answer = bytearray()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            want_write = not ended or len(pending) > 0
            readable, writable, _ = select.select([sock], [sock] if want_write else [], [], 1.0)
            if readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    break
                if not data:
                    break
                answer += data
                head, sep, body = bytes(answer).partition(b"\r\n\r\n")
                if sep:
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    if len(body) >= length:
                        break
                continue
            if writable:
                if not pending and sent >= total:
                    pending = memoryview(b"0\r\n\r\n" if chunked else b"")
                    ended = True
                elif not pending:
                    pending = memoryview(frame)
                    sent += len(piece)
                try:
                    n = sock.send(pending)
                except (BrokenPipeError, ConnectionResetError):
                    break
                pending = pending[n:]
        return _status(bytes(answer)), bytes(answer), sent
    finally:
        sock.close()


class PeakRss:
    """The largest RSS of a process, sampled every 10 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(0.01)

    def __enter__(self) -> PeakRss:
        self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


@pytest.fixture
def router_process(nats_url: str) -> Iterator[tuple[int, psutil.Process]]:
    """``rudder serve router`` (uvloop, as deployed) with its default limits."""
    port = free_port()
    proc = spawn_router(nats_url, MODEL, port=port, router_id="r-ingress-rss",
                        command=[sys.executable, "-m", "cli.main", "serve", "router"])
    try:
        asyncio.run(wait_http_ok(f"http://127.0.0.1:{port}/live"))
        yield port, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except Exception:
            proc.kill()


def test_100_mb_body_gets_413_while_the_router_grows_less_than_10_mb(
    router_process: tuple[int, psutil.Process],
) -> None:
    port, proc = router_process
    total = 100 * 1024 * 1024
    # Warm up (imports, first allocations), then measure.
    status, _, _ = _upload(port, 8 * 1024 * 1024, chunked=True)
    assert status == 413
    baseline = proc.memory_info().rss
    for chunked in (True, False):
        with PeakRss(proc.pid) as rss:
            status, answer, sent = _upload(port, total, chunked=chunked)
        assert status == 413, answer[:300]
        assert _json_body(answer)["error"]["code"] == "payload_too_large"
        grown = rss.peak - baseline
        print(f"chunked={chunked} sent={sent/2**20:.1f} MiB grown={grown/2**20:.2f} MiB")
        assert grown < 10 * 1024 * 1024, f"router RSS grew by {grown / 2**20:.1f} MiB (chunked={chunked})"
        # The answer came while the body was still being sent.
        assert sent < total
