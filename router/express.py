"""The express path: the common inference request served from the connections' callbacks
(docs/decisions.md 128).

A request the router's connection protocol (router.ingress.GuardedHttpProtocol) has whole, for one
of the two inference routes, is served here from that protocol's callbacks and the worker
connection's (router.upstream.Listener): parsed, checked, tokenized and selected in the callback
that completed its body, sent on an idle pooled connection to the worker, and its answer relayed
from the worker connection's reads. No task, no ASGI messages, no coroutine: what bench/python_floor.py
``--work`` measured this request path could cost, against the ASGI path's structure above the work
(docs/decisions.md 127).

Whatever this path does not serve goes, untouched, the ASGI way (router.api, one task a request),
decided before anything of the request has changed state:

* a body larger than ``offload_min_bytes`` (parsed in a thread there), or not yet complete when it
  grows past that; ``Expect: 100-continue``; tracing on;
* a model whose tokenizer is not loaded yet, or a disaggregated model (two phases);
* a worker found unreachable before its answer's head, for the retries on other workers (its
  booking freed, the worker marked, the ASGI path told which workers to leave out).

A selection behind the scheduler actor's queued work continues the request from its future's
callback; a request to a worker with no idle connection makes one in a task (its callback sends
the request). Everything else behaves as on the ASGI path, with the same helpers: the error mapping and its
metrics, the target in ``nvext``, the worker's timeouts (head, and each wait for its body), the
first token and the inter-token times, usage's cached tokens, the booking's end, a stream that
breaks (an error event), a client that goes away (its worker connection closed, its booking freed),
a client that takes no bytes (the worker connection's reading paused until it does; the protocol's
write timeout disconnects it), keep-alive and ``connection: close``, pipelined requests, a graceful
drain (uvicorn waits for the connection: its answer completes first).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Protocol, cast

from starlette.responses import Response
from starlette.types import Scope
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from controlplane.protocol.errors import ClientGone, Overloaded, RudderError, ServiceUnavailable
from controlplane.telemetry import logs, traces
from router.api import INFERENCE_ROUTES, UNREACHABLE, bug_answer, error_answer, with_charset
from router.commands import MarkUnavailable, RequestDone, RequestFirstToken, Revisions, Selection, SelectWorker
from router.requestwork import (
    Runtime,
    answer_ended,
    parse_body,
    request_fields,
    request_headers,
    routing_request,
    target_body,
    tokenize_request,
)
from router.sse import FirstTokenDetector
from router.targets import HDR_DP_RANK, HDR_POLICY_REVISIONS, HDR_PREDICTED_CACHED, HDR_PREDICTED_TTFT, HDR_WORKER
from router.upstream import ReadDeadline, _Conn, header_value

log = logging.getLogger("router.api")  # the request path's lines, as the ASGI path's
# An exchange's selection until it is made.
NO_SELECTION = Selection("", "", 0, 0, "", Revisions({}), 0, None, 0, 0, 0, 0)


class ClientSide(Protocol):
    """What an exchange needs of the client's connection protocol (router.ingress)."""

    transport: asyncio.Transport
    exchange: Exchange | None

    def to_asgi(self, cycle: RequestResponseCycle) -> None:
        """Serve ``cycle``'s request the ASGI way after all."""


