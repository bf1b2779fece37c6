"""The router's OpenAI-compatible HTTP API (DESIGN §1, §5). No admin writes live here.

``/v1/chat/completions`` and ``/v1/completions`` (streaming SSE and not), ``/v1/models``,
``/health`` (503 until the first discovery), ``/live``, ``/metrics``. Every error is rendered in
one place, :func:`error_response`, in the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``: 400 invalid request, 404 unknown model,
499 client gone, 503 no worker, 529 (or 503, configurable) overloaded, 500 only for bugs.

The request body goes to the worker as it came, except that ``nvext.backend_instance_id`` and
``nvext.dp_rank`` name the selected target (headers ``x-worker-instance-id`` / ``x-dp-rank`` too).

Disaggregated serving: when the scheduler answers that a model has prefill and decode workers,
the request first runs on a prefill worker with ``max_tokens`` = 1, no stream (its answer is
dropped unless it is an error; vLLM's ``kv_transfer_params`` are passed on), then, as sent, on a
decode worker, whose answer is the client's. Each phase has its own booking and its own
retry-before-the-first-byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from controlplane.protocol.errors import (
    ClientGone,
    NotFound,
    Overloaded,
    RudderError,
    ServiceUnavailable,
    error_json,
)
from controlplane.telemetry import logs, traces
from router.commands import (
    MarkUnavailable,
    Phase,
    RequestDone,
    RequestFirstToken,
    RoutingRequest,
    Selection,
    SelectWorker,
)
from router.cycle import HOLD, Push, push_hook, watch_disconnect
from router.decisions import figures
from router.ingress import read_body
from router.proxy import WorkerUnreachable
from router.requestwork import (
    MODEL_KEY,
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
from router.targets import (
    HDR_DP_RANK,
    HDR_POLICY_REVISIONS,
    HDR_PREDICTED_CACHED,
    HDR_PREDICTED_TTFT,
    HDR_PREFILL,
    HDR_PREFILL_DP_RANK,
    HDR_WORKER,
)
from router.tracing import RequestTrace
from router.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
    413: "invalid_request_error", 431: "invalid_request_error", 499: "client_gone",
    503: "service_unavailable", 529: "overloaded_error",
}


def error_response(exc: RudderError, *, overload_status: int = 529) -> Response:
    """The one mapping from an error to an OpenAI-shaped HTTP answer."""
    status = overload_status if isinstance(exc, Overloaded) else exc.status_code
    code = exc.code
    if isinstance(exc, NotFound) and exc.field == "model":
        code = "model_not_found"
    body = {"error": {
        "message": exc.message, "type": _TYPES.get(status, "server_error"), "param": exc.field,
        "code": code,
    }}
    headers = {}
    if status in (503, 529):
        headers["Retry-After"] = str(getattr(exc, "retry_after", 1))
    return Response(error_json(body), status_code=status, headers=headers, media_type="application/json")


def _reason(exc: RudderError) -> str:
    return exc.code


async def _select(rt: Runtime, req: RoutingRequest) -> Selection:
    """The selection: made at once if the actor is idle, else queued; if the client goes away
    while it is queued, cancel it (the actor skips it)."""
    asked = time.perf_counter()
    sel = rt.scheduler.select_now(req)
    if sel is None:
        sel = await _queued(rt, req)
    rt.metrics.model(req.model).selection.observe(time.perf_counter() - asked)
    return sel


async def _queued(rt: Runtime, req: RoutingRequest) -> Selection:
    """The selection queued behind the actor's work. A client that goes away meanwhile cancels
    the wait (its request's :class:`_ClientWatch`), and with it the selection's future: the actor
    skips it; or, if the actor had made it already, its booking is freed here."""
    fut = rt.scheduler.submit(SelectWorker(req))
    try:
        return await fut
    except asyncio.CancelledError:
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            rt.scheduler.send(RequestDone(fut.result().booking_id))  # made, and nobody will use it
        else:
            fut.cancel()
        raise


class _ClientWatch:
    """A request's client going away while the request waits for its worker (the answer's head,
    or the whole of a non-streamed answer, or a disaggregated request's prefill): the request's
    task is cancelled there, which frees its booking and closes the worker connection where it
    waits (the worker aborts the request, as vLLM's server does for a client gone), and the
    request ends as ClientGone (a 499). A streamed answer's relay takes the watch over when it
    is made (:meth:`hand_over`): from then on the client's leaving closes the worker stream under
    the relay instead. Without this, a non-streamed request whose client had left kept its
    booking and its worker busy to the end of an answer nobody would read (found by a chaos soak).

    Used as ``with _ClientWatch(request) as watch:`` around that code. The task is cancelled
    only from a callback, while it waits inside the watched code (never while it runs: a client
    found gone when the watch starts is a ClientGone at once), so the cancellation always lands
    in that code, where the watch's exit tells it apart from the router's own (stopping)."""

    __slots__ = ("_action", "_cancelled", "_stop", "_task", "gone")

    def __init__(self, request: Request) -> None:
        self.gone = False
        self._cancelled = False  # the task cancelled by this watch (to be taken back at the exit)
        self._task = asyncio.current_task()
        self._action: Callable[[], None] | None = None  # set by hand_over
        self._stop = watch_disconnect(request.scope, request.receive, self._on_gone)
        if self.gone:  # already gone: nothing to wait for
            self.stop()
            raise ClientGone("client disconnected before its answer")

    def _on_gone(self) -> None:
        if self.gone:
            return
        self.gone = True
        if self._action is not None:
            self._action()
            return
        task = self._task
        if task is not None and task is not asyncio.current_task():
            self._cancelled = True
            task.cancel()

    def __enter__(self) -> _ClientWatch:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """The watched code ended: stop watching unless a relay took the watch over; a
        cancellation that was the client's leaving (not the router's: it is stopping) is taken
        back and the request ends as ClientGone."""
        task = self._task
        if self._action is None:  # no relay took it over
            self.stop()
        if self._cancelled and task is not None:
            # Taken back even when the code went on (a wait that had its result when the
            # cancellation came may return it: asyncio.wait_for does).
            self._cancelled = False
            if task.uncancel() == 0 and kind is not None and issubclass(kind, asyncio.CancelledError):
                raise ClientGone("client disconnected before its answer") from None

    def hand_over(self, on_gone: Callable[[], None]) -> None:
        """From now on the client's leaving runs ``on_gone`` (the relay's) instead, and the watch
        lasts until the relay stops it."""
        self._action = on_gone
        if self.gone:
            on_gone()

    def stop(self) -> None:
        """Stop watching, and let go of the task, the callback and the relay's action (the
        callback is this watch's own method: a reference cycle until then)."""
        stop, self._stop = self._stop, _nothing
        self._task = None
        self._action = None
        stop()


