"""``/audit``: the audit records, their verification (hash chains and signed checkpoints) and
the reconciliation of the policy stream against them."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Query

from controlplane.api.deps import ReadAudit, Svc
from controlplane.api.models import (
    AUTHENTICATED,
    AuditPage,
    AuditRecord,
    Ignored,
    Reconciliation,
    Verification,
    operation,
    responses,
)
from controlplane.auth import Action
from controlplane.checkpoints import verify_chains
from controlplane.protocol.errors import InvalidRequest, NotFound

router = APIRouter(tags=["audit"])

DECISIONS = ("accepted", "rejected", "pending")


@router.get("/audit", response_model=AuditPage, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED, 400), openapi_extra=operation(Action.READ_AUDIT))
async def audit_log(
    _: ReadAudit, svc: Svc, model: str | None = None, kind: str | None = None, actor: str | None = None,
    decision: str | None = Query(None, json_schema_extra={"enum": list(DECISIONS)}),
    since: datetime | None = None, until: datetime | None = None, event_id: uuid.UUID | None = None,
    cursor: str | None = None, limit: int = Query(100, json_schema_extra={"minimum": 1, "maximum": 1000}),
) -> dict[str, Any]:
    """Audit records, newest first; ``next_cursor`` pages on."""
    if decision is not None and decision not in DECISIONS:
        raise InvalidRequest("decision must be accepted, rejected or pending", field="decision")
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit must be in 1..1000", field="limit")
    rows, next_cursor = await svc.cp.audit.query(
        model=model, kind=kind, actor=actor, decision=decision, since=since, until=until,
        event_id=event_id, cursor=cursor, limit=limit)
    return {"items": [r.to_dict() for r in rows], "next_cursor": next_cursor}


@router.get("/audit/verify", response_model=Verification, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED), openapi_extra=operation(Action.READ_AUDIT))
async def audit_verify(_: ReadAudit, svc: Svc) -> dict[str, Any]:
    """Both hash chains against the database and every signed checkpoint; ``head`` is what was
    verified (keep it elsewhere)."""
    return await verify_chains(svc.cp.audit, svc.cp.checkpoints)


@router.post("/audit/reconcile", response_model=Reconciliation, response_model_exclude_unset=True,
             responses=responses(*AUTHENTICATED),
             openapi_extra=operation(Action.READ_AUDIT, body=Ignored, required=False))
async def audit_reconcile(_: ReadAudit, svc: Svc) -> dict[str, Any]:
    """Reconcile the policy stream with the audit log now (the reconciler also runs periodically)."""
    report = await svc.cp.reconciler.check()
    return report.to_dict()


@router.get("/audit/{audit_id}", response_model=AuditRecord, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED, 400, 404), openapi_extra=operation(Action.READ_AUDIT))
async def audit_show(_: ReadAudit, svc: Svc, audit_id: int) -> dict[str, Any]:
    """One audit record."""
    row = await svc.cp.audit.get(audit_id)
    if row is None:
        raise NotFound(f"no audit record {audit_id}", field="id")
    return dict(row.to_dict())
