"""The router's upstream HTTP client against real sockets (small asyncio servers on loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from cli.embedded import free_port
from router.app import RouterRuntime
from router.requestwork import forward_headers
from router.upstream import UpstreamBroken, UpstreamClient, UpstreamUnreachable
from tests.support_router.workers import router_settings

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    line = (await reader.readline()).decode()
    headers: dict[str, str] = {}
    while (h := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = h.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return line, headers, body


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def write_chunked(writer: asyncio.StreamWriter, parts: list[bytes], headers: bytes = b"") -> None:
    """A 200 answer in chunked encoding, a write (and a drain) per part."""
    writer.write(b"HTTP/1.1 200 OK\r\n" + headers + b"Transfer-Encoding: chunked\r\n\r\n")
    for part in parts:
        writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


def client() -> UpstreamClient:
    return UpstreamClient(connect_timeout_s=1, read_timeout_s=2)


async def test_chunked_stream_and_keep_alive_reuse() -> None:
    connections = 0
    seen: list[tuple[str, dict[str, str], bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while not reader.at_eof():
            try:
                seen.append(await read_request(reader))
            except asyncio.IncompleteReadError:
                break
            if not seen[-1][0]:
                break
            await write_chunked(writer, [b"data: a\n\n", b"data: bc\n\n"], b"Content-Type: text/event-stream\r\n")

    server, url = await serve(handler)
    c = client()
    try:
        for _ in range(3):
            resp = await c.open(url, "/v1/completions", b'{"x":1}', {"x-dp-rank": "0"})
            assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
            # chunks already received are forwarded together; the body is exactly the events
            assert b"".join([chunk async for chunk in resp.aiter_raw()]) == b"data: a\n\ndata: bc\n\n"
        assert connections == 1  # one keep-alive connection served all three
        line, headers, body = seen[0]
        assert line.startswith("POST /v1/completions HTTP/1.1")
        assert headers["x-dp-rank"] == "0" and headers["content-length"] == "7" and body == b'{"x":1}'
    finally:
        await c.aclose()
        server.close()


async def test_content_length_and_close_framing() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line, _, _ = await read_request(reader)
        if "/fixed" in line:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nnope!")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            await writer.drain()
            writer.close()

    server, url = await serve(handler)
    c = client()
    try:
        resp = await c.open(url, "/fixed", b"", {})
        assert (resp.status_code, await resp.aread()) == (404, b"nope!")
        resp = await c.open(url, "/close", b"", {})
        assert await resp.aread() == b"until the end"
    finally:
        await c.aclose()
        server.close()


async def test_an_idle_connection_closed_by_the_worker_is_retried_once_fresh() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # the worker drops the keep-alive connection after one answer

    server, url = await serve(handler)
    c = client()
    try:
        for _ in range(3):
            resp = await c.open(url, "/", b"", {})
            assert await resp.aread() == b"ok"
    finally:
        await c.aclose()
        server.close()


async def test_refused_is_unreachable_and_a_broken_stream_is_broken() -> None:
    c = client()
    with pytest.raises(UpstreamUnreachable):
        await c.open(f"http://127.0.0.1:{free_port()}", "/", b"", {})

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
        await writer.drain()
        writer.close()

    server, url = await serve(handler)
    try:
        resp = await c.open(url, "/", b"", {})
        with pytest.raises(UpstreamBroken):
            await resp.aread()
    finally:
        await c.aclose()
        server.close()


async def test_silence_before_the_status_line_is_unreachable() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()  # accepted, then closed without a byte of response

    server, url = await serve(handler)
    c = client()
    try:
        with pytest.raises(UpstreamUnreachable):
            await c.open(url, "/", b"{}", {})
    finally:
        await c.aclose()
        server.close()


async def test_slow_chunks_stream_one_by_one_and_trailers_are_consumed() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (b"data: 1\n\n", b"data: 2\n\n"):
                writer.write(f"{len(part):x};ext=1\r\n".encode() + part + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # a token every 50 ms
            writer.write(b"0\r\nX-Trailer: t\r\n\r\n")
            await writer.drain()

    server, url = await serve(handler)
    c = client()
    try:
        for _ in range(2):  # the trailer is consumed: the connection is reusable
            resp = await c.open(url, "/", b"", {})
            assert [chunk async for chunk in resp.aiter_raw()] == [b"data: 1\n\n", b"data: 2\n\n"]
    finally:
        await c.aclose()
        server.close()


async def test_a_worker_silent_after_the_request_is_unreachable_after_the_read_timeout() -> None:
    """A worker that takes the request and never answers: unreachable (the router retries
    elsewhere) once the read timeout passes, and the connection is not pooled."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    server, url = await serve(handler)
    c = UpstreamClient(connect_timeout_s=1, read_timeout_s=0.3)
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamUnreachable, match="TimeoutError"):
            await c.open(url, "/", b"{}", {})
        assert 0.25 <= asyncio.get_running_loop().time() - t0 < 2.0
        assert all(not pool.idle for pool in c._pools.values())
    finally:
        await c.aclose()
        server.close()