def _nothing() -> None:
    pass


def _sampled(rt: Runtime, sel: Selection) -> dict[str, Any] | None:
    """The figures of the selection's decision, if it was sampled (for its trace span)."""
    record = rt.decisions.last(sel.request_id, sel.instance_id) if rt.decisions.sample > 0.0 else None
    return figures(record) if record is not None else None


# Where a request's scope keeps its trace, for the error mapping (its model label:
# router.requestwork.MODEL_KEY).
_TRACE = "rudder.trace"
# Where the express path (router.express) leaves the workers it found unreachable when it hands a
# request to this one for its retries.
UNREACHABLE = "rudder.unreachable"


# What vLLM's disaggregated proxy sends a prefill worker: compute the prompt, keep its KV for a
# remote decode. An engine without a KV connector ignores it (the mock does too).
_PREFILL_KV_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def _prefill_body(body: dict[str, Any], sel: Selection, *, chat: bool) -> bytes:
    """The client's request as the prefill phase runs it: one token, no stream."""
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)  # vLLM refuses stream_options without stream
    out.pop("min_tokens", None)  # would exceed max_tokens=1
    out["max_tokens"] = 1
    if chat or "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.setdefault("kv_transfer_params", _PREFILL_KV_PARAMS)
    return target_body(out, sel)


@dataclass(slots=True)
class _Opened:
    sel: Selection
    resp: UpstreamResponse
    selected_at: float  # perf_counter when the first selection of the phase was answered
    sent_at: float = 0.0  # perf_counter when the request went to the worker that answered


