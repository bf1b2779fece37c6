"""The router's HTTP/1.1 client to its workers: keep-alive connections, each an asyncio protocol
whose responses httptools parses (the C parser uvicorn serves requests with).

Why not httpx: the proxy is one narrow exchange (POST a JSON body to a known worker, stream the
answer back) on the router's hot path, and httpx's general machinery cost about 60% of the router's
CPU per proxied request (bench/proxy_overhead.py). This client does only what the exchange needs:
a pool of idle keep-alive connections per worker address, ``Content-Length`` requests, responses
framed by ``Content-Length``, chunked encoding or connection close. Asyncio streams with the
framing parsed in Python (its first form) cost a sixth of the router's CPU per request; the parser
in C hands the body over with its framing removed, and the protocol keeps what arrived until the
relay takes it, all of it at once.

Errors are classified here, once:

* :class:`UpstreamUnreachable`: nothing of the response arrived (refused, reset, timed out before
  the status line). The request can be retried on another worker. A pooled connection that the
  worker closed while idle is retried once on a fresh connection first.
* :class:`UpstreamBroken`: the exchange failed after the response head (the stream broke).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

_MAX_HEAD = 64 * 1024  # bytes of a response head
_HIGH_WATER = 256 * 1024  # body bytes held for a relay that does not take them: reading pauses


class UpstreamError(Exception):
    """Base of the client's errors (translated to Rudder errors by the proxy)."""


class UpstreamUnreachable(UpstreamError):
    """No part of the response arrived: safe to retry elsewhere."""


class UpstreamBroken(UpstreamError):
    """The response started and then failed."""


class Listener(Protocol):
    """Who is told, from the connection's callbacks, what arrives of an exchange that no reader
    awaits (router.express): once per read, and once when the connection is lost."""

    def upstream_read(self, conn: _Conn) -> None:
        """A read was parsed: the head may be in (``conn.head_done``), body parts held
        (``conn.body``, taken with ``conn.take``), the answer complete (``conn.complete``)."""

    def upstream_lost(self, conn: _Conn) -> None:
        """The connection is gone (``conn.complete`` if an answer framed by the close ended)."""


class _Lost:
    """The parser callbacks of a connection that is gone (nothing is fed to its parser then)."""


# The parser of every lost connection (its own is let go of: connection_lost).
_LOST = httptools.HttpResponseParser(_Lost())


