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
import itertools
import re
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # --work imports Rudder's modules

HEAD = b"HTTP/1.1 %d OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Client(Protocol):
    """Where an answer goes: a client connection, or (under ASGI) the request's task."""

    def write(self, data: bytes) -> None: ...

    def end(self) -> None: ...  # the answer is complete (written before)

    def close(self) -> None: ...  # the worker connection broke


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the worker; relays one answer at a time to its client, the
    head with the first body bytes, each read's chunks re-framed and written at once."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: Client | None = None
        self.head = b""
        self.out: list[bytes] = []
        self.ended = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not asyncio's class

    def send(self, client: Client, request: bytes) -> None:
        self.client = client
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        client = self.client
        if client is None:
            return
        if self.out:
            client.write(b"".join(self.out))
            self.out.clear()
        if self.ended:
            self.ended = False
            self.client = None
            self.pool.idle.append(self)
            client.end()

    def on_headers_complete(self) -> None:
        self.head = HEAD % self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:  # inline, as the rest: the floor counts its calls
        if self.head:
            self.out.append(self.head)
            self.head = b""
        self.out.append(b"%x\r\n%b\r\n" % (len(body), body))

    def on_message_complete(self) -> None:
        if self.head:
            self.out.append(self.head)
            self.head = b""
        self.out.append(b"0\r\n\r\n")
        self.ended = True

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        if self.client is not None:
            self.client.close()


class BodyOnly(Upstream):
    """Hands the ASGI side the body alone: its server writes the head and frames the chunks."""

    def on_headers_complete(self) -> None:
        pass

    def on_body(self, body: bytes) -> None:
        self.out.append(body)

    def on_message_complete(self) -> None:
        self.ended = True


class Pool:
    """Keep-alive connections to the one upstream (``protocol`` each)."""

    def __init__(self, upstream: str, protocol: type[Upstream] = Upstream) -> None:
        url = urlsplit(upstream)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.protocol = protocol
        self.idle: deque[Upstream] = deque()

    def request(self, method: bytes, path: bytes, ctype: bytes, body: bytes) -> bytes:
        return (b"%b %b HTTP/1.1\r\nhost: %b:%d\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
                % (method, path, self.host.encode(), self.port, ctype, len(body), body))

    def send(self, client: Client, request: bytes) -> None:
        if self.idle:
            self.idle.pop().send(client, request)
            return
        asyncio.get_running_loop().create_task(self._connect(client, request))

    async def _connect(self, client: Client, request: bytes) -> None:
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
        self.pool.send(self, self.pool.request(self.parser.get_method(), self.url, self.ctype, body))

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def end(self) -> None:
        pass

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Waiting:
    """Stands in for a client connection under ASGI: what the upstream relays is collected and the
    request's task woken to send it."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.complete = False
        self.waiter: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        self.chunks.append(data)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def end(self) -> None:
        self.complete = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    close = end


def asgi_app(pool: Pool) -> Any:
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
        sink = Waiting()
        pool.send(sink, pool.request(scope["method"].encode(), scope["raw_path"] or scope["path"].encode(),
                                     ctype, body))
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
            if sink.complete:
                await send({"type": "http.response.body", "body": data, "more_body": False})
                return
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})

    return app


class Working(Downstream):
    """``--work``: the raw floor doing a router's own pure work per request, with Rudder's modules
    (docs/decisions.md 127): the body parsed, the prompt tokenized and hashed, a selection by a real
    scheduler actor (``kv``, one worker, its fits in the background), the body sent with the
    target appended, the first token found in the stream, the first-token and end commands with the
    reported cached tokens. No metrics, logs, limits, errors or tracing. What a router handled from
    its connections' callbacks (no task, no ASGI, no coroutines) could cost; against Rudder, in the
    same run, what its request path's structure costs above the work it must do."""

    scheduler: Any = None  # set by serve
    first: Any = None  # the request's first-token detector, until its first token
    booking: Any = None
    sent_at = 0.0
    tail = b""

    def on_message_complete(self) -> None:
        from controlplane.protocol import tokenizer
        from controlplane.protocol.hashing import chain_hashes
        from router.commands import RoutingRequest
        from router.sse import FirstTokenDetector, json_bytes

        if self.parser.get_method() != b"POST":  # a readiness probe: forwarded as the floor does
            self.booking = None
            super().on_message_complete()
            return
        raw = b"".join(self.body)
        body = json_bytes(raw)
        tokens = tokenizer.encode(body["prompt"])
        sched = self.scheduler
        self.booking = sched.select_now(RoutingRequest(
            request_id=f"r{id(self)}-{len(tokens)}-{next(_SEQ)}", model=body["model"], prompt_tokens=len(tokens),
            hashes={BLOCK: chain_hashes(tokens, BLOCK)}))
        self.first = FirstTokenDetector()
        self.sent_at = time.perf_counter()
        self.tail = b""
        sel = self.booking
        out = b'%s,"nvext":{"backend_instance_id":%d,"dp_rank":%d}}' % (raw.strip()[:-1], sel.instance_id,
                                                                       sel.dp_rank)
        self.pool.send(self, self.pool.request(self.parser.get_method(), self.url, self.ctype, out))

    def write(self, data: bytes) -> None:
        from router.commands import RequestFirstToken

        if self.booking is not None and self.first is not None and self.first.feed(data):
            self.first = None
            self.scheduler.send(RequestFirstToken(self.booking.booking_id,
                                                  ttft_ms=(time.perf_counter() - self.sent_at) * 1e3))
        self.tail = data
        super().write(data)

    def end(self) -> None:
        from router.commands import RequestDone

        if self.booking is None:
            return
        found = _CACHED.search(self.tail)
        self.scheduler.send(RequestDone(self.booking.booking_id, instance_id=self.booking.instance_id,
                                        predicted_cached=self.booking.cached_tokens,
                                        reported_cached=int(found.group(1)) if found else None))


