"""The admin API's assembly: the routers of each noun, the middleware, /openapi.json, and the
one error mapping: every error a request can meet becomes a RudderError (a FastAPI validation
error an InvalidRequest, a routing 404/405 a NotFound/MethodNotAllowed, anything else a bare
RudderError, logged as the bug it is), answered as ``{"error": {...}}`` with its class's status,
here and nowhere else.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from controlplane.api import audit, decisions, fleet, health, policy, thresholds, tokens, ui, workers
from controlplane.api.deps import Gate, Services, clean_query
from controlplane.api.models import DECLARED_ONLY, ERRORS, REF, ErrorBody
from controlplane.api.observe import BehindReadsCollector, BusDropsCollector, Metrics, ObserveMiddleware
from controlplane.protocol.errors import (
    Forbidden,
    HeadersTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    RudderError,
    ServiceUnavailable,
    Unauthenticated,
    UnsupportedMediaType,
    ValidationFailed,
    error_json,
)
from controlplane.protocol.requests import WRITE_REQUESTS

if TYPE_CHECKING:
    from controlplane.server import ControlPlane

log = logging.getLogger(__name__)

ROUTERS = (policy.router, thresholds.router, fleet.router, workers.router, audit.router, decisions.router,
           tokens.router, health.router, ui.router)

#: The error class of each status Starlette's own HTTPException can carry.
BY_STATUS: dict[int, type[RudderError]] = {cls.status_code: cls for cls in (
    InvalidRequest, Unauthenticated, Forbidden, NotFound, RequestTimeout, PayloadTooLarge,
    UnsupportedMediaType, ValidationFailed, RateLimited, HeadersTooLarge, ServiceUnavailable,
)}


def error_response(exc: RudderError, request_id: str | None = None) -> Response:
    headers = {}
    if isinstance(exc, (ServiceUnavailable, RateLimited)):
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, MethodNotAllowed):
        headers["Allow"] = ", ".join(exc.allow)
    if request_id:
        headers["X-Request-Id"] = request_id
    return Response(error_json({"error": exc.to_dict()}), status_code=exc.status_code, headers=headers,
                    media_type="application/json")


def as_rudder_error(request: Request, exc: Exception) -> RudderError:
    """The one mapping of everything a request can raise to the error tree."""
    if isinstance(exc, RudderError):
        return exc
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": ["query"], "msg": "invalid"}
        field = ".".join(str(p) for p in first["loc"][1:]) or "query"
        return InvalidRequest(f"{field}: {first['msg']}", field=field)
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 405:
            return MethodNotAllowed(str(exc.detail), allow=allowed_methods(request))
        cls = BY_STATUS.get(exc.status_code)
        if cls is not None:
            return cls(str(exc.detail))
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return RudderError("internal error (a bug); see the control-plane log")


def allowed_methods(request: Request) -> list[str]:
    """The methods the routes of the request's path serve (Starlette's own ``Allow`` names only
    the first route it tried)."""
    methods: set[str] = set()
    for router in ROUTERS:
        for route in router.routes:
            if isinstance(route, APIRoute) and route.matches(request.scope)[0] is not Match.NONE:
                methods.update(route.methods or ())
    return sorted(methods)


async def on_error(request: Request, exc: Exception) -> Response:
    return error_response(as_rudder_error(request, exc), getattr(request.state, "request_id", None))


def openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, plus what FastAPI cannot see: the write bodies (read and checked by the
    write path, not by FastAPI), the bearer scheme, and no FastAPI validation-error shape (a bad
    parameter is answered 400 with the one error body)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, description=app.description,
                           routes=app.routes, tags=app.openapi_tags)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        _, defs = models_json_schema([(m, "validation") for m in (*WRITE_REQUESTS, *DECLARED_ONLY)],
                                     ref_template=REF)
        schemas.update(defs.get("$defs", {}))
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for item in spec["paths"].values():
            for op in item.values():
                answer = op["responses"].get("422", {})
                if "HTTPValidationError" in str(answer.get("content", "")):
                    del op["responses"]["422"]
                # Every route checks its query string (clean_query): an unknown parameter or a
                # control character is answered 400, on every route.
                op["responses"].setdefault("400", {
                    "description": ERRORS[400],
                    "content": {"application/json": {"schema": {"$ref": REF.format(model=ErrorBody.__name__)}}}})
                op["responses"] = dict(sorted(op["responses"].items()))
        spec["components"]["securitySchemes"] = {"bearer": {
            "type": "http", "scheme": "bearer", "description": "An API token (`rudder token create`)."}}
        app.openapi_schema = spec
    return app.openapi_schema


def build_app(cp: ControlPlane, *, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="Rudder admin API", version="1", lifespan=lifespan,
                  description="The only write path for router policy. See docs/api.md.")
    metrics = Metrics()
    metrics.registry.register(BusDropsCollector(
        lambda: dict(cp.fleet.drops.totals) if hasattr(cp, "fleet") else {}
    ))
    metrics.registry.register(BehindReadsCollector(lambda: cp.bus.behind_reads if hasattr(cp, "bus") else 0))
    cp.on_audit_append = metrics.observe_audit_append
    app.state.services = Services(cp=cp, metrics=metrics, gate=Gate(cp))
    app.add_middleware(ObserveMiddleware, metrics=metrics)
    for error in (RudderError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(error, on_error)
    for router in ROUTERS:
        app.include_router(router, dependencies=[Depends(clean_query)])
    app.openapi = lambda: openapi(app)  # type: ignore[method-assign]
    return app
