"""The admin API (its own listener; the only write path). Routes are thin: they authenticate,
read the body within limits, and hand over to the write path or a query. One error mapping:
every RudderError becomes ``{"error": {...}}`` with its class's status, here and nowhere else.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.auth import Action, Principal
from controlplane.checkpoints import verify_chains
from controlplane.protocol.errors import (
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RevisionConflict,
    RudderError,
    ServiceUnavailable,
    Unauthenticated,
    UnsupportedMediaType,
)
from controlplane.protocol.policy import PolicyKind, PolicyOp, parse_kind
from controlplane.reconcile import ReconcileReport
from controlplane.writepath import Attempt, RequestContext

if TYPE_CHECKING:
    from controlplane.server import ControlPlane

log = logging.getLogger(__name__)


def error_response(exc: RudderError, request_id: str | None = None) -> JSONResponse:
    headers = {}
    if isinstance(exc, (ServiceUnavailable, RateLimited)):
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse({"error": exc.to_dict()}, status_code=exc.status_code, headers=headers)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("rudder_admin_requests", "Admin API requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("rudder_admin_request_seconds", "Admin API latency", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.writes = Counter("rudder_policy_writes", "Policy write decisions", ["decision", "code"],
                              registry=self.registry)
        # From the reconciler's last report (it runs every reconcile_interval_s).
        self.reconcile_problems = Gauge("rudder_reconcile_problems",
                                        "Findings of the last stream/audit reconciliation, by kind",
                                        ["kind"], registry=self.registry)
        self.reconcile_last_run = Gauge("rudder_reconcile_last_run_timestamp_seconds",
                                        "When the last reconciliation finished (0 = not yet)",
                                        registry=self.registry)

    def observe_reconcile(self, report: ReconcileReport | None, at: datetime | None) -> None:
        if report is None or at is None:
            return
        for kind, count in report.problems().items():
            self.reconcile_problems.labels(kind).set(count)
        self.reconcile_last_run.set(at.timestamp())


class BusDropsCollector(Collector):
    """``rudder_controlplane_bus_dropped_total{kind, reason}``: bus messages the fleet view dropped
    as hostile or malformed (read at scrape time from the running fleet view's counts)."""

    def __init__(self, totals: Callable[[], dict[tuple[str, str], int]]) -> None:
        self.totals = totals

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "rudder_controlplane_bus_dropped", "Bus messages dropped as hostile or malformed",
            labels=["kind", "reason"],
        )
        for (kind, reason), n in sorted(self.totals().items()):
            family.add_metric([kind, reason], n)
        yield family


