"""Ingress limits: what one client can hold of a router (docs/router.md, "Ingress limits").

Two layers, each where the thing it bounds is visible:

* The connection: :class:`GuardedHttpProtocol`, uvicorn's httptools protocol with guards, because
  an ASGI app only sees a request once its headers are complete, and a client that never
  completes them (slowloris) or stops reading its answer never reaches the app.

  - open connections: past ``max_connections`` a new one may only ask for ``/health``, ``/live``
    and ``/metrics`` (``IngressLimits.probe_paths``: a kubelet's probes and a scrape answered when
    clients hold every connection; anything else is answered 503 and the connection closed), and
    past ``max_connections`` + :data:`PROBE_RESERVE` it is answered 503 and closed at once;
  - the request head: at most ``max_header_bytes`` (431) and ``header_timeout_s`` from the
    connection's opening or the request's first byte (408); then the connection is closed;
  - the request body: all of it within ``body_timeout_s`` after the head (408, closed; the app,
    waiting for the body, sees a disconnect). Both timers are armed only when a chunk of input
    leaves a request incomplete, so a request that arrives whole (the usual case) costs none;
  - writing: while the router has output queued for a client that accepts none (asyncio paused
    writing at its high-water mark), a timer runs; past ``write_timeout_s`` the connection is
    aborted. The app sees a disconnect, so a streamed answer's relay stops, its worker
    connection is closed and its booking freed (router/api.py);
  - after an early answer (a 413 while the body still arrives) the rest of the body is read
    and dropped for at most ``DISCARD_S``, so that the client, which is still writing, can read
    the answer (nginx's lingering close); then the connection is closed.

* An upgrade offer the server does not take (``Upgrade: h2c``, which Java's and Ktor's HTTP clients
  add to ordinary POSTs) is ignored, as RFC 9110 §7.8 lets a server do, and the request is served
  as HTTP/1.1 with its body. httptools ends such a message at its head and hands nothing of the
  body on; uvicorn then warned and served the request with an empty body (uvicorn #2722). The
  protocol re-reads the rest as the body (:meth:`GuardedHttpProtocol._ignore_upgrade`).

* The body's size: :func:`read_body` takes it from ASGI chunk by chunk, refusing at once a
  ``Content-Length`` above the limit and, without one, stopping at the limit (413).

Refusals are rendered by the router's one error mapping (``IngressLimits.render``). Each request
is served by the router's request cycle (router.cycle.DirectCycle), which the protocol makes of uvicorn's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast

import httptools
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from uvicorn._types import ASGI3Application
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from controlplane.protocol.errors import (
    ClientGone,
    HeadersTooLarge,
    PayloadTooLarge,
    RequestTimeout,
    RudderError,
    ServiceUnavailable,
)
from router.cycle import DirectCycle

log = logging.getLogger(__name__)

# How long the rest of a body is read and dropped after an early answer, before the connection
# is closed (a client that is still writing gets time to read the answer).
DISCARD_S = 5.0
# Connections past max_connections kept for probes and scrapes (decision 109): a router whose
# clients hold all its connections must still answer its kubelet, or it is restarted (liveness)
# and taken out of its Service (readiness), which sends its load to the other replicas.
PROBE_RESERVE = 32


@dataclass(frozen=True, kw_only=True)
class IngressLimits:
    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    write_timeout_s: float
    render: Callable[[RudderError], Response]  # the router's error mapping (OpenAI shape)
    on_refused: Callable[[str], None] = lambda reason: None  # counts refusals by reason
    # What a connection past max_connections may ask for (the router's; the control plane's admin
    # listener names its own).
    probe_paths: frozenset[str] = frozenset({"/health", "/live", "/metrics"})


class ExpressPath(Protocol):
    """The router's express path (router.express.Express), as the protocol drives it."""

    max_body: int

    def route(self, scope: Any) -> bool | None: ...

    def serve(self, side: Any, cycle: RequestResponseCycle, chat: bool) -> bool: ...


class ExpressExchange(Protocol):
    """A request in flight on the express path (router.express.Exchange)."""

    def client_gone(self) -> None: ...

    def client_paused(self, paused: bool) -> None: ...