async def _open(
    rt: Runtime, req: RoutingRequest, path: str,
    make_body: Callable[[Selection], bytes], headers: Mapping[str, str], *,
    unreachable: frozenset[int] = frozenset(),
) -> _Opened:
    """Select a worker for ``req`` and open the exchange with it (response head received).

    A connection failure before the first byte marks the worker unreachable and retries on
    another worker of the same pool, up to ``max_retries`` times; never for a pinned request.
    ``unreachable``: workers already tried and found so (by the express path, router.express),
    each one attempt. Raises ServiceUnavailable, and what the selection raises."""
    exclude: set[int] = set(unreachable)
    attempts = len(exclude)
    selected_at = 0.0
    labels = (req.model,)
    while True:
        sel = await _select(rt, req._replace(exclude=frozenset(exclude)) if exclude else req)
        if attempts == 0:
            selected_at = time.perf_counter()
        out = dict(headers)
        out[HDR_WORKER] = str(sel.instance_id)
        out[HDR_DP_RANK] = str(sel.dp_rank)
        sent_at = time.perf_counter()
        try:
            resp = await rt.proxy.open(sel.url, path, make_body(sel), out)
        except WorkerUnreachable as exc:
            rt.scheduler.send(RequestDone(sel.booking_id))
            rt.scheduler.send(MarkUnavailable(sel.instance_id))
            attempts += 1
            if sel.pinned or attempts > rt.settings.max_retries:
                raise ServiceUnavailable(exc.message, retry_after=1) from exc
            exclude.add(sel.instance_id)
            rt.metrics.retries.labels(*labels).inc()
            log.warning(
                "request %s (%s phase): %s; retrying elsewhere", req.request_id, sel.pool.value,
                exc.message,
            )
            continue
        except BaseException:
            rt.scheduler.send(RequestDone(sel.booking_id))
            raise
        return _Opened(sel, resp, selected_at, sent_at)


async def _read_all(rt: Runtime, opened: _Opened) -> bytes:
    """The whole answer of a non-streamed exchange. Frees its booking if it fails; else the
    caller ends it (:func:`answer_ended`, or a ``RequestDone`` of its own), its first token
    with it (``first_token``: a non-streamed answer's first token comes with its end)."""
    sel, resp = opened.sel, opened.resp
    read = False
    try:
        content = await resp.aread(rt.settings.max_answer_bytes)
        read = True
        return content
    except UpstreamError as exc:
        raise ServiceUnavailable(f"worker {sel.instance_id} failed: {exc}") from exc
    finally:
        await resp.aclose()
        if not read:
            rt.scheduler.send(RequestDone(sel.booking_id, first_token=True))


def _kv_transfer_params(content: bytes) -> Any:
    """What a prefill worker hands to the decode worker (vLLM's KV connectors), if anything."""
    try:
        answer = json.loads(content)
    except (ValueError, RecursionError):
        return None
    return answer.get("kv_transfer_params") if isinstance(answer, dict) else None


