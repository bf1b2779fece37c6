"""``/routers``, ``/workers``, ``/routers/acks``: the live fleet as the control plane sees it,
and what each router reported applying."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter

from controlplane.api.deps import ReadAudit, ReadPolicy, Svc
from controlplane.api.models import AUTHENTICATED, Acks, Routers, Workers, operation, responses
from controlplane.auth import Action
from controlplane.protocol.policy import parse_kind

router = APIRouter(tags=["fleet"])


@router.get("/routers", response_model=Routers, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED), openapi_extra=operation(Action.READ_POLICY))
async def routers(_: ReadPolicy, svc: Svc, model: str | None = None) -> dict[str, Any]:
    """Live routers: models, mode, cache inputs, applied revisions, calibration; and each
    document's head revision."""
    return await svc.cp.queries.routers(model)


@router.get("/workers", response_model=Workers, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED), openapi_extra=operation(Action.READ_POLICY))
async def workers(_: ReadPolicy, svc: Svc, model: str | None = None) -> dict[str, Any]:
    """Live workers with their last load report."""
    return {"workers": svc.cp.queries.workers(model)}


@router.get("/routers/acks", response_model=Acks, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED, 400, 422), openapi_extra=operation(Action.READ_AUDIT))
async def acks(_: ReadAudit, svc: Svc, router_id: str | None = None, model: str | None = None,
               kind: str | None = None, at: datetime | None = None, limit: int = 100) -> dict[str, Any]:
    """Routers' ACK/NACKs, newest first; with ``at``, the newest per router and document at or
    before that time."""
    k = parse_kind(kind).value if kind else None
    return {"acks": await svc.cp.audit.acks(router_id=router_id, model=model, kind=k, at=at, limit=limit)}
