"""``/healthz``, ``/readyz``, ``/metrics``: unauthenticated, for probes and scrapers."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.api.deps import Svc
from controlplane.api.models import ERRORS, REF, ErrorBody, Health, Readiness, operation, responses
from controlplane.protocol.errors import RudderError

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, responses=responses(500), openapi_extra=operation(None))
async def healthz() -> dict[str, str]:
    """200 while the process runs."""
    return {"status": "ok"}


@router.get("/readyz", response_model=None, openapi_extra=operation(None), responses={
    200: {"model": Readiness, "description": "NATS, the streams and PostgreSQL answer"},
    503: {"model": Readiness, "description": "a check failed (named in `checks`)"},
    **responses(500)})
async def readyz(svc: Svc) -> JSONResponse:
    """Whether NATS, the streams and PostgreSQL answer."""
    # Each check is "ok" or a fixed word ("unavailable", "disconnected"): an unauthenticated
    # endpoint does not echo database error text (it is in the log).
    checks = await svc.cp.readiness()
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)


@router.get("/metrics", response_class=PlainTextResponse, openapi_extra=operation(None), responses={
    200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
          "description": "Prometheus text exposition"},
    # Named by its content: the route's own media type (text) is not the error body's.
    500: {"content": {"application/json": {"schema": {"$ref": REF.format(model=ErrorBody.__name__)}}},
          "description": ERRORS[500]}})
async def prom(svc: Svc) -> PlainTextResponse:
    """Prometheus metrics of the admin API, the write path, the reconciler and the bus."""
    svc.metrics.observe_reconcile(svc.cp.reconciler.last_report, svc.cp.reconciler.last_run_at)
    with contextlib.suppress(RudderError):  # the bus away: the other metrics still answer
        svc.metrics.observe_documents(await svc.cp.queries.documents())
    return PlainTextResponse(generate_latest(svc.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)