async def _completion(request: Request, rt: Runtime, path: str, chat: bool) -> Response:
    t0 = time.perf_counter()
    settings = rt.settings
    scope = request.scope
    if UNREACHABLE not in scope:  # (else counted on the express path, which began it)
        rt.metrics.asgi_path.inc()
    hdrs = request_headers(scope)
    raw = await read_body(request.receive, hdrs.get("content-length"), max_bytes=settings.max_body_bytes)
    # A large body is parsed, tokenized and hashed in a thread so that the event loop keeps
    # serving every other client meanwhile; a small one inline, where the hop costs more.
    offload = len(raw) >= settings.offload_min_bytes
    body = await asyncio.to_thread(parse_body, raw) if offload else parse_body(raw)
    model, stream, targets, slo = request_fields(rt, scope, hdrs, body)
    view = rt.scheduler.view
    names = view.tokenizers.get(model, frozenset())
    tok = rt.tokenizers.ready(names)
    if tok is None:
        tok = await rt.tokenizers.get(names)
    block_sizes = tuple(view.block_sizes.get(model, ()))
    if offload:
        _, n_prompt, hashes = await asyncio.to_thread(tokenize_request, tok, body, chat, block_sizes)
    else:
        _, n_prompt, hashes = tokenize_request(tok, body, chat, block_sizes)
    request_id, headers, routing = routing_request(rt, hdrs, model, n_prompt, hashes, targets, slo)
    logs.bind(request_id=request_id, router_id=settings.router_id, model=model)  # this request's task only
    tr: RequestTrace | None = None
    if traces.enabled():
        tr = scope[_TRACE] = RequestTrace(hdrs, request_id=request_id, model=model,
                                          router_id=settings.router_id, path=path, started=t0,
                                          prompt_tokens=n_prompt)
        tr.inject(headers)  # the worker's spans are children of this request's
    series = rt.metrics.model(model)

    # From here until the answer's relay takes over, a client that goes away stops the wait
    # for its worker (router.api._ClientWatch): a 499, its booking freed, the worker stopped.
    with _ClientWatch(request) as watch:
        def first_body(s: Selection) -> bytes:
            return _prefill_body(body, s, chat=chat) if s.disaggregated else target_body(body, s, raw=raw)

        try:
            opened = await _open(rt, routing, path, first_body, headers,
                                 unreachable=scope.get(UNREACHABLE, frozenset()))
        except Overloaded:
            if slo is not None:
                rt.metrics.observe_slo(model, "rejected")
            raise
        sel = opened.sel
        if tr is not None:
            tr.selected(sel, tr.tokenized, opened.selected_at, opened.sent_at, _sampled(rt, sel))
        series.overhead.observe(opened.selected_at - t0)
        series.hit_rate.observe(sel.predicted_hit_rate)
        # What the router predicted for the worker that computes the prompt (the prefill worker when
        # disaggregated), and which policy revisions scored it: an operator (or a test) compares the
        # first with usage.prompt_tokens_details.cached_tokens.
        revisions = sel.revisions.text
        logs.bind(worker_id=sel.instance_id, revision=revisions)
        # Headers naming the worker, the revisions and the predicted cache state are a debugging aid
        # and an oracle (a client could confirm, block by block, what prefixes other users sent):
        # off unless RUDDER_DEBUG_HEADERS turns them on.
        debug = rt.settings.debug_headers
        out_headers = {"x-request-id": request_id}
        if debug:
            out_headers[HDR_PREDICTED_CACHED] = str(sel.cached_tokens)
            out_headers[HDR_POLICY_REVISIONS] = revisions
        phase_started: float | None = None  # disaggregated: when the decode worker was selected

        if sel.disaggregated:
            # Prefill phase: the prefill worker computes the prompt and keeps its KV; its answer
            # reaches the client only if it is an error.
            content = await _read_all(rt, opened)
            done = time.perf_counter()
            status = opened.resp.status_code
            rt.metrics.phase_overhead.labels(model, "prefill").observe(opened.selected_at - t0)
            rt.metrics.phase_ttft.labels(model, "prefill").observe(done - opened.selected_at)
            if debug:
                out_headers[HDR_PREFILL] = str(sel.instance_id)
                out_headers[HDR_PREFILL_DP_RANK] = str(sel.dp_rank)
            if status >= 400:
                log.warning("request %s: prefill worker %s answered %d", request_id, sel.instance_id, status)
                rt.metrics.answered(model, path, str(status))
                answer_ended(rt, sel, str(status), b"", None, first_token=True)
                if tr is not None:
                    tr.done(str(status))
                return Response(
                    content, status_code=status, headers=out_headers,
                    media_type=opened.resp.header(b"content-type", "application/json"),
                )
            rt.scheduler.send(RequestDone(sel.booking_id, first_token=True))
            kv_params = _kv_transfer_params(content)

            def decode_body(s: Selection) -> bytes:
                return target_body(body, s, kv_transfer_params=kv_params)

            opened = await _open(rt, routing._replace(phase=Phase.DECODE), path, decode_body, headers)
            phase_started = opened.selected_at
            rt.metrics.phase_overhead.labels(model, "decode").observe(phase_started - done)
            sel = opened.sel
            if tr is not None:
                tr.selected(sel, done, phase_started, opened.sent_at, _sampled(rt, sel))
            logs.bind(worker_id=sel.instance_id)
        resp = opened.resp
        booking = sel.booking_id

        if debug and sel.predicted_ttft_ms is not None:
            out_headers[HDR_PREDICTED_TTFT] = f"{sel.predicted_ttft_ms:.1f}"

        def observe_first_token(now: float) -> None:
            series.ttft.observe(now - t0)
            if slo is not None:
                rt.metrics.observe_slo(model, "met" if (now - t0) * 1e3 <= slo else "missed")
            if phase_started is not None:
                rt.metrics.phase_ttft.labels(model, "decode").observe(now - phase_started)
            if tr is not None:
                tr.first_token(now)

        log.info(
            "request %s → %s worker %s rank %d (revision %s, predicted hit %.2f)", request_id,
            sel.pool.value, sel.instance_id, sel.dp_rank, sel.revisions, sel.predicted_hit_rate,
        )
        if debug:
            out_headers[HDR_WORKER] = str(sel.instance_id)
            out_headers[HDR_DP_RANK] = str(sel.dp_rank)
        content_type = resp.header(b"content-type", "application/json")
        if not stream or resp.status_code >= 400:
            content = await _read_all(rt, opened)
            answered = time.perf_counter()
            observe_first_token(answered)
            rt.metrics.answered(model, path, str(resp.status_code))
            answer_ended(rt, sel, str(resp.status_code), content, (answered - opened.sent_at) * 1e3,
                          first_token=True)
            if tr is not None:
                tr.done(str(resp.status_code))
            return Response(content, status_code=resp.status_code, media_type=content_type, headers=out_headers)

        client_gone = False
        finished = False
        # Content chunks after the role-only opening and when the first and last came (for the
        # worker's decode calibration: its mean inter-token time).
        chunks = 0
        first_at = last = 0.0
        previous = tail = b""  # the last two chunks: where a stream's usage is (its last data line)
        # The first token came in the answer's last read: it goes with the end, in one command.
        first_with_end = False

        relay_status = "499"  # until the answer is read to its end (or breaks)
        broke = False

        async def finish() -> None:
            """Release the worker connection and the booking, once, when the response ends (with the
            relay's status: 499 if it ended before the answer's end)."""
            nonlocal finished
            if finished:
                return
            finished = True
            status = relay_status
            resp.sink = None  # the response's sink closes a cycle through this request's closures
            await resp.aclose()
            itl_ms = (last - first_at) * 1e3 / (chunks - 1) if chunks > 1 and status == "200" else None
            rt.metrics.answered(model, path, status)
            ttft_ms = (first_at - opened.sent_at) * 1e3 if chunks else None
            answer_ended(rt, sel, status, previous + tail, ttft_ms, itl_ms=itl_ms, decode_tokens=chunks or None,
                          first_token=first_with_end, first_ttft_ms=ttft_ms)
            if tr is not None:
                tr.done(status)

        first = FirstTokenDetector()  # a role-only opening chunk is not the first token
        itl = series.itl

        def seen(chunk: bytes) -> None:
            """A chunk of the worker's answer goes to the client (handed out by the relay, or pushed
            from the worker connection's callback): first token, inter-token time, usage's place."""
            nonlocal chunks, first_at, last, previous, tail, first_with_end
            now = time.perf_counter()
            if not chunks:
                if first.feed(chunk):
                    if resp.complete:  # nothing follows: the end's command carries it
                        first_with_end = True
                    else:
                        rt.scheduler.send(RequestFirstToken(booking, ttft_ms=(now - opened.sent_at) * 1e3))
                    observe_first_token(now)
                    first_at = last = now
                    chunks = 1
            else:
                itl.observe(now - last)
                last = now
                chunks += 1
            previous, tail = tail, chunk

        async def relay() -> bytes | None:
            """The worker's answer's next part for the client, None at its end; a stream that breaks
            ends with an error event (or nothing, when the client is gone)."""
            nonlocal relay_status, broke
            if broke:
                return None
            try:
                chunk = await resp.next_chunk()
            except UpstreamError as exc:
                broke = True
                if client_gone:
                    log.info("request %s: client went away; worker stream closed", request_id)
                    return None
                relay_status = "502"
                log.warning("request %s: worker stream broke: %s", request_id, exc)
                err = {"error": {"message": f"worker stream broke: {exc}",
                                 "type": "service_unavailable", "param": None, "code": "worker_failed"}}
                return f"data: {json.dumps(err)}\n\n".encode()
            if chunk is None:
                relay_status = "200"
                return None
            seen(chunk)
            return chunk

        def on_client_gone() -> None:
            nonlocal client_gone
            client_gone = True
            resp.abort()  # the relay's pending read fails at once: booking freed, worker stops

        def push_from(push: Push) -> None:
            """Under the router's server: what the worker sends goes to the client from the worker
            connection's callback, ``seen`` as it goes (router.cycle.DirectCycle.push)."""
            def sink(chunk: bytes) -> bool:
                if not push(chunk):
                    return False
                seen(chunk)
                return True
            resp.sink = sink

        return RelayResponse(relay, status_code=resp.status_code, media_type=content_type,
                             headers=out_headers, on_disconnect=on_client_gone, on_close=finish,
                             last=lambda: resp.complete, push_from=push_from, watch=watch)


