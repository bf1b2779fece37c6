"""The Python floor: the least an HTTP/1.1 reverse proxy written in Python can do per request, as a
target of ``bench/proxy_overhead.py --floor`` (issue 16).

No routing, no ASGI, no task per request, no metrics: uvloop, httptools on both sides (the parser
the router's server and its client to workers use), one upstream, keep-alive connections to it
pooled, each request's body forwarded with its content type and length, the answer's head written
with its first body bytes, its chunks re-framed and written once per read from the worker (what
Rudder's relay does, decision 105). Everything a real router adds (parsing the JSON, the prompt's
hashes, a selection, bookings, calibration, metrics, errors, limits, tracing) is missing here, so a
router cannot cost less than this in Python on the same machine; the gap between the two is what
the router's own work costs, and the gap between this and a Rust router is the language's.

    python bench/python_floor.py --port 8100 --upstream http://127.0.0.1:8001
    python bench/python_floor.py --asgi ...   # the same forwarder as a bare ASGI app under uvicorn

``--asgi`` serves the same forwarding as an ASGI app under uvicorn (httptools, uvloop: the server
Rudder's router runs in), each answer's chunks sent through ASGI ``send`` from the request's task:
the gap between the two floors is what the ASGI server and a task per request cost.

Not a product: no error handling past closing the client's connection, no timeouts, no limits.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import httptools
import uvloop


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the worker; relays one answer at a time to its client."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: Downstream | None = None
        self.head = b""
        self.out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not asyncio's class

    def send(self, client: Downstream, request: bytes) -> None:
        self.client = client
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        if self.out and self.client is not None:
            self.client.write(b"".join(self.out))
        self.out.clear()
        if self.client is not None and self.client.done:
            self.client.done = False
            self.client = None
            self.pool.idle.append(self)

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.head = (b"HTTP/1.1 %d OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n" % status)

    def on_body(self, body: bytes) -> None:
        framed = b"%x\r\n%b\r\n" % (len(body), body)
        if self.head:
            self.out.append(self.head)
            self.head = b""
        self.out.append(framed)

    def on_message_complete(self) -> None:
        if self.head:
            self.out.append(self.head)
            self.head = b""
        self.out.append(b"0\r\n\r\n")
        if self.client is not None:
            self.client.done = True

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        if self.client is not None:
            self.client.close()


class Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: deque[Upstream] = deque()
        self.protocol: type[Upstream] = Upstream

    def send(self, client: Downstream, request: bytes) -> None:
        if self.idle:
            self.idle.pop().send(client, request)
            return
        asyncio.get_running_loop().create_task(self._connect(client, request))

    async def _connect(self, client: Downstream, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: self.protocol(self), self.host, self.port)
        conn.send(client, request)


class Downstream(asyncio.Protocol):
    """One client connection: a request parsed, forwarded, its answer written back."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.ctype = b"application/json"
        self.body: list[bytes] = []
        self.done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def on_url(self, url: bytes) -> None:
        self.url = url
        self.body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        method = self.parser.get_method()
        request = (b"%b %b HTTP/1.1\r\nhost: %b:%d\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
                   % (method, self.url, self.pool.host.encode(), self.pool.port, self.ctype, len(body), body))
        self.pool.send(self, request)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Waiting:
    """Stands in for a client connection under ASGI: what the upstream relays is collected and the
    request's task woken to send it."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.done = False
        self.complete = False
        self.waiter: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        self.chunks.append(data)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def close(self) -> None:
        self.complete = True
        self.write(b"")


class AsgiUpstream(Upstream):
    """Hands the ASGI side the body alone (its server frames the chunks)."""

    def on_headers_complete(self) -> None:
        self.head = b""

    def on_body(self, body: bytes) -> None:
        self.out.append(body)

    def on_message_complete(self) -> None:
        self.out.append(b"")  # wakes the request's task even when no body came in this read
        if self.client is not None:
            self.client.done = True
            self.client.complete = True  # type: ignore[attr-defined]


def asgi_app(pool: Pool) -> Any:
    loop_pool = pool

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"application/json")
        path = scope["raw_path"] or scope["path"].encode()
        request = (b"%b %b HTTP/1.1\r\nhost: %b:%d\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
                   % (scope["method"].encode(), path, loop_pool.host.encode(), loop_pool.port, ctype,
                      len(body), body))
        sink = Waiting()
        loop_pool.send(sink, request)  # type: ignore[arg-type]
        started = False
        while True:
            if not sink.chunks and not sink.complete:
                sink.waiter = asyncio.get_running_loop().create_future()
                await sink.waiter
            data = b"".join(sink.chunks)
            sink.chunks.clear()
            if not started:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
                started = True
            if sink.complete and not sink.chunks:
                await send({"type": "http.response.body", "body": data, "more_body": False})
                return
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})

    return app


async def serve(port: int, upstream: str) -> None:
    url = urlsplit(upstream)
    pool = Pool(url.hostname or "127.0.0.1", url.port or 80)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(pool), "127.0.0.1", port, backlog=2048)
    print(f"python floor on 127.0.0.1:{port} -> {upstream}", flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # a clean exit (bench/count_calls.py writes its counts)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--asgi", action="store_true", help="a bare ASGI app under uvicorn instead")
    args = p.parse_args()
    if not args.asgi:
        uvloop.run(serve(args.port, args.upstream))
        return
    import uvicorn

    url = urlsplit(args.upstream)
    pool = Pool(url.hostname or "127.0.0.1", url.port or 80)
    pool.protocol = AsgiUpstream
    uvicorn.run(asgi_app(pool), host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