class ObserveMiddleware:
    """Plain ASGI: a request id for every request (``X-Request-Id`` in, or a new one), echoed in
    the response, plus request counts and latency by route. (Starlette's ``BaseHTTPMiddleware``
    costs a task and two memory streams per request; this costs a closure.)"""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope.get("headers", []):
            if name == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
                break
        request_id = request_id or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["X-Request-Id"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(scope["method"], path, str(status)).inc()
            self.metrics.latency.labels(scope["method"], path).observe(time.perf_counter() - start)


def build_app(cp: ControlPlane, *, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="Rudder admin API", version="1", lifespan=lifespan,
                  description="The only write path for router policy. See docs/api.md.")
    metrics = Metrics()
    metrics.registry.register(BusDropsCollector(
        lambda: dict(cp.fleet.drops.totals) if hasattr(cp, "fleet") else {}
    ))
    max_body = cp.settings.max_body_bytes

    # ---- edges ---------------------------------------------------------------------------

    app.add_middleware(ObserveMiddleware, metrics=metrics)

    @app.exception_handler(RudderError)
    async def on_rudder_error(request: Request, exc: RudderError) -> JSONResponse:
        return error_response(exc, getattr(request.state, "request_id", None))

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": ["query"], "msg": "invalid"}
        field = ".".join(str(p) for p in first["loc"][1:]) or "query"
        return error_response(InvalidRequest(f"{field}: {first['msg']}", field=field))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = NotFound(str(exc.detail)) if exc.status_code == 404 else RudderError(str(exc.detail))
        err.status_code = exc.status_code
        return error_response(err)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(RudderError("internal error (a bug); see the control-plane log"))

    failures = cp.auth_failures
    header_cap = cp.settings.audit_header_max_chars
    proxies = [ipaddress.ip_network(p, strict=False) for p in cp.settings.trusted_proxies]

    def source_of(request: Request) -> str:
        """The caller's address: the peer's, or the last X-Forwarded-For hop if the peer is a
        trusted proxy (``trusted_proxies``; none by default, so the header is not believed)."""
        peer = request.client.host if request.client else "unknown"
        if proxies:
            try:
                trusted = any(ipaddress.ip_address(peer) in net for net in proxies)
            except ValueError:
                trusted = False
            forwarded = request.headers.get("x-forwarded-for", "").split(",")[-1].strip()
            if trusted and forwarded:
                with contextlib.suppress(ValueError):
                    return str(ipaddress.ip_address(forwarded))
        return peer

    async def authenticate(request: Request, *, audited: bool) -> Principal | Unauthenticated:
        """The caller's principal, or, when the caller audits failures (``audited``) and this is
        its source's first failure in the window, the error for the write path to audit.

        A source past its failure limit is refused before its token is even looked up. Raises
        RateLimited (429) for it and Unauthenticated for every other failure (counted, and
        written later as one row per window: AuthFailureLimiter)."""
        source = source_of(request)
        retry = failures.retry_after(source)
        if retry is not None:
            failures.refused(source)
            raise RateLimited(f"too many failed authentications from {source}; retry in {retry} s",
                              retry_after=retry)
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        error: Unauthenticated | None = None
        principal: Principal | None = None
        if scheme.lower() != "bearer" or not token.strip():
            error = Unauthenticated("missing bearer token")
        else:
            principal = await cp.tokens.authenticate(token.strip())
            if principal is None:
                error = Unauthenticated("unknown or revoked token")
        if principal is not None:
            return principal
        assert error is not None
        if failures.failed(source, audited_if_first=audited):
            return error
        raise error

    async def principal_of(request: Request) -> Principal:
        result = await authenticate(request, audited=False)
        assert isinstance(result, Principal)  # an error is only returned to an auditing caller
        return result

    async def require(request: Request, action: Action) -> Principal:
        principal = await principal_of(request)
        if not principal.can(action):
            raise Forbidden(f"role {principal.role.value} may not {action.value}", required=action.value)
        return principal

    async def write_context(request: Request) -> RequestContext:
        """Who is writing. A failed authentication is audited by the write path only when it is
        its source's first in the window; later ones are answered at once (401, or 429 past the
        limit) and written later as one row with their count (AuthFailureLimiter)."""
        result = await authenticate(request, audited=True)
        principal = result if isinstance(result, Principal) else None
        auth_error = result if isinstance(result, Unauthenticated) else None
        user_agent = request.headers.get("user-agent")
        return RequestContext(
            request_id=request.state.request_id, principal=principal, auth_error=auth_error,
            auth_method="bearer" if request.headers.get("authorization") else None,
            source_ip=source_of(request),
            user_agent=user_agent[:header_cap] if user_agent is not None else None,
        )

    async def read_json(request: Request, ctx: RequestContext, op: PolicyOp, kind: PolicyKind | None) -> Any:
        """Body within limits, as JSON. Refusals here are audited like any other."""
        try:
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                raise UnsupportedMediaType(f"content-type must be application/json, got {ctype or 'none'!r}",
                                           field="content-type")
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_body:
                raise PayloadTooLarge(f"body is {declared} bytes; the limit is {max_body}", field="body",
                                      limit=max_body)
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body:
                    raise PayloadTooLarge(f"body exceeds the limit of {max_body} bytes", field="body",
                                          limit=max_body)
                chunks.append(chunk)
            try:
                return json.loads(b"".join(chunks))  # NaN/Infinity parse, then fail validation by name
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InvalidRequest(f"body is not valid JSON: {exc}", field="body") from exc
        except RudderError as exc:
            # An unauthenticated or unauthorised caller learns that first, whatever the body.
            refused: RudderError = exc
            if ctx.auth_error is not None:
                refused = ctx.auth_error
            elif ctx.principal is not None and not ctx.principal.can(Action.WRITE_POLICY):
                refused = Forbidden(f"role {ctx.principal.role.value} may not write_policy")
            raise await cp.writes.refusal(ctx, Attempt(op=op, kind=kind), refused) from None

    def count(decision: str, code: str) -> None:
        metrics.writes.labels(decision, code).inc()

    async def counted(fn: Awaitable[Any]) -> Any:
        try:
            result = await fn
        except RudderError as exc:
            count("rejected", exc.code)
            raise
        count("accepted", "ok")
        return result

    # ---- policy --------------------------------------------------------------------------

    @app.get("/router_policy")
    async def list_policy(request: Request, model: str | None = None) -> dict[str, Any]:
        await require(request, Action.READ_POLICY)
        return {"documents": await cp.queries.documents(model)}

    @app.patch("/router_policy")
    async def patch_policy(request: Request) -> dict[str, Any]:
        ctx = await write_context(request)
        body = await read_json(request, ctx, PolicyOp.PATCH, None)
        result = await counted(cp.writes.patch(ctx, body))
        return dict(result.to_dict())

    @app.get("/router_policy/history")
    async def history(request: Request, model: str, kind: str = "selection", limit: int = 64) -> dict[str, Any]:
        await require(request, Action.READ_POLICY)
        k = parse_kind(kind)
        return {"model": model, "kind": k.value, "revisions": await cp.queries.history(model, k, limit)}

    @app.post("/router_policy/rollback")
    async def rollback(request: Request) -> dict[str, Any]:
        ctx = await write_context(request)
        body = await read_json(request, ctx, PolicyOp.ROLLBACK, None)
        result = await counted(cp.writes.rollback(ctx, body))
        return dict(result.to_dict())

    @app.post("/router_policy/calibration/reset")
    async def reset_calibration(request: Request) -> dict[str, Any]:
        """Reset every router's timing fit of a model: a patch of the selection document's
        ``calibration_epoch`` (head + 1) through the one write path, so it is validated,
        revisioned and audited like any other change; retried on a concurrent write."""
        ctx = await write_context(request)
        body = await read_json(request, ctx, PolicyOp.PATCH, PolicyKind.SELECTION)
        well_formed = isinstance(body, dict) and set(body) == {"model"} and isinstance(body["model"], str)
        for attempt in range(3):
            patch: Any = body  # not {"model": name}: the write path refuses it (and audits that)
            if well_formed:
                try:
                    head = await cp.log.head(body["model"], PolicyKind.SELECTION)
                except RudderError:
                    head = None  # a bad model name: the write path names it
                document = dict(head.event.document) if head and head.event else {}
                epoch = int(document.get("calibration_epoch", 0)) + 1
                patch = {"model": body["model"], "kind": PolicyKind.SELECTION.value,
                         "expected_revision": head.revision if head else 0,
                         "parameters": {"calibration_epoch": epoch}}
            try:
                result = await counted(cp.writes.patch(ctx, patch))
            except RevisionConflict:
                if attempt == 2:
                    raise
                continue
            return dict(result.to_dict())
        raise AssertionError("unreachable")

    async def get_thresholds(request: Request, model: str) -> dict[str, Any]:
        await require(request, Action.READ_POLICY)
        return await cp.queries.thresholds(model)

    async def post_thresholds(request: Request) -> dict[str, Any]:
        ctx = await write_context(request)
        body = await read_json(request, ctx, PolicyOp.PATCH, PolicyKind.BUSY_THRESHOLD)
        result = await counted(cp.writes.set_thresholds(ctx, body))
        if result is None:  # all null: a read
            if ctx.auth_error is not None:
                raise ctx.auth_error
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(model, str):
                raise InvalidRequest("model is required", field="model")
            return await cp.queries.thresholds(model)
        return {"model": result.model, "revision": result.revision, "thresholds": result.document,
                "changed": result.changed, "event_id": str(result.event_id) if result.event_id else None,
                "dry_run": result.dry_run}

    for path in ("/router_policy/busy_threshold", "/busy_threshold"):
        app.add_api_route(path, get_thresholds, methods=["GET"])
        app.add_api_route(path, post_thresholds, methods=["POST"])

    # ---- fleet ---------------------------------------------------------------------------

    @app.get("/routers")
    async def routers(request: Request, model: str | None = None) -> dict[str, Any]:
        await require(request, Action.READ_POLICY)
        return await cp.queries.routers(model)

    @app.get("/workers")
    async def workers(request: Request, model: str | None = None) -> dict[str, Any]:
        await require(request, Action.READ_POLICY)
        return {"workers": cp.queries.workers(model)}

    @app.get("/routers/acks")
    async def acks(request: Request, router_id: str | None = None, model: str | None = None,
                   kind: str | None = None, at: datetime | None = None, limit: int = 100) -> dict[str, Any]:
        await require(request, Action.READ_AUDIT)
        k = parse_kind(kind).value if kind else None
        return {"acks": await cp.audit.acks(router_id=router_id, model=model, kind=k, at=at, limit=limit)}

    # ---- audit ---------------------------------------------------------------------------

    @app.get("/audit")
    async def audit_log(request: Request, model: str | None = None, kind: str | None = None,
                        actor: str | None = None, decision: str | None = None,
                        since: datetime | None = None, until: datetime | None = None,
                        event_id: uuid.UUID | None = None, cursor: str | None = None,
                        limit: int = 100) -> dict[str, Any]:
        await require(request, Action.READ_AUDIT)
        if decision is not None and decision not in ("accepted", "rejected", "pending"):
            raise InvalidRequest("decision must be accepted, rejected or pending", field="decision")
        if not 1 <= limit <= 1000:
            raise InvalidRequest("limit must be in 1..1000", field="limit")
        rows, next_cursor = await cp.audit.query(
            model=model, kind=kind, actor=actor, decision=decision, since=since, until=until,
            event_id=event_id, cursor=cursor, limit=limit)
        return {"items": [r.to_dict() for r in rows], "next_cursor": next_cursor}

    @app.get("/audit/verify")
    async def audit_verify(request: Request) -> dict[str, Any]:
        await require(request, Action.READ_AUDIT)
        # The chains, and every signed checkpoint: returns the head it verified (keep it elsewhere).
        return await verify_chains(cp.audit, cp.checkpoints)

    @app.post("/audit/reconcile")
    async def audit_reconcile(request: Request) -> dict[str, Any]:
        await require(request, Action.READ_AUDIT)
        report = await cp.reconciler.check()
        return report.to_dict()

    @app.get("/audit/{audit_id}")
    async def audit_show(request: Request, audit_id: int) -> dict[str, Any]:
        await require(request, Action.READ_AUDIT)
        row = await cp.audit.get(audit_id)
        if row is None:
            raise NotFound(f"no audit record {audit_id}", field="id")
        return dict(row.to_dict())

    # ---- health --------------------------------------------------------------------------

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        # Each check is "ok" or a fixed word ("unavailable", "disconnected"): an unauthenticated
        # endpoint does not echo database error text (it is in the log).
        checks = await cp.readiness()
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom() -> PlainTextResponse:
        metrics.observe_reconcile(cp.reconciler.last_report, cp.reconciler.last_run_at)
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    return app
