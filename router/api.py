"""The router's OpenAI-compatible HTTP API (DESIGN §1, §5). No admin writes live here.

``/v1/chat/completions`` and ``/v1/completions`` (streaming SSE and not), ``/v1/models``,
``/health`` (503 until the first discovery), ``/live``, ``/metrics``. Every error is rendered in
one place, :func:`error_response`, in the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``: 400 invalid request, 404 unknown model,
499 client gone, 503 no worker, 529 (or 503, configurable) overloaded, 500 only for bugs.

The request body goes to the worker as it came, except that ``nvext.backend_instance_id`` and
``nvext.dp_rank`` name the selected target (headers ``x-worker-instance-id`` / ``x-dp-rank`` too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from controlplane.protocol.errors import (
    ClientGone,
    InvalidRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RudderError,
    ServiceUnavailable,
)
from controlplane.protocol.hashing import chain_hashes
from router.metrics import RouterMetrics
from router.proxy import Proxy, WorkerUnreachable, forward_headers
from router.scheduler import (
    MarkUnavailable,
    RequestDone,
    RequestFirstToken,
    RoutingRequest,
    Scheduler,
    Selection,
    SelectWorker,
)
from router.settings import RouterSettings
from router.targets import HDR_DP_RANK, HDR_WORKER, parse_pin
from router.tokenize import tokenizer_for

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
    499: "client_gone", 503: "service_unavailable", 529: "overloaded_error",
}


def error_response(exc: RudderError, *, overload_status: int = 529) -> JSONResponse:
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
    return JSONResponse(body, status_code=status, headers=headers)


class Runtime(Protocol):
    """What the API needs from the process wiring (router.app.RouterRuntime)."""

    settings: RouterSettings
    scheduler: Scheduler
    proxy: Proxy
    metrics: RouterMetrics


def _reason(exc: RudderError) -> str:
    return exc.code


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _select(request: Request, rt: Runtime, req: RoutingRequest) -> Selection:
    """Queue the selection; if the client goes away first, cancel it (the actor skips it)."""
    fut = rt.scheduler.submit(SelectWorker(req))
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_wait_disconnect(request))
    waiting: list[asyncio.Future[Any]] = [fut, watcher]
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not fut.done():
        fut.cancel()
        raise ClientGone("client disconnected while the request was queued")
    return fut.result()


def _target_body(body: dict[str, Any], sel: Selection) -> bytes:
    out = dict(body)
    nvext = dict(out.get("nvext") or {})
    nvext["backend_instance_id"] = sel.instance_id
    nvext["dp_rank"] = sel.dp_rank
    out["nvext"] = nvext
    return json.dumps(out).encode()


async def _completion(request: Request, rt: Runtime, path: str, chat: bool) -> Response:
    t0 = time.perf_counter()
    settings = rt.settings
    raw = await request.body()
    if len(raw) > settings.max_body_bytes:
        raise PayloadTooLarge(f"body is larger than {settings.max_body_bytes} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string", field="model")
    request.state.model = model
    if model not in settings.models:
        raise NotFound(f"The model `{model}` does not exist on this router", field="model")
    stream = body.get("stream", False) is True
    pin = parse_pin(body.get("nvext"), request.headers, role=settings.role)
    view = rt.scheduler.view
    tok = tokenizer_for(view.tokenizers.get(model, frozenset()))
    if chat:
        tokens, n_prompt = tok.chat(body.get("messages"))
    else:
        tokens, n_prompt = tok.prompt(body.get("prompt"))
    hashes = {bs: chain_hashes(tokens, bs) for bs in view.block_sizes.get(model, ())} if tokens else {}
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    headers = forward_headers(request.headers)
    headers["x-request-id"] = request_id
    labels = (model,)

    exclude: set[int] = set()
    attempts = 0
    while True:
        sel = await _select(request, rt, RoutingRequest(
            request_id=request_id, model=model, prompt_tokens=n_prompt, hashes=hashes, pin=pin,
            exclude=frozenset(exclude),
        ))
        if attempts == 0:
            rt.metrics.overhead.labels(*labels).observe(time.perf_counter() - t0)
            rt.metrics.hit_rate.labels(*labels).observe(sel.predicted_hit_rate)
        headers[HDR_WORKER] = str(sel.instance_id)
        headers[HDR_DP_RANK] = str(sel.dp_rank)
        try:
            resp = await rt.proxy.open(sel.url, path, _target_body(body, sel), headers)
        except WorkerUnreachable as exc:
            rt.scheduler.send(RequestDone(request_id))
            rt.scheduler.send(MarkUnavailable(sel.instance_id))
            attempts += 1
            if sel.pinned or attempts > settings.max_retries:
                raise ServiceUnavailable(exc.message, retry_after=1) from exc
            exclude.add(sel.instance_id)
            rt.metrics.retries.labels(*labels).inc()
            log.warning("request %s: %s; retrying elsewhere", request_id, exc.message)
            continue
        except BaseException:
            rt.scheduler.send(RequestDone(request_id))
            raise
        break

    log.info(
        "request %s → worker %s rank %d (revision %s, predicted hit %.2f)", request_id,
        sel.instance_id, sel.dp_rank, sel.revisions, sel.predicted_hit_rate,
    )
    out_headers = {"x-request-id": request_id, HDR_WORKER: str(sel.instance_id), HDR_DP_RANK: str(sel.dp_rank)}
    content_type = resp.headers.get("content-type", "application/json")
    if not stream or resp.status_code >= 400:
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            raise ServiceUnavailable(f"worker {sel.instance_id} failed: {type(exc).__name__}") from exc
        finally:
            await resp.aclose()
            rt.scheduler.send(RequestFirstToken(request_id))
            rt.scheduler.send(RequestDone(request_id))
        rt.metrics.ttft.labels(*labels).observe(time.perf_counter() - t0)
        rt.metrics.requests.labels(model, path, str(resp.status_code)).inc()
        return Response(content, status_code=resp.status_code, media_type=content_type, headers=out_headers)

    async def relay() -> AsyncIterator[bytes]:
        last: float | None = None
        status = "200"
        try:
            async for chunk in resp.aiter_raw():
                now = time.perf_counter()
                if last is None:
                    rt.scheduler.send(RequestFirstToken(request_id))
                    rt.metrics.ttft.labels(*labels).observe(now - t0)
                else:
                    rt.metrics.itl.labels(*labels).observe(now - last)
                last = now
                yield chunk
        except httpx.HTTPError as exc:
            status = "502"
            log.warning("request %s: worker stream broke: %s", request_id, type(exc).__name__)
            err = {"error": {"message": f"worker stream broke: {type(exc).__name__}",
                             "type": "service_unavailable", "param": None, "code": "worker_failed"}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        except asyncio.CancelledError:
            status = "499"
            raise
        finally:
            await resp.aclose()
            rt.scheduler.send(RequestDone(request_id))
            rt.metrics.requests.labels(model, path, status).inc()

    return StreamingResponse(
        relay(), status_code=resp.status_code, media_type=content_type, headers=out_headers,
    )


def build_api(rt: Runtime, app: FastAPI) -> None:
    """Mount the routes and the error handlers on ``app``."""
    overload = rt.settings.overload_status

    @app.exception_handler(RudderError)
    async def _rudder_error(request: Request, exc: RudderError) -> Response:
        status = overload if isinstance(exc, Overloaded) else exc.status_code
        rt.metrics.rejections.labels(_reason(exc)).inc()
        rt.metrics.requests.labels(
            getattr(request.state, "model", ""), request.url.path, str(status)
        ).inc()
        if status >= 500 and not isinstance(exc, (ServiceUnavailable, Overloaded)):
            log.error("bug: %r", exc)
        return error_response(exc, overload_status=overload)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        rt.metrics.rejections.labels("internal_error").inc()
        return error_response(RudderError("internal error"), overload_status=overload)

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

    @app.get("/health")
    async def health() -> Response:
        view = rt.scheduler.view
        body = {
            "status": "ok" if view.ready else "starting", "router_id": rt.settings.router_id,
            "workers": view.workers,
            "applied": {k: v.revision for k, v in view.applied.items()},
        }
        return JSONResponse(body, status_code=200 if view.ready else 503)

    @app.get("/live")
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
        return Response(rt.metrics.render(), media_type="text/plain; version=0.0.4")