async def test_a_relay_slower_than_the_worker_pauses_reading_and_loses_nothing() -> None:
    """Past what the client holds for a relay that does not take it, it stops reading the worker
    (TCP pushes back on the worker) and reads again as the relay catches up."""
    part = bytes(range(256)) * 256  # 64 KiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await write_chunked(writer, [part] * 32)  # 2 MiB

    server, url = await serve(handler)
    c = client()
    try:
        resp = await c.open(url, "/", b"", {})
        conn = resp._conn
        assert conn is not None and conn.transport is not None
        got, paused = bytearray(), False
        async for chunk in resp.aiter_raw():
            got += chunk
            await asyncio.sleep(0.02)  # a slow client behind the relay
            paused = paused or not conn.transport.is_reading()
        assert bytes(got) == part * 32
        assert paused
    finally:
        await c.aclose()
        server.close()


async def test_an_informational_answer_before_the_answer_is_skipped() -> None:
    """A worker that sends 100 Continue first (as uvicorn does for a request that asks for it):
    the client returns the answer that follows, and the router never asks (``expect`` is not
    forwarded)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    server, url = await serve(handler)
    c = client()
    try:
        for _ in range(2):  # and the connection is reusable after it
            resp = await c.open(url, "/", b"", {})
            assert (resp.status_code, await resp.aread()) == (201, b"ok")
    finally:
        await c.aclose()
        server.close()
    assert "expect" not in forward_headers({"Expect": "100-continue", "X-Request-Id": "r"})
    assert forward_headers({"Expect": "100-continue", "X-Request-Id": "r"}) == {"X-Request-Id": "r"}


async def test_bytes_on_an_idle_connection_are_not_the_next_answer() -> None:
    """A worker that writes on a pooled connection between requests (a forged answer waiting for
    the next request): the connection is dropped, the next request goes on a fresh one."""
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        mine = connections
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nreal")
        if mine == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged")
        await writer.drain()
        await reader.read()

    server, url = await serve(handler)
    c = client()
    try:
        resp = await c.open(url, "/", b"", {})
        assert await resp.aread() == b"real"
        await asyncio.sleep(0.1)  # the forged answer arrives while the connection is pooled
        resp = await c.open(url, "/", b"", {})
        assert await resp.aread() == b"real"
        assert connections == 2
    finally:
        await c.aclose()
        server.close()


async def test_a_sink_takes_the_body_as_it_arrives_and_the_reader_gets_the_end() -> None:
    """While the reader waits, what the worker sends goes to the sink from the connection's
    callback (the reader is not woken for it); the chunk that ends the answer, and what the sink
    refuses, are handed out by the reader, in order. The connection stays reusable."""
    parts = [b"data: %d\n\n" % i for i in range(6)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in parts:
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.02)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    server, url = await serve(handler)
    c = client()
    try:
        resp = await c.open(url, "/", b"", {})
        got: list[tuple[str, bytes]] = []  # in the order the body went out, and by which way
        resp.sink = lambda data: got.append(("pushed", data)) is None
        async for chunk in resp.aiter_raw():
            got.append(("handed", chunk))
        assert b"".join(data for _, data in got) == b"".join(parts)
        ways = [way for way, _ in got]
        # handed out: what arrived before the reader first waited, and the end if it came with
        # a chunk (here the worker writes its end alone); pushed: the rest
        assert ways.count("pushed") >= 3 and ways.count("handed") <= 2
        # A sink that refuses (a client that takes no bytes now): the reader hands it out.
        resp = await c.open(url, "/", b"", {})
        offered: list[bytes] = []
        resp.sink = lambda data: offered.append(data) is not None  # always False
        handed = [chunk async for chunk in resp.aiter_raw()]
        assert b"".join(handed) == b"".join(parts) and offered
        assert len(c._pools[next(iter(c._pools))].idle) == 1  # reusable after both
    finally:
        await c.aclose()
        server.close()


async def test_a_stream_that_keeps_coming_into_a_sink_outlives_the_read_timeout() -> None:
    """The body's read timeout counts the wait since the last chunk the sink took, not since the
    reader started waiting: a stream longer than the timeout survives, a stall after it does not."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line, _, _ = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(10):  # 0.5 s of chunks, a chunk every 50 ms, against a 0.25 s timeout
            writer.write(b"4\r\ntick\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        if "stall" in line:
            await asyncio.sleep(5)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    server, url = await serve(handler)
    c = UpstreamClient(connect_timeout_s=1, read_timeout_s=0.25)
    try:
        resp = await c.open(url, "/", b"", {})
        got: list[bytes] = []
        resp.sink = lambda data: got.append(data) is None
        async for chunk in resp.aiter_raw():
            got.append(chunk)
        assert b"".join(got) == b"tick" * 10
        resp = await c.open(url, "/stall", b"", {})
        resp.sink = lambda data: True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(UpstreamBroken, match="TimeoutError"):
            await resp.aread()
        assert 0.5 <= loop.time() - t0 < 2.0
    finally:
        await c.aclose()
        server.close()


async def test_concurrency_above_the_idle_bound_churns_connections_and_the_router_sets_it_to_its_own() -> None:
    """Requests in flight to one worker past the idle pool's bound each close their connection
    when they end, and the next ones connect anew: at a steady concurrency above the bound the
    router would open connections at its request rate (each closed one a TIME_WAIT port: ports
    run out at a few hundred a second per worker; found by a load test at c=1000, with a p99
    TTFT of 5 s). The router's client keeps as many idle as it can have requests in flight."""
    connections = waiting = 0
    release, all_in = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, waiting
        connections += 1
        try:
            while True:
                await read_request(reader)
                waiting += 1
                if waiting == 12:
                    all_in.set()
                await release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def wave(c: UpstreamClient, url: str, n: int) -> None:
        nonlocal waiting
        release.clear()
        all_in.clear()
        waiting = 0

        async def one() -> None:
            resp = await c.open(url, "/", b"", {})
            assert await resp.aread() == b"ok"

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.wait_for(all_in.wait(), 5)  # all n in flight at once
        release.set()
        await asyncio.gather(*tasks)

    server, url = await serve(handler)
    try:
        bounded = UpstreamClient(connect_timeout_s=2, read_timeout_s=5, max_idle_per_host=8)
        for _ in range(2):
            await wave(bounded, url, 12)
        assert connections == 12 + 4  # the second wave opened anew what the first closed
        await bounded.aclose()
        connections = 0
        settings = router_settings("nats://127.0.0.1:1", "m", max_connections=12)
        sized = RouterRuntime(settings).http
        assert sized.max_idle == settings.max_connections
        for _ in range(2):
            await wave(sized, url, 12)
        assert connections == 12  # one connection per request in flight, reused
        await sized.aclose()
    finally:
        server.close()


def test_the_client_on_uvloop_as_deployed() -> None:
    """A router process runs on uvloop (cli/serve.py), whose transports are not asyncio's classes:
    the same exchanges there."""
    uvloop = pytest.importorskip("uvloop")

    async def exchanges() -> None:
        await test_chunked_stream_and_keep_alive_reuse()
        await test_content_length_and_close_framing()
        await test_refused_is_unreachable_and_a_broken_stream_is_broken()
        await test_a_worker_silent_after_the_request_is_unreachable_after_the_read_timeout()
        await test_a_sink_takes_the_body_as_it_arrives_and_the_reader_gets_the_end()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(exchanges())


async def test_an_answer_read_whole_stops_at_its_limit_and_closes_the_connection() -> None:
    """A worker whose answer never ends (a bug, or a worker that means harm) must not take the
    router's memory: past the limit the read fails and the connection is closed (the worker sees
    its writes fail); an answer of exactly the limit is read whole."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line, _, _ = await read_request(reader)
        if "/exact" in line:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1024\r\nConnection: close\r\n\r\n" + b"x" * 1024)
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        part = b"y" * 65536
        try:
            while True:  # without end
                writer.write(b"%x\r\n%b\r\n" % (len(part), part))
                await writer.drain()
        except (ConnectionError, OSError):
            closed.set()

    server, url = await serve(handler)
    c = client()
    try:
        resp = await c.open(url, "/exact", b"", {})
        assert await resp.aread(1024) == b"x" * 1024
        resp = await c.open(url, "/endless", b"", {})
        with pytest.raises(UpstreamBroken, match="exceeds 1048576 bytes"):
            await resp.aread(1024 * 1024)
        await asyncio.wait_for(closed.wait(), 10)
    finally:
        await c.aclose()
        server.close()
