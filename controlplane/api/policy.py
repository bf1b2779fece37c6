"""``/router_policy``: the documents, their history, and the writes (patch, rollback,
calibration reset), each handed to the write path with the caller and the body as read."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from controlplane.api.deps import ReadPolicy, Svc, Write
from controlplane.api.models import AUTHENTICATED, Documents, History, WriteAnswer, answer, operation, responses
from controlplane.auth import Action
from controlplane.protocol.policy import parse_kind
from controlplane.protocol.requests import CalibrationReset, PolicyPatch, PolicyRollback

router = APIRouter(tags=["policy"])

#: What a write can answer besides 200.
WRITE = (*AUTHENTICATED, 400, 409, 413, 415, 422)


@router.get("/router_policy", response_model=Documents, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED), openapi_extra=operation(Action.READ_POLICY))
async def list_policy(_: ReadPolicy, svc: Svc, model: str | None = None) -> dict[str, Any]:
    """Every policy document (or one model's: both kinds), with each live router's applied revision."""
    return {"documents": await svc.cp.queries.documents(model)}


@router.patch("/router_policy", response_model=WriteAnswer, response_model_exclude_unset=True,
              responses=responses(*WRITE), openapi_extra=operation(Action.WRITE_POLICY, body=PolicyPatch))
async def patch_policy(w: Write) -> JSONResponse:
    """Set or remove overrides (``parameters``), or remove them all (``reset: true``), with
    compare-and-set on ``expected_revision``."""
    return answer((await w.svc.metrics.decision(w.svc.cp.writes.patch(w.ctx, w.body))).to_dict())


@router.get("/router_policy/history", response_model=History, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED, 400, 422), openapi_extra=operation(Action.READ_POLICY))
async def history(_: ReadPolicy, svc: Svc, model: str, kind: str = "selection", limit: int = 64) -> dict[str, Any]:
    """A document's revisions, newest first."""
    k = parse_kind(kind)
    return {"model": model, "kind": k.value, "revisions": await svc.cp.queries.history(model, k, limit)}


@router.post("/router_policy/rollback", response_model=WriteAnswer, response_model_exclude_unset=True,
             responses=responses(*WRITE, 404), openapi_extra=operation(Action.WRITE_POLICY, body=PolicyRollback))
async def rollback(w: Write) -> JSONResponse:
    """Restore an older revision's document as a new forward revision (``op`` = ``rollback``)."""
    return answer((await w.svc.metrics.decision(w.svc.cp.writes.rollback(w.ctx, w.body))).to_dict())


@router.post("/router_policy/calibration/reset", response_model=WriteAnswer, response_model_exclude_unset=True,
             responses=responses(*WRITE), openapi_extra=operation(Action.WRITE_POLICY, body=CalibrationReset))
async def reset_calibration(w: Write) -> JSONResponse:
    """Reset every router's timing fit of a model: the selection document's ``calibration_epoch``
    becomes the head's + 1 (a patch; retried when another write gets in between)."""
    return answer((await w.svc.metrics.decision(w.svc.cp.writes.reset_calibration(w.ctx, w.body))).to_dict())
