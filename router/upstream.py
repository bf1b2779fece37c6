"""The router's HTTP/1.1 client to its workers: keep-alive connections on asyncio streams.

Why not httpx: the proxy is one narrow exchange (POST a JSON body to a known worker, stream the
answer back) on the router's hot path, and httpx's general machinery cost about 60% of the router's
CPU per proxied request (bench/proxy_overhead.py). This client does only what the exchange needs:
a pool of idle keep-alive connections per worker address, ``Content-Length`` requests, responses
framed by ``Content-Length``, chunked encoding or connection close.

Errors are classified here, once:

* :class:`UpstreamUnreachable`: nothing of the response arrived (refused, reset, timed out before
  the status line). The request can be retried on another worker. A pooled connection that the
  worker closed while idle is retried once on a fresh connection first.
* :class:`UpstreamBroken`: the exchange failed after the response head (the stream broke).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_MAX_HEAD = 64 * 1024
_READ_CHUNK = 64 * 1024


class UpstreamError(Exception):
    """Base of the client's errors (translated to Rudder errors by the proxy)."""


class UpstreamUnreachable(UpstreamError):
    """No part of the response arrived: safe to retry elsewhere."""


class UpstreamBroken(UpstreamError):
    """The response started and then failed."""


@dataclass(slots=True)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


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
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=_MAX_HEAD), self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnreachable(f"connect to {host}:{port} failed: {type(exc).__name__}") from exc
        return _Conn(reader, writer)

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        pool = self._pools.setdefault(key, _Pool())
        if self._closed or len(pool.idle) >= self.max_idle or conn.writer.is_closing():
            conn.close()
            return
        conn.reused = True
        pool.idle.append(conn)

    async def open(self, url: str, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """POST ``body`` to ``url + path``; return once the status line and headers are in.
        Raises UpstreamUnreachable (nothing arrived) or UpstreamBroken."""
        host, port, prefix = self._address(url)
        key = (host, port)
        lines = [f"POST {prefix}{path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        pool = self._pools.get(key)
        conn = pool.idle.pop() if pool and pool.idle else await self._connect(host, port)
        try:
            return await self._exchange(key, conn, request)
        except UpstreamUnreachable:
            if not conn.reused:
                raise
            # The worker may have closed the idle connection: once more, on a fresh one.
            fresh = await self._connect(host, port)
            return await self._exchange(key, fresh, request)

    async def _exchange(self, key: tuple[str, int], conn: _Conn, request: bytes) -> UpstreamResponse:
        # The whole head in one read (one await and one deadline, not one per line): a head that
        # never started is "unreachable" (retry elsewhere), one cut or malformed is "broken".
        try:
            conn.writer.write(request)
            async with asyncio.timeout(self.read_timeout_s):
                head = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            conn.close()
            cls = UpstreamBroken if exc.partial else UpstreamUnreachable
            what = "connection closed in the response head" if exc.partial else "no response"
            raise cls(f"{what} from {key[0]}:{key[1]}: {type(exc).__name__}") from exc
        except asyncio.LimitOverrunError as exc:
            conn.close()
            raise UpstreamBroken(f"response head from {key[0]}:{key[1]} too large") from exc
        except (OSError, TimeoutError) as exc:
            conn.close()
            raise UpstreamUnreachable(f"no response from {key[0]}:{key[1]}: {type(exc).__name__}") from exc
        except BaseException:  # cancelled mid-exchange: the connection is in an unknown state
            conn.close()
            raise
        try:
            status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
            status = int(status_line.split(None, 2)[1])
            headers: dict[str, str] = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        except (ValueError, IndexError) as exc:
            conn.close()
            raise UpstreamBroken(f"bad response head from {key[0]}:{key[1]}: {type(exc).__name__}") from exc
        return UpstreamResponse(self, key, conn, status, headers)

    async def aclose(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            for conn in pool.idle:
                conn.close()
            pool.idle.clear()


class _ReadDeadline:
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
    """A response whose head is in; the body is read with ``aiter_raw`` or ``aread``. The
    connection goes back to the pool when the body has been read to its end, and is closed if
    the response is closed early."""

    def __init__(self, client: UpstreamClient, key: tuple[str, int], conn: _Conn, status: int,
                 headers: dict[str, str]) -> None:
        self._client = client
        self._key = key
        self._conn: _Conn | None = conn
        self.status_code = status
        self.headers = headers
        self._done = False
        # True from the moment the body's end has been read: the chunk being handed out is the
        # last (the relay then ends the client's answer with it, in one write).
        self.complete = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body, as it arrives (chunked framing removed)."""
        conn = self._conn
        if conn is None or self._done:
            return
        reader = conn.reader
        deadline = _ReadDeadline(asyncio.get_running_loop(), conn.writer.transport, self._client.read_timeout_s)
        te = self.headers.get("transfer-encoding", "").lower()
        try:
            # Each read has its own deadline (never a yield while one runs: the consumer's time
            # between chunks is not the worker's).
            if "chunked" in te:
                # Parse every complete chunk already received and forward them together: fewer
                # awaits here and fewer sends to the client when the worker is quick.
                buf = bytearray()
                ended = False
                while not ended:
                    out = bytearray()
                    while True:
                        eol = buf.find(b"\r\n")
                        if eol < 0:
                            break
                        size = int(bytes(buf[:eol]).split(b";", 1)[0].strip(), 16)
                        if size == 0:
                            ended = True  # trailers, if any, end with an empty line
                            end = buf.find(b"\r\n\r\n", eol)
                            if end < 0:
                                ended = False
                            else:
                                del buf[: end + 4]
                            break
                        if len(buf) < eol + 2 + size + 2:
                            break
                        out += buf[eol + 2 : eol + 2 + size]
                        del buf[: eol + 2 + size + 2]
                    if ended:
                        self.complete = True
                    if out:
                        yield bytes(out)
                    if ended:
                        break
                    deadline.waiting()
                    data = await reader.read(_READ_CHUNK)
                    deadline.served()
                    if not data:
                        raise ConnectionResetError("stream closed inside a chunked body")
                    buf += data
            elif "content-length" in self.headers:
                remaining = int(self.headers["content-length"])
                while remaining > 0:
                    deadline.waiting()
                    data = await reader.read(min(remaining, _READ_CHUNK))
                    deadline.served()
                    if not data:
                        raise ConnectionResetError("stream closed inside the body")
                    remaining -= len(data)
                    self.complete = remaining <= 0
                    yield data
            else:  # framed by connection close
                while True:
                    deadline.waiting()
                    data = await reader.read(_READ_CHUNK)
                    deadline.served()
                    if not data:
                        if deadline.expired:
                            raise TimeoutError
                        break
                    yield data
                self.headers["connection"] = "close"
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            self._abandon()
            why = "TimeoutError" if deadline.expired else type(exc).__name__
            raise UpstreamBroken(f"worker stream broke: {why}") from exc
        finally:
            deadline.cancel()
        self._finish()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    def _finish(self) -> None:
        self._done = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.headers.get("connection", "").lower() == "close":
            conn.close()
        else:
            self._client._release(self._key, conn)

    def _abandon(self) -> None:
        self._done = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def aclose(self) -> None:
        """Close early (client gone): the connection cannot be reused mid-body."""
        if not self._done:
            self._abandon()

    def abort(self) -> None:
        """Close the connection under a reader that may be waiting on it (from a callback): the
        pending read fails with UpstreamBroken at once."""
        conn = self._conn
        if conn is not None and not self._done:
            conn.writer.transport.abort()