class Express:
    """The express path of one router process (its runtime's scheduler, worker client, metrics)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.client = rt.proxy.client
        # Past this the body goes the ASGI way (parsed in a thread); and uvicorn pauses reading a
        # body past its high-water mark until an app reads it, which this path never does.
        self.max_body = min(rt.settings.offload_min_bytes, HIGH_WATER_LIMIT)
        self.served = rt.metrics.express_path

    @staticmethod
    def route(scope: Any) -> bool | None:
        """``chat`` for a request this path may serve, else None."""
        if scope["method"] != "POST" or traces.enabled():
            return None
        return INFERENCE_ROUTES.get(scope["path"])

    def serve(self, side: ClientSide, cycle: RequestResponseCycle, chat: bool) -> bool:
        """Serve ``cycle``'s request, its body complete: True if this path took it (answered, or
        being answered), False if it is to go the ASGI way (nothing of it changed)."""
        t0 = time.perf_counter()
        raw = cycle.body
        if len(raw) >= self.max_body:
            return False
        rt = self.rt
        sched = rt.scheduler
        scope = cast(Scope, cycle.scope)
        model = ""
        slo: float | None = None
        try:
            hdrs = request_headers(scope)
            body = parse_body(raw)
            model, stream, targets, slo = request_fields(rt, scope, hdrs, body)
            view = sched.view
            tok = rt.tokenizers.ready(view.tokenizers.get(model, frozenset()))
            if tok is None or sched.chooser.disaggregated(model):  # (Scheduler.disaggregated's, a call fewer)
                return False
            _, n_prompt, hashes = tokenize_request(tok, body, chat, tuple(view.block_sizes.get(model, ())))
            request_id, headers, routing = routing_request(rt, hdrs, model, n_prompt, hashes, targets, slo)
            asked = time.perf_counter()
            sel = sched.select_now(routing)
            # Behind the actor's queued work: its answer continues the request from the future's
            # callback (a client gone meanwhile cancels it; the actor skips it).
            queued = sched.submit(SelectWorker(routing)) if sel is None else None
        except RudderError as exc:
            if isinstance(exc, Overloaded) and slo is not None:
                rt.metrics.observe_slo(model, "rejected")
            self.served.inc()
            answer(side, cycle, error_answer(rt, scope, exc))
            return True
        except Exception:  # a bug: answered as the ASGI path answers one (500, logged)
            self.served.inc()
            answer(side, cycle, bug_answer(rt, scope))
            return True
        ex = Exchange(self, side, cycle, model, t0=t0, asked=asked, stream=stream, slo=slo,
                      request_id=request_id, body=body, headers=headers)
        side.exchange = ex
        self.served.value += 1  # (Count.inc, without its check of the amount)
        if queued is None:
            assert sel is not None
            ex.selected(sel)
        else:
            ex.queued = queued
            queued.add_done_callback(ex.on_queued)
        return True


class Exchange:
    """One request on the express path, from its worker's head to its answer's end (the module's
    text); driven by the worker connection (:meth:`upstream_read`, :meth:`upstream_lost`) and the
    client's (:meth:`client_gone`, :meth:`client_paused`)."""

    __slots__ = (
        "asked",
        "body",
        "chunks",
        "conn",
        "content_type",
        "cycle",
        "deadline",
        "done",
        "express",
        "first",
        "first_at",
        "first_with_end",
        "head",
        "head_timer",
        "key",
        "last",
        "model",
        "path",
        "paused",
        "previous",
        "queued",
        "relaying",
        "request",
        "request_id",
        "sel",
        "sent_at",
        "series",
        "side",
        "size",
        "slo",
        "stream",
        "t0",
        "tail",
    )

    def __init__(self, express: Express, side: ClientSide, cycle: RequestResponseCycle, model: str, *,
                 t0: float, asked: float, stream: bool, slo: float | None, request_id: str,
                 body: dict[str, Any], headers: dict[str, str]) -> None:
        self.express = express
        self.side = side
        self.cycle = cycle
        self.model = model
        self.path: str = cycle.scope["path"]
        self.series = express.rt.metrics.model(model)
        self.request: tuple[dict[str, Any], dict[str, str]] | None = (body, headers)  # until sent
        self.sel: Selection = NO_SELECTION  # once selected
        self.queued: asyncio.Future[Selection] | None = None  # a selection behind the actor's work
        self.asked = asked
        self.key: tuple[str, int] = ("", 0)
        self.conn: _Conn | None = None  # once connected
        self.t0 = t0
        self.stream = stream
        self.slo = slo
        self.request_id = request_id
        self.sent_at = 0.0
        self.head_timer: asyncio.TimerHandle | None = None
        self.deadline: ReadDeadline | None = None
        self.done = False
        self.paused = False  # the client takes no bytes: the worker is not read
        self.relaying = False  # a streamed answer, relayed as it comes
        self.head = b""  # the client's answer's head, until it goes with the first chunk
        self.content_type = ""
        self.body: list[bytes] = []  # an answer read whole
        self.size = 0
        self.first: FirstTokenDetector | None = None
        self.chunks = 0
        self.first_at = self.last = 0.0
        self.previous = self.tail = b""
        self.first_with_end = False

    # -- the selection -----------------------------------------------------------------------

    def on_queued(self, fut: asyncio.Future[Selection]) -> None:
        """The queued selection's future is done (the actor's answer, or cancelled)."""
        self.queued = None
        sched = self.express.rt.scheduler
        if self.done:  # the client went away meanwhile: a selection made for nobody is freed
            if not fut.cancelled() and fut.exception() is None:
                sched.send(RequestDone(fut.result().booking_id))
            return
        try:
            exc = fut.exception() if not fut.cancelled() else ServiceUnavailable("router is stopping", retry_after=1)
            if exc is None:
                self.selected(fut.result())
            elif isinstance(exc, RudderError):
                if isinstance(exc, Overloaded) and self.slo is not None:
                    self.express.rt.metrics.observe_slo(self.model, "rejected")
                self._refused(exc)
            else:
                raise exc
        except Exception:
            self._bug()

    def selected(self, sel: Selection) -> None:
        """The selection is made: the request sent to its worker, then counted and logged (off
        the time to the first token)."""
        self.sel = sel
        selected_at = time.perf_counter()
        request, self.request = self.request, None
        assert request is not None
        body, headers = request
        headers[HDR_WORKER] = str(sel.instance_id)
        headers[HDR_DP_RANK] = str(sel.dp_rank)
        self.send(target_body(body, sel, raw=self.cycle.body), headers)
        series = self.series
        series.selection.observe(selected_at - self.asked)
        series.overhead.observe(selected_at - self.t0)
        series.hit_rate.observe(sel.predicted_hit_rate)
        if log.isEnabledFor(logging.INFO):
            rt = self.express.rt
            with logs.bound(request_id=self.request_id, router_id=rt.settings.router_id, model=self.model,
                            worker_id=sel.instance_id, revision=sel.revisions.text):
                log.info("request %s → %s worker %s rank %d (revision %s, predicted hit %.2f)", self.request_id,
                         sel.pool.value, sel.instance_id, sel.dp_rank, sel.revisions, sel.predicted_hit_rate)

    # -- the worker's side -------------------------------------------------------------------

    def send(self, body: bytes, headers: dict[str, str]) -> None:
        """The request to the selected worker: on an idle pooled connection, or on a new one (its
        connection made in a task: the one await of this path, once per new connection)."""
        client = self.express.client
        idle = client.idle(self.sel.url)
        if idle is not None:
            self._start(idle, body, headers)
            return
        task = asyncio.get_running_loop().create_task(client.connect(self.sel.url))
        task.add_done_callback(lambda t: self._connected(t, body, headers))

    def _connected(self, task: asyncio.Task[tuple[tuple[str, int], _Conn]], body: bytes,
                   headers: dict[str, str]) -> None:
        exc = None if task.cancelled() else task.exception()
        if self.done:  # the client went away meanwhile
            if exc is None and not task.cancelled():
                task.result()[1].close()
            return
        if exc is not None or task.cancelled():
            self._unreachable(f"worker at {self.sel.url} is unreachable: {exc or 'cancelled'}")
            return
        self._start(task.result(), body, headers)

    def _start(self, connection: tuple[tuple[str, int], _Conn], body: bytes, headers: dict[str, str]) -> None:
        self.key, self.conn = connection
        self.sent_at = time.perf_counter()
        self.head_timer = self.express.client.start(self.conn, self, self.sel.url, self.path, body, headers)

    def upstream_lost(self, conn: _Conn) -> None:
        try:
            self._lost(conn)
        except Exception:
            self._bug()

    def _bug(self) -> None:
        """A bug in this exchange's handling: logged, both connections closed (as uvicorn closes
        a connection whose app raised once its answer began), the booking freed."""
        log.exception("request %s: unhandled error on the express path", self.request_id)
        self.express.rt.metrics.rejections.labels("internal_error").inc()
        if not self.done:
            self.done = True
            if self.sel is not NO_SELECTION:
                self.express.rt.scheduler.send(RequestDone(self.sel.booking_id,
                                                           first_token=self.deadline is not None))
        self._close_upstream()
        self.side.exchange = None
        self.cycle.on_response = _nothing
        self.side.transport.close()

    def upstream_read(self, conn: _Conn) -> None:
        """A read of the worker's answer was parsed (its head in, body parts held, its end)."""
        try:
            if self.done or not conn.head_done:
                return
            if self.deadline is None:
                self._heard(conn)
            complete = conn.complete
            if conn.body:
                data = conn.take()
                if self.relaying:
                    self._relay(data, complete)
                else:
                    self.size += len(data)
                    limit = self.express.rt.settings.max_answer_bytes
                    if self.size > limit:
                        self._failed(ServiceUnavailable(
                            f"worker {self.sel.instance_id} failed: answer exceeds {limit} bytes (the router's "
                            "max_answer_bytes)"))
                        return
                    self.body.append(data)
            elif complete and self.relaying:
                self._relay(b"", True)
            if complete:
                if not self.relaying:
                    self._answer_whole()
                return
            if self.deadline is not None and not self.paused:
                self.deadline.waiting()
        except Exception:
            self._bug()

    def _heard(self, conn: _Conn) -> None:
        """The worker's head is in."""
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        assert conn.transport is not None
        self.deadline = ReadDeadline(conn.loop, conn.transport, self.express.client.read_timeout_s)
        status = conn.status
        # (as the answer's content type, with a charset for text/*, as Starlette writes it)
        self.content_type = with_charset(header_value(conn.raw_headers, b"content-type", "application/json"))
        if self.stream and status < 400:
            self.relaying = True
            self.first = FirstTokenDetector()
            self.head = self._render_head(status, [(b"content-type", self.content_type.encode("latin-1"))],
                                          chunked=True)

    def _lost(self, conn: _Conn) -> None:
        if self.done:
            return
        if conn.head_done and conn.complete:  # an answer framed by the connection's close
            self.upstream_read(conn)
            return
        sel = self.sel
        self._close_upstream()  # (its timers: the connection is gone)
        if not conn.head_done:
            where = f"{self.key[0]}:{self.key[1]}"
            if conn.received and not conn.expired:
                self._failed(ServiceUnavailable(
                    f"worker at {sel.url} failed: connection closed in the response head from {where}: {conn.why}",
                    retry_after=1), first_token=False)
                return
            why = "TimeoutError" if conn.expired else conn.why
            self._unreachable(f"worker at {sel.url} is unreachable: no response from {where}: {why}",
                              reused=conn.reused and not conn.expired)
            return
        why = "TimeoutError" if self.deadline is not None and self.deadline.expired else conn.why
        if not self.relaying:
            self._failed(ServiceUnavailable(f"worker {sel.instance_id} failed: worker stream broke: {why}"))
            return
        log.warning("request %s: worker stream broke: worker stream broke: %s", self.request_id, why)
        err = {"error": {"message": f"worker stream broke: worker stream broke: {why}",
                         "type": "service_unavailable", "param": None, "code": "worker_failed"}}
        self._relay(f"data: {json.dumps(err)}\n\n".encode(), True, status="502", seen=False)

    def _unreachable(self, message: str, *, reused: bool = False) -> None:
        """Nothing of the answer came: the booking freed; the worker marked unreachable and the
        request handed to the ASGI path for its retries elsewhere (a pinned one, or with no
        retries, answered 503). ``reused``: a pooled connection the worker may have closed while
        idle: the ASGI path tries again, on a fresh connection if the pool has no other."""
        rt = self.express.rt
        sel = self.sel
        sched = rt.scheduler
        sched.send(RequestDone(sel.booking_id))
        if reused:
            self._to_asgi(frozenset())
            return
        sched.send(MarkUnavailable(sel.instance_id))
        if sel.pinned or rt.settings.max_retries < 1:
            self._refused(ServiceUnavailable(message, retry_after=1))
            return
        rt.metrics.retries.labels(self.model).inc()
        log.warning("request %s (%s phase): %s; retrying elsewhere", self.request_id, sel.pool.value, message)
        self._to_asgi(frozenset({sel.instance_id}))

    # -- the client's side -------------------------------------------------------------------

    def client_gone(self) -> None:
        """The client's connection was lost: the worker connection closed, the booking freed (or
        the queued selection cancelled)."""
        if self.done:
            return
        self._close_upstream()
        if self.relaying:  # its answer had begun: it ends as a 499
            self._ended("499")
            return
        rt = self.express.rt
        self.done = True
        self.cycle.on_response = _nothing
        if self.sel is NO_SELECTION:
            if self.queued is not None and not self.queued.done():
                self.queued.cancel()  # (a done one is freed by its callback, which runs next)
        else:
            rt.scheduler.send(RequestDone(self.sel.booking_id, first_token=self.deadline is not None))
        # (its metrics: the answer cannot be written)
        error_answer(rt, cast(Scope, self.cycle.scope), ClientGone("client disconnected before its answer"))

    def client_paused(self, paused: bool) -> None:
        """The client takes no bytes (its transport's buffer is full): the worker is not read
        (nor its read deadline counted: the client's time is not the worker's) until it does."""
        conn = self.conn
        self.paused = paused
        if not self.done and conn is not None and conn.transport is not None:
            (conn.transport.pause_reading if paused else conn.transport.resume_reading)()
            if self.deadline is not None:
                (self.deadline.served if paused else self.deadline.waiting)()

    # -- the answer --------------------------------------------------------------------------

    def _relay(self, chunk: bytes, complete: bool, *, status: str = "200", seen: bool = True) -> None:
        """A streamed answer's next part to the client (its head with the first), the end with it;
        written first (as :meth:`_write` writes, inline: this runs for every read), then looked at
        (first token, inter-token time, usage's place: the ASGI path's ``seen``), off the
        client's wait."""
        out = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
        if complete:
            out += b"0\r\n\r\n"
        if self.head:
            out = self.head + out
            self.head = b""
        transport = self.side.transport
        if not self.cycle.disconnected and not transport.is_closing():
            transport.write(out)
        if chunk and seen:
            now = time.perf_counter()
            if not self.chunks:
                first = self.first
                if first is not None and first.feed(chunk):
                    self.first = None
                    if complete:  # nothing follows: the end's command carries it
                        self.first_with_end = True
                    else:
                        self.express.rt.scheduler.send(RequestFirstToken(self.sel.booking_id,
                                                                         ttft_ms=(now - self.sent_at) * 1e3))
                    self._first_token(now)
                    self.first_at = self.last = now
                    self.chunks = 1
            else:
                self.series.itl.observe(now - self.last)
                self.last = now
                self.chunks += 1
            self.previous, self.tail = self.tail, chunk
        if complete:
            self._ended(status)

    def _first_token(self, now: float) -> None:
        self.series.ttft.observe(now - self.t0)
        slo = self.slo
        if slo is not None:
            self.express.rt.metrics.observe_slo(self.model, "met" if (now - self.t0) * 1e3 <= slo else "missed")

    def _ended(self, status: str) -> None:
        """A streamed answer ended (``status``: 200, 502 broken, 499 client gone)."""
        self.done = True
        if self.deadline is not None:
            self.deadline.cancel()
        if status == "200" and self.conn is not None:
            self.express.client.release(self.key, self.conn)
        else:
            self._close_upstream()
        chunks = self.chunks
        itl_ms = (self.last - self.first_at) * 1e3 / (chunks - 1) if chunks > 1 and status == "200" else None
        rt = self.express.rt
        rt.metrics.answered(self.model, self.path, status)
        ttft_ms = (self.first_at - self.sent_at) * 1e3 if chunks else None
        answer_ended(rt, self.sel, status, self.previous + self.tail, ttft_ms, itl_ms=itl_ms,
                      decode_tokens=chunks or None, first_token=self.first_with_end, first_ttft_ms=ttft_ms)
        if status != "499":
            _complete(self.side, self.cycle)  # the connection serves the next request (or closes)
        else:
            self.cycle.on_response = _nothing

    def _answer_whole(self) -> None:
        """A non-streamed answer (or an error's) read to its end: to the client in one write."""
        self.done = True
        if self.deadline is not None:
            self.deadline.cancel()
        conn = self.conn
        assert conn is not None
        self.express.client.release(self.key, conn)
        content = b"".join(self.body)
        status = conn.status
        headers = [(b"content-length", b"%d" % len(content)), (b"content-type", self.content_type.encode("latin-1"))]
        self._write(self._render_head(status, headers) + content)
        answered = time.perf_counter()
        self._first_token(answered)
        rt = self.express.rt
        rt.metrics.answered(self.model, self.path, str(status))
        answer_ended(rt, self.sel, str(status), content, (answered - self.sent_at) * 1e3, first_token=True)
        _complete(self.side, self.cycle)  # the connection serves the next request (or closes)

    def _render_head(self, status: int, headers: list[tuple[bytes, bytes]], *, chunked: bool = False) -> bytes:
        """The answer's head: ``x-request-id`` (and the debug headers, if on), then ``headers``."""
        named = [(b"x-request-id", self.request_id.encode("latin-1"))]
        if self.express.rt.settings.debug_headers:
            sel = self.sel
            debug = [(HDR_PREDICTED_CACHED, str(sel.cached_tokens)), (HDR_POLICY_REVISIONS, sel.revisions.text)]
            if sel.predicted_ttft_ms is not None:
                debug.append((HDR_PREDICTED_TTFT, f"{sel.predicted_ttft_ms:.1f}"))
            debug += [(HDR_WORKER, str(sel.instance_id)), (HDR_DP_RANK, str(sel.dp_rank))]
            named += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in debug]
        return _head(self.cycle, status, named + headers, chunked=chunked)

    def _write(self, data: bytes) -> None:
        transport = self.side.transport
        if not self.cycle.disconnected and not transport.is_closing():
            transport.write(data)

    def _failed(self, exc: RudderError, *, first_token: bool = True) -> None:
        """The exchange failed before the client's answer began: its booking freed, the worker
        connection closed, ``exc`` answered."""
        self._close_upstream()
        self.express.rt.scheduler.send(RequestDone(self.sel.booking_id, first_token=first_token))
        self._refused(exc)

    def _refused(self, exc: RudderError) -> None:
        self.done = True
        answer(self.side, self.cycle, error_answer(self.express.rt, cast(Scope, self.cycle.scope), exc))

    def _to_asgi(self, unreachable: frozenset[int]) -> None:
        self.done = True
        self.side.exchange = None
        if unreachable:
            cast(Scope, self.cycle.scope)[UNREACHABLE] = unreachable
        self.side.to_asgi(self.cycle)

    def _close_upstream(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if self.deadline is not None:
            self.deadline.cancel()
        conn = self.conn
        if conn is None:
            return
        conn.listener = None
        if conn.transport is not None and not conn.lost:
            conn.transport.abort()


def answer(side: ClientSide, cycle: RequestResponseCycle, response: Response) -> None:
    """Write ``response`` (a whole one: the router's error mapping's) on the client's connection
    and complete the request."""
    transport = side.transport
    data = _head(cycle, response.status_code, response.raw_headers) + bytes(response.body)
    if not cycle.disconnected and not transport.is_closing():
        transport.write(data)
    _complete(side, cycle)


def _head(cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]], *,
          chunked: bool = False) -> bytes:
    """An answer's status line and headers, as uvicorn writes them: its default headers first,
    then ``headers``, ``connection: close`` when the connection ends with the answer."""
    out = [STATUS_LINE[status]]
    for name, value in [*cycle.default_headers, *headers]:
        out += [name, b": ", value, b"\r\n"]
    if not cycle.keep_alive:
        out.append(b"connection: close\r\n")
    if chunked:
        out.append(b"transfer-encoding: chunked\r\n")
    out.append(b"\r\n")
    cycle.response_started = True
    return b"".join(out)


def _complete(side: ClientSide, cycle: RequestResponseCycle) -> None:
    side.exchange = None
    # The cycle's callback is its protocol's method (protocol → cycle → method → protocol): let
    # go of once used, as uvicorn does when its task ends, so no reference cycle outlives a request.
    on_response, cycle.on_response = cycle.on_response, _nothing
    if cycle.disconnected:
        return
    cycle.response_started = cycle.response_complete = True
    if not cycle.keep_alive:
        side.transport.close()
    on_response()


def _nothing() -> None:
    pass