class RelayResponse(Response):
    """A streamed answer written straight to ASGI. Starlette's ``StreamingResponse`` runs an anyio
    task group with cancel scopes per response to notice a client that goes away; here
    ``on_disconnect`` runs when the client goes away (``watch_disconnect``: a callback of the
    router's server, or one plain task under another) and closes the worker connection under
    the relay. The head is sent
    once the first chunk is in, and the chunk after which ``last()`` is true ends the answer in
    the same message: under the router's server a short answer is one write to the client. Under
    the router's server, too, ``push_from`` is then given the cycle's ``push``: the chunks between
    the first and the last go to the client from the worker connection's callback (decision 105),
    and this loop sends only what that does not take."""

    def __init__(self, body: Callable[[], Awaitable[bytes | None]], *, status_code: int, media_type: str,
                 headers: Mapping[str, str], on_disconnect: Callable[[], None],
                 on_close: Callable[[], Awaitable[None]], last: Callable[[], bool] = lambda: False,
                 push_from: Callable[[Push], None] | None = None, watch: _ClientWatch | None = None) -> None:
        # Not the base class's constructor: no body to size (this one is streamed, chunked), and
        # the head built once here (a content type as Starlette's: text/* gets a charset).
        self.status_code = status_code
        self.background = None
        self.body = b""
        self.raw_headers = [(b"content-type", with_charset(media_type).encode("latin-1"))]
        self.raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.next_part = body  # the answer's next part, None at its end
        self.on_disconnect = on_disconnect
        self.on_close = on_close
        self.last = last
        self.push_from = push_from
        self.watch = watch  # the request's watch of its client, taken over here
        if watch is not None:
            watch.hand_over(on_disconnect)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self.watch
        stop_watching = watch.stop if watch is not None else watch_disconnect(scope, receive, self.on_disconnect)
        next_part = self.next_part
        try:
            # The head goes with the first chunk: one write. Under the router's server it is
            # rendered while the worker computes the first token and held until that chunk
            # (router.cycle.HOLD); under another server it is sent once the chunk is in.
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            if self.push_from is not None and push_hook(scope) is not None:
                start[HOLD] = True
                await send(start)
                first = await next_part()
            else:
                first = await next_part()
                await send(start)
            ended = first is None
            if first is not None:
                ended = self.last()
                await send({"type": "http.response.body", "body": first, "more_body": not ended})
                push = push_hook(scope) if not ended else None
                if push is not None and self.push_from is not None:
                    # The head is out: the chunks between the first and the last are written
                    # from the worker connection's callback; the relay hands out the rest.
                    self.push_from(push)
            while (chunk := await next_part()) is not None:
                if ended:  # nothing follows the end (the relay only reaches the body's end)
                    continue
                ended = self.last()
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            stop_watching()
            await self.on_close()  # the booking and the worker connection released, once