def protocol_class(limits: IngressLimits, express: ExpressPath | None = None) -> type[GuardedHttpProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` bound to ``limits`` (and the router's
    express path, if given)."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits, "express": express})


class GuardedHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[IngressLimits]
    # The express path (router.express): an inference request whose body is in is served from
    # this protocol's callbacks; anything it does not take starts its ASGI task as before.
    express: ClassVar[ExpressPath | None] = None

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._refused = False
        self._in_head = False
        self._in_body = False  # head complete, body not yet
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._discard_until: float | None = None
        self._probes_only = False  # opened past max_connections: probes and scrapes only
        self._replaying = False  # a head re-read after an ignored upgrade (_ignore_upgrade)
        # An express-path request waiting for the rest of its body (whether chat), and the one in
        # flight there. (Its app is the protocol's: the express path takes no other.)
        self._pending: RequestResponseCycle | None = None
        self._pending_chat = False
        self.exchange: ExpressExchange | None = None

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._probes_only = len(self.connections) >= self.limits.max_connections
        if len(self.connections) >= self.limits.max_connections + PROBE_RESERVE:
            self._refused = True
            self.transport = transport
            self._refuse(self._limit_error(), "max_connections")
            return
        super().connection_made(transport)
        self._in_head = True  # a connection's first bytes are a request head
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._write_timer = None
        if self._refused:
            return
        super().connection_lost(exc)
        self._pending = None
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.client_gone()
        cycle = self.cycle
        if isinstance(cycle, DirectCycle) and cycle.disconnected:
            cycle.gone()

    def on_response_complete(self) -> None:
        # The answered cycle's extensions taken back (DirectCycle.withdraw). With pipelined
        # requests the protocol's cycle may be a later one, not yet answered: left alone.
        cycle = self.cycle
        if isinstance(cycle, DirectCycle) and cycle.response_complete:
            cycle.withdraw()
        super().on_response_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        """uvicorn starts each request's app here (at once, or after the answers pipelined before
        it): on a connection opened past ``max_connections``, a request for anything but a probe
        path is answered 503 instead (its connection then closed), as past the reserve."""
        if self._probes_only and cycle.scope["path"] not in self.limits.probe_paths:
            self.limits.on_refused("max_connections")
            app = cast(ASGI3Application, self._over_the_limit)
        elif (express := self.express) is not None and app is self.app and not cycle.waiting_for_100_continue:
            chat = express.route(cycle.scope)
            if chat is not None:  # the express path's, once its body is in
                self._pending, self._pending_chat = cycle, chat
                if not cycle.more_body:  # (a pipelined request, started after the one before it)
                    self._serve_pending()
                return
        super()._start_asgi_task(cycle, app)

    def _serve_pending(self) -> None:
        cycle, self._pending = self._pending, None
        assert cycle is not None and self.express is not None
        if not self.express.serve(self, cycle, self._pending_chat):
            self.to_asgi(cycle)

    def to_asgi(self, cycle: RequestResponseCycle) -> None:
        """Serve an express-path request the ASGI way after all (its body is still in ``cycle``)."""
        self._pending = None
        if type(cycle) is RequestResponseCycle:
            DirectCycle.adopt(cycle)
        super()._start_asgi_task(cycle, self.app)

    async def _over_the_limit(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = self.limits.render(self._limit_error())
        response.raw_headers.append((b"connection", b"close"))
        await response(scope, receive, send)

    def _limit_error(self) -> ServiceUnavailable:
        return ServiceUnavailable(f"this router holds its limit of {self.limits.max_connections} connections",
                                  retry_after=1)

    def _refuse(self, exc: RudderError, reason: str) -> None:
        """Answer ``exc`` on the raw connection and close it (no request is being served)."""
        self.limits.on_refused(reason)
        response = self.limits.render(exc)
        out = [STATUS_LINE[response.status_code]]
        for name, value in response.raw_headers:
            out += [name, b": ", value, b"\r\n"]
        out += [b"connection: close\r\n\r\n", bytes(response.body)]
        if not self.transport.is_closing():
            self.transport.write(b"".join(out))
            self.transport.close()

    # -- the request head ----------------------------------------------------------------------

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._in_head:
            log.info("client %s: request head not complete within %.1f s; closed", self.client,
                     self.limits.header_timeout_s)
            self._refuse(RequestTimeout(
                f"request headers did not arrive within {self.limits.header_timeout_s} s"), "header_timeout")

    def _body_expired(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self._in_body and cycle is not None and not cycle.response_started:
            log.info("client %s: request body not complete within %.1f s; closed", self.client,
                     self.limits.body_timeout_s)
            self._refuse(RequestTimeout(
                f"the request body did not arrive within {self.limits.body_timeout_s} s", field="body"),
                "body_timeout")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._feed(data)
        if self.transport.is_closing():
            return
        if self._in_head:
            # Still inside a head after this chunk: all of it was head.
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._in_head = False
                self._refuse(HeadersTooLarge(
                    f"request line and headers exceed {self.limits.max_header_bytes} bytes"), "header_size")
            elif self._head_timer is None:
                self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_expired)
        elif self._in_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_expired)

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received`` (a request the parser refuses is answered 400), with an
        upgrade the server does not take ignored rather than its request's body lost."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade as exc:
            if self._should_upgrade():  # a WebSocket handshake: uvicorn's
                self.handle_websocket_upgrade()
            elif self.parser.get_method() == b"CONNECT":  # a tunnel, not an offer: nothing follows
                self._unsupported_upgrade_warning()
            else:
                self._ignore_upgrade(data[exc.args[0]:])

    def _ignore_upgrade(self, rest: bytes) -> None:
        """The request's head without its upgrade offer goes to a fresh parser, quietly (the
        request's cycle has it already), then ``rest``, its body (and whatever is pipelined after
        it): the request is served as if the offer had not been made."""
        parser = self.parser
        head = [parser.get_method(), b" ", self.url, b" HTTP/", parser.get_http_version().encode("ascii"), b"\r\n"]
        for name, value in self.headers:
            if name == b"upgrade":
                continue
            if name == b"connection":
                tokens = [t.strip() for t in value.split(b",")]
                value = b", ".join(t for t in tokens if t and t.lower() != b"upgrade")
                if not value:
                    continue
            head += [name, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        # The replayed URL and headers land in fresh containers: the request's scope holds the
        # first ones (on_message_begin and on_headers_complete, which would make another request
        # of them, do nothing while replaying).
        self.url, self.headers = b"", []
        self.parser = httptools.HttpRequestParser(self)
        self._replaying = True
        try:
            self._feed(b"".join(head))  # without the offer: no upgrade again (a bad head: a 400)
        finally:
            self._replaying = False
        if rest and not self.transport.is_closing():
            self._feed(rest)

    def on_message_begin(self) -> None:
        if self._replaying:
            return
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._discard_until = None

    def on_headers_complete(self) -> None:
        if self._replaying:
            return
        self._in_head = False
        self._in_body = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        # uvicorn made the request's cycle (and started its task, or queued it behind the answer
        # in progress): it becomes the router's before the app sees it (the task has not run yet).
        if type(self.cycle) is RequestResponseCycle and self.cycle is not self._pending:
            DirectCycle.adopt(self.cycle)

    def on_message_complete(self) -> None:
        # The parser ends the message at its head for an upgrade the server will not take: the
        # body is still to come (_ignore_upgrade). One C call a request otherwise.
        if self.parser.should_upgrade() and not self._should_upgrade():
            return
        self._in_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()
        if self._pending is not None and self._pending is self.cycle:
            self._serve_pending()

    # -- the body after an early answer --------------------------------------------------------

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.response_complete:  # answered already: dropped
            now = self.loop.time()
            if self._discard_until is None:
                self._discard_until = now + DISCARD_S
            elif now > self._discard_until:
                self.transport.close()
                return
        super().on_body(body)
        pending = self._pending
        if pending is not None and pending is cycle and self.express is not None \
                and len(pending.body) >= self.express.max_body:
            self.to_asgi(pending)  # too large for the express path: read by its app

    # -- writing -------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_expired)
        if self.exchange is not None:
            self.exchange.client_paused(True)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self.exchange is not None:
            self.exchange.client_paused(False)

    def _write_expired(self) -> None:
        self._write_timer = None
        log.warning("client %s accepted no bytes for %.1f s: disconnected", self.client,
                    self.limits.write_timeout_s)
        self.limits.on_refused("write_timeout")
        self.transport.abort()  # connection_lost: the app sees http.disconnect


async def read_body(receive: Receive, content_length: str | None, *, max_bytes: int) -> bytes | bytearray:
    """The request body, read as it arrives and never past ``max_bytes`` (its time is bounded by
    the protocol's body timeout, which disconnects a client too slow to send it).

    Raises PayloadTooLarge (413, at once for a larger ``Content-Length``, else when the limit is
    crossed, without reading further) and ClientGone (the client left, or was disconnected)."""
    if content_length is not None:
        declared = int(content_length) if content_length.strip().isdigit() else -1
        if declared > max_bytes:
            raise PayloadTooLarge(f"body is {declared} bytes; the limit is {max_bytes}", field="body",
                                  limit=max_bytes)
    buf = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("client disconnected while sending the body")
        chunk: bytes = message.get("body", b"")
        if len(buf) + len(chunk) > max_bytes:
            raise PayloadTooLarge(f"body exceeds the limit of {max_bytes} bytes", field="body",
                                  limit=max_bytes)
        more = message.get("more_body", False)
        if not more and not buf:
            return chunk  # the whole body in one message (the common case): no copy
        buf += chunk
        if not more:
            return buf