class _Conn(asyncio.Protocol):
    """One connection to a worker and the state of the exchange on it (one at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.reused = False
        self.lost = False  # the connection is gone
        self.why = ""  # what broke it, when it broke
        self.expired = False  # the response head did not come in time (the transport was aborted)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        # While set, the body that arrives is offered to it at the end of each read (from
        # ``data_received``) instead of waking the reader; it returns False when it did not take
        # it (the reader is then woken and the sink cleared).
        self.sink: Callable[[bytes], bool] | None = None
        # While set, each parsed read and the connection's loss go to it instead (no reader).
        self.listener: Listener | None = None
        # The parser hands the body straight to the list (its callbacks are read when it is made):
        # held until data_received hands it on once the read is parsed; a second answer's bytes
        # (``extra``) are cut off there, after the first answer's end (``_ended``). One parser and
        # one list for the connection's life: a reused connection's last answer ended cleanly
        # (else it is closed, never reused), where the parser is ready for the next one.
        self.body: list[bytes] = []
        self.on_body = self.body.append
        self.parser = httptools.HttpResponseParser(self)
        self.begin()

    def begin(self) -> None:
        """A new exchange: nothing received."""
        self.active = True  # an exchange runs (bytes while none does are not an answer to anything)
        self.body.clear()
        self._ended = -1
        self.received = 0  # bytes of this exchange's response
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []  # as they came (decoded when read: _decoded)
        self.head_done = False
        self.extra = False  # bytes past this exchange's answer arrived
        self.reusable = False
        self._taken = 0  # self.received when the body was last taken (what is held: the rest)
        self.complete = False

    # -- the protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class

    def data_received(self, data: bytes) -> None:
        if not self.active:  # a pooled connection is silent: what comes now would be mistaken for
            self._fail("bytes on an idle connection")  # the next request's answer
            return
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad response: {type(exc).__name__}")
            return
        if not self.head_done and self.received > _MAX_HEAD:
            self._fail("response head too large")
            return
        if self.extra and self._ended >= 0:
            del self.body[self._ended:]  # not this exchange's answer
        if self.listener is not None:
            self.listener.upstream_read(self)
        elif self.body:
            if self.sink is not None and not self.complete and not self.lost:
                # A chunk that ends the answer is left to the reader (it ends the client's answer).
                data = self.take()
                if self.sink(data):
                    return
                self.sink = None
                self.body.append(data)
            if self.received - self._taken > _HIGH_WATER:
                self._pause()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        # Nothing is parsed after this; the parser's callbacks are this connection's methods (a
        # reference cycle): without it the two are freed by reference counting.
        self.parser = _LOST
        closed_framing = False
        if self.head_done and not self.complete:
            headers = _decoded(self.raw_headers)
            closed_framing = ("content-length" not in headers
                              and "chunked" not in headers.get("transfer-encoding", "").lower())
        if closed_framing:
            self.complete = True  # a body framed by the connection's close ends here
        elif not self.why:
            self.why = type(exc).__name__ if exc is not None else "connection closed"
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.upstream_lost(self)
        self._wake()

    def _fail(self, why: str) -> None:
        self.why = why
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows

    # -- the parser's callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.head_done:  # a second answer after this exchange's: not this request's, and the
            self.extra = True  # connection is not to be trusted with the next one
            self.reusable = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.extra:
            self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.extra:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # informational (100 Continue): the answer's head follows
            self.raw_headers = []
            return
        self.status = status
        self.reusable = self.parser.should_keep_alive()  # what the head says (HTTP/1.1, Connection)
        self.head_done = True
        if self._waiter is not None:  # (an express exchange has no reader: no call a read)
            self._wake()

    def _pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if not self.head_done or self.extra:
            return  # an informational answer's end, or one after the answer
        self._ended = len(self.body)
        self.complete = True
        if self._waiter is not None:
            self._wake()

    # -- the exchange's side ---------------------------------------------------------------------

    def take(self) -> bytes:
        """The body that arrived since the last take, all of it."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()  # the same list: the parser appends to it
        if self._ended >= 0:
            self._ended = 0
        self._taken = self.received
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def wait(self) -> None:
        """Until something arrives (or the connection goes)."""
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def expire(self) -> None:
        if not self.head_done:
            self.expired = True
            self._fail("TimeoutError")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def header_value(raw: list[tuple[bytes, bytes]], name: bytes, default: str) -> str:
    """One field of a head as it came (``name`` in lower case; the last wins, as in
    :func:`_decoded`), without decoding the others."""
    for field_name, value in reversed(raw):
        if field_name.lower() == name:
            return value.decode("latin-1").strip()
    return default