def error_answer(rt: Runtime, scope: Scope, exc: RudderError) -> Response:
    """The one mapping of a RudderError to the router's answer (OpenAI shape), with its metrics."""
    overload = rt.settings.overload_status
    status = overload if isinstance(exc, Overloaded) else exc.status_code
    rt.metrics.rejections.labels(_reason(exc)).inc()
    rt.metrics.requests.labels(scope.get(MODEL_KEY, ""), scope["path"], str(status)).inc()
    _trace_done(scope, status)
    if status >= 500 and not isinstance(exc, (ServiceUnavailable, Overloaded)):
        log.error("bug: %r", exc)
    return error_response(exc, overload_status=overload)


def _trace_done(scope: Scope, status: int) -> None:
    tr: RequestTrace | None = scope.get(_TRACE)
    if tr is not None:
        tr.done(str(status))


def bug_answer(rt: Runtime, scope: Scope) -> Response:
    """The router's answer to a bug on the request's path (called where it was caught): logged with
    its traceback, counted, a 500 in the OpenAI shape."""
    log.exception("unhandled error on %s", scope["path"])
    rt.metrics.rejections.labels("internal_error").inc()
    _trace_done(scope, 500)
    return error_response(RudderError("internal error"), overload_status=rt.settings.overload_status)


def with_charset(media_type: str) -> str:
    """A content type as Starlette writes it: ``text/*`` gets a charset."""
    if media_type.startswith("text/") and "charset=" not in media_type.lower():
        return media_type + "; charset=utf-8"
    return media_type