BLOCK = 64  # the mock engine's default block size
_SEQ = itertools.count()
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def working_scheduler(upstream: str, model: str) -> Any:
    """A ``kv`` scheduler actor with the upstream as its one worker (no bus: joined directly)."""
    import random
    from datetime import UTC, datetime

    from controlplane.protocol.events import MembershipEvent, MembershipOp, RankLoad, RouterRole, WorkerRecord
    from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
    from controlplane.protocol.signing import Keyring
    from router.commands import ApplyMembership, LoadKvDump
    from router.scheduler import Scheduler
    from router.settings import RoutingMode

    now = datetime.now(UTC)
    s = Scheduler(router_id="floor", models=[model], role=RouterRole.AGGREGATED, mode=RoutingMode.KV,
                  kv_events=True, cache_inputs=ALL_CACHE_INPUTS, startup={k: startup_values(k) for k in PolicyKind},
                  worker_ttl_s=1e9, worker_stale_s=1e9, rng=random.Random(1), keyring=Keyring({}),
                  background_fits=True)
    rec = WorkerRecord(instance_id=1, model=model, url=upstream, block_size=BLOCK, kv_total_blocks=16384,
                       max_num_batched_tokens=8192, started_at=now)
    s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=rec, load=[RankLoad()], at=now)))
    s._dispatch(LoadKvDump(1, None, final=True))
    s.start()
    return s


async def serve(port: int, upstream: str, work_model: str | None = None) -> None:
    pool = Pool(upstream)
    loop = asyncio.get_running_loop()
    if work_model is not None:
        Working.scheduler = working_scheduler(upstream, work_model)
        server = await loop.create_server(lambda: Working(pool), "127.0.0.1", port, backlog=2048)
    else:
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
    p.add_argument("--work", default="", metavar="MODEL",
                   help="the raw floor with a router's own work per request (class Working), for MODEL")
    args = p.parse_args()
    if not args.asgi:
        uvloop.run(serve(args.port, args.upstream, args.work or None))
        return
    import uvicorn

    uvicorn.run(asgi_app(Pool(args.upstream, BodyOnly)), host="127.0.0.1", port=args.port, loop="uvloop",
                http="httptools", log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