def _decoded(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {name.decode("latin-1").strip().lower(): value.decode("latin-1").strip() for name, value in raw}


@dataclass(slots=True)
class _Pool:
    idle: list[_Conn] = field(default_factory=list)


class UpstreamClient:
    """Keep-alive connections to workers; ``open`` sends a request and returns at its response
    head. One instance per router process, opened and closed in its lifespan."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, max_idle_per_host: int = 256) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle_per_host
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._addr: dict[str, tuple[str, int, str]] = {}
        # (url, path) → (the pool's key, the request line and Host field)
        self._starts: dict[tuple[str, str], tuple[tuple[str, int], str]] = {}
        self._closed = False

    def _address(self, url: str) -> tuple[str, int, str]:
        addr = self._addr.get(url)
        if addr is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamUnreachable(f"unsupported worker URL {url!r} (http://host:port expected)")
            port = parts.port or 80
            addr = (parts.hostname, port, parts.path.rstrip("/"))
            self._addr[url] = addr
        return addr

    async def _connect(self, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(loop), host, port), self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnreachable(f"connect to {host}:{port} failed: {type(exc).__name__}") from exc
        return conn

    def _idle(self, key: tuple[str, int]) -> _Conn | None:
        pool = self._pools.get(key)
        while pool is not None and pool.idle:
            conn = pool.idle.pop()
            if not conn.lost:
                return conn
        return None

    def _request(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> tuple[tuple[str, int], bytes]:
        """(the worker's address, the bytes of a POST of ``body`` to ``url + path``)."""
        start = self._starts.get((url, path))
        if start is None:  # the request line and Host of each worker's route, made once (as _address)
            host, port, prefix = self._address(url)
            line = f"POST {prefix}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            start = self._starts[(url, path)] = ((host, port), line)
        key, head = start
        fields = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        return key, f"{head}Content-Length: {len(body)}\r\n{fields}\r\n".encode("latin-1") + body

    def idle(self, url: str) -> tuple[tuple[str, int], _Conn] | None:
        """An idle keep-alive connection to ``url``'s worker (taken from the pool), with the pool's
        key; None if there is none (or the URL is not one the client speaks to)."""
        try:
            host, port, _ = self._address(url)
        except UpstreamUnreachable:
            return None
        conn = self._idle((host, port))
        return None if conn is None else ((host, port), conn)

    async def connect(self, url: str) -> tuple[tuple[str, int], _Conn]:
        """A new connection to ``url``'s worker, with its pool's key. Raises UpstreamUnreachable."""
        host, port, _ = self._address(url)
        return (host, port), await self._connect(host, port)

    def start(self, conn: _Conn, listener: Listener, url: str, path: str, body: bytes,
              headers: Mapping[str, str]) -> asyncio.TimerHandle:
        """POST on ``conn`` (from :meth:`idle`) with no reader: what arrives goes to ``listener``
        from the connection's callbacks. Returns the head's timer (the connection is aborted if
        no head comes within the read timeout; the caller cancels it at the head). The caller
        gives the connection back with :meth:`release` once its answer ended, or closes it."""
        _, request = self._request(url, path, body, headers)
        conn.listener = listener
        return self._send(conn, request)

    def _send(self, conn: _Conn, request: bytes) -> asyncio.TimerHandle:
        """A new exchange on ``conn``: ``request`` written, the head's timer armed (returned)."""
        conn.begin()
        timer = conn.loop.call_later(self.read_timeout_s, conn.expire)
        assert conn.transport is not None
        conn.transport.write(request)
        return timer

    def release(self, key: tuple[str, int], conn: _Conn) -> None:
        """A connection whose answer was read to its end back to its pool; closed if it cannot
        serve another (gone, its answer not complete, or its head said it does not keep alive)."""
        conn.listener = None
        conn.active = False
        pool = self._pools.setdefault(key, _Pool())
        if self._closed or len(pool.idle) >= self.max_idle or conn.lost or not conn.complete or not conn.reusable:
            conn.close()
            return
        conn.reused = True
        pool.idle.append(conn)

    async def open(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """POST ``body`` to ``url + path``; return once the status line and headers are in.
        Raises UpstreamUnreachable (nothing arrived) or UpstreamBroken."""
        key, request = self._request(url, path, body, headers)
        host, port = key
        conn = self._idle(key) or await self._connect(host, port)
        try:
            return await self._exchange(key, conn, request)
        except UpstreamUnreachable:
            if not conn.reused:
                raise
            # The worker may have closed the idle connection: once more, on a fresh one.
            fresh = await self._connect(host, port)
            return await self._exchange(key, fresh, request)

    async def _exchange(self, key: tuple[str, int], conn: _Conn, request: bytes) -> UpstreamResponse:
        # A head that never started is "unreachable" (retry elsewhere), one cut or malformed is
        # "broken". One timer for the head, cancelled when it is in.
        timer = self._send(conn, request)
        try:
            while not conn.head_done and not conn.lost:
                await conn.wait()
        except BaseException:  # cancelled mid-exchange: the connection is in an unknown state
            conn.close()
            raise
        finally:
            timer.cancel()
        if not conn.head_done:
            conn.close()
            where = f"{key[0]}:{key[1]}"
            if conn.expired:
                raise UpstreamUnreachable(f"no response from {where}: TimeoutError")
            if conn.received:
                raise UpstreamBroken(f"connection closed in the response head from {where}: {conn.why}")
            raise UpstreamUnreachable(f"no response from {where}: {conn.why}")
        return UpstreamResponse(self, key, conn, conn.status)

    async def aclose(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            for conn in pool.idle:
                conn.close()
            pool.idle.clear()


class ReadDeadline:
    """The body's read timeout with one timer per response instead of one per read (an
    ``asyncio.timeout`` scope per read showed in the router's profile): reads mark when they
    start waiting and when they are served; the timer, when it fires, aborts the connection if a
    read has waited ``timeout`` seconds, else re-arms for the one waiting now. Only time spent
    waiting for the worker counts, never the consumer's time between chunks."""

    __slots__ = ("_handle", "_loop", "_since", "_timeout", "_transport", "expired")

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.WriteTransport, timeout: float) -> None:
        self._loop = loop
        self._transport = transport
        self._timeout = timeout
        self._since: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self.expired = False

    def waiting(self) -> None:
        self._since = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self._since + self._timeout, self._check)

    def served(self) -> None:
        self._since = None

    def _check(self) -> None:
        self._handle = None
        since = self._since
        if since is None:
            return  # no read waits: the next one arms the timer again
        if self._loop.time() - since >= self._timeout:
            self.expired = True
            self._transport.abort()  # the waiting read ends at once (end of stream)
        else:
            self._handle = self._loop.call_at(since + self._timeout, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class UpstreamResponse:
    """A response whose head is in; the body is read with ``next_chunk`` (or ``aread``). The
    connection goes back to the pool when the body has been read to its end, and is closed if
    the response is closed early."""

    def __init__(self, client: UpstreamClient, key: tuple[str, int], conn: _Conn, status: int) -> None:
        self._client = client
        self._key = key
        self._conn: _Conn | None = conn
        self.status_code = status
        self._raw_headers = conn.raw_headers
        self._headers: dict[str, str] | None = None
        self._done = False
        # True from the moment the body's end has been read: the chunk being handed out is the
        # last (the relay then ends the client's answer with it, in one write).
        self.complete = False
        # Set by a relay that can write to its client from a callback: while ``next_chunk`` waits,
        # the body that arrives (but the end of the answer) goes to it as it arrives, without
        # waking the reader; ``next_chunk`` hands out only what it did not take.
        self.sink: Callable[[bytes], bool] | None = None
        self._deadline: ReadDeadline | None = None  # from the body's first read

    @property
    def headers(self) -> dict[str, str]:
        """The head's fields, names in lower case (decoded on first use)."""
        if self._headers is None:
            self._headers = _decoded(self._raw_headers)
        return self._headers

    def header(self, name: bytes, default: str) -> str:
        """One field of the head (``name`` in lower case), without decoding the others."""
        return header_value(self._raw_headers, name, default)

    async def next_chunk(self) -> bytes | None:
        """The body's next part as it arrives (framing removed): whatever arrived since the last
        part, at once (fewer awaits here and fewer sends to the client when the worker is quick);
        None at its end (the connection then goes back to the pool). While a ``sink`` is set,
        what arrives during a wait goes to it from the connection's callback and only what it
        does not take (the answer's end among it) is handed out here. A method, not an async
        generator: a relay reads a few parts per answer, and a generator costs its loop hooks
        and a weak reference per response. Raises UpstreamBroken if the answer is cut."""
        conn = self._conn
        if conn is None or self._done or conn.transport is None:
            return None
        # The body's read timeout counts only the waits for the worker, never the consumer's
        # time between parts (no wait while it runs).
        deadline = self._deadline
        if deadline is None:
            deadline = self._deadline = ReadDeadline(conn.loop, conn.transport, self._client.read_timeout_s)
        while True:
            if conn.body:
                data = conn.take()
                self.complete = conn.complete
                return data
            if conn.complete:
                self._finish()
                return None
            if conn.lost:
                why = "TimeoutError" if deadline.expired else conn.why
                self._abandon()
                raise UpstreamBroken(f"worker stream broke: {why}")
            deadline.waiting()
            conn.sink = self._sink if self.sink is not None else None
            try:
                await conn.wait()
            finally:
                conn.sink = None
            deadline.served()

    def _sink(self, data: bytes) -> bool:
        pushed = self.sink
        if pushed is None or not pushed(data):
            return False
        if self._deadline is not None:
            self._deadline.waiting()  # served: the wait for the worker starts again from now
        return True

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's parts, as :meth:`next_chunk` hands them out."""
        return _Parts(self)

    async def aread(self, limit: int | None = None) -> bytes:
        """The whole body. Past ``limit`` bytes the connection is closed and UpstreamBroken
        raised: a worker's answer read whole is held in the router's memory, and one that never
        ends (a bug, or a worker that means harm) must not take all of it."""
        parts = []
        size = 0
        while (data := await self.next_chunk()) is not None:
            size += len(data)
            if limit is not None and size > limit:
                self._abandon()
                raise UpstreamBroken(f"answer exceeds {limit} bytes (the router's max_answer_bytes)")
            parts.append(data)
        return b"".join(parts)

    def _finish(self) -> None:
        self._end()
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client.release(self._key, conn)

    def _abandon(self) -> None:
        self._end()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _end(self) -> None:
        self._done = True
        if self._deadline is not None:
            self._deadline.cancel()

    async def aclose(self) -> None:
        """Close early (client gone): the connection cannot be reused mid-body."""
        if not self._done:
            self._abandon()

    def abort(self) -> None:
        """Close the connection under a reader that may be waiting on it (from a callback): the
        pending read fails with UpstreamBroken at once."""
        conn = self._conn
        if conn is not None and not self._done and conn.transport is not None:
            conn.transport.abort()


class _Parts:
    """:meth:`UpstreamResponse.aiter_raw`'s iterator (a class: the router's compiled modules
    cannot hold an async generator, docs/decisions.md 131)."""

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    def __aiter__(self) -> _Parts:
        return self

    async def __anext__(self) -> bytes:
        data = await self._response.next_chunk()
        if data is None:
            raise StopAsyncIteration
        return data