INFERENCE_ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}


class InferenceFastPath:
    """Plain ASGI: the two inference routes are served here, ahead of FastAPI's and Starlette's
    whole stack (their telemetry check, which reads the environment on every request, error and
    exception middleware with their ``send`` wrappers, routing, request/response wrappers), which
    cost a large share of the router's CPU per proxied request (bench/proxy_overhead.py). The same
    handler and the same error mapping serve them as the FastAPI routes declared in ``build_api``
    (which remain for the OpenAPI schema and any other server of the app)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    @staticmethod
    def route(scope: Scope) -> bool | None:
        """``chat`` for a request this path serves, else None."""
        if scope["type"] != "http" or scope.get("method") != "POST":
            return None
        return INFERENCE_ROUTES.get(scope.get("path", ""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        request = Request(scope, receive)
        response: Response
        try:
            response = await _completion(request, self.rt, scope["path"], chat=chat)
        except RudderError as exc:
            response = error_answer(self.rt, scope, exc)
        except Exception:
            response = bug_answer(self.rt, scope)
        await response(scope, receive, send)


class RouterApp(FastAPI):
    """The router's ASGI app: FastAPI, with the inference routes served by
    :class:`InferenceFastPath` before anything of FastAPI runs (``build_api`` sets it)."""

    fast_path: InferenceFastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_path
        chat = fast.route(scope) if fast is not None else None
        if fast is not None and chat is not None:
            await fast(scope, receive, send, chat)
        else:
            await super().__call__(scope, receive, send)


def build_api(rt: Runtime, app: RouterApp) -> None:
    """Mount the routes and the error handlers on ``app``."""

    @app.exception_handler(RudderError)
    async def _rudder_error(request: Request, exc: RudderError) -> Response:
        return error_answer(rt, request.scope, exc)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        return bug_answer(rt, request.scope)

    app.fast_path = InferenceFastPath(rt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _completion(request, rt, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completion(request, rt, "/v1/completions", chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        view = rt.scheduler.view
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "rudder",
             "workers": view.workers.get(m, 0)}
            for m in rt.settings.models
        ]}

    # GET, and HEAD for load balancers that check with it (HAProxy's ``option httpchk HEAD``).
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """Ready to take traffic (a load balancer's or Kubernetes' readiness check): 503 until
        connected to NATS, the policy heads are loaded, discovery is complete and every model
        has a worker, and from the moment a graceful stop begins (draining)."""
        view = rt.scheduler.view
        waiting = rt.readiness()
        body = {
            "status": "ok" if not waiting else ("draining" if "draining" in waiting else "starting"),
            "router_id": rt.settings.router_id, "waiting_for": waiting, "workers": view.workers,
            "applied": {k: v.revision for k, v in view.applied.items()},
        }
        return JSONResponse(body, status_code=503 if waiting else 200)

    @app.api_route("/live", methods=["GET", "HEAD"])
    async def live() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        view = rt.scheduler.view
        for key, doc in view.applied.items():
            model, _, kind = key.rpartition("|")
            rt.metrics.revision.labels(model, kind).set(doc.revision)
        for model, n in view.workers.items():
            rt.metrics.workers.labels(model).set(n)
        rt.metrics.queue_depth.set(rt.scheduler.queue_depth)
        with contextlib.suppress(RudderError):  # a stopping router still answers its metrics
            (calibration, expiries, returns, quarantined, slow, peers, held, refused,
             in_flight, kv_events) = await rt.scheduler.inspect(
                lambda s: (s.calibration_status(), s.timings.expired, s.tables.returns.status(), s.quarantined(),
                           s.timing_quarantined(), len(s.peers), s.index_held(), s.index.refused,
                           s.in_flight(), s.index.not_taken()))
            kv_events["dump_missed"] = rt.dumps_missed()
            rt.metrics.set_calibration(calibration, expiries)
            rt.metrics.set_in_flight(in_flight)
            rt.metrics.set_quarantined(quarantined, slow)
            rt.metrics.set_index(held, refused, kv_events)
            rt.metrics.kv_backlog.set(rt.kv_backlog())
            rt.metrics.set_returns(returns)
            rt.metrics.peers.set(peers)
        return Response(rt.metrics.render(), media_type="text/plain; version=0.0.4")
