"""``/tokens``: the API tokens (admin role). Listing shows no secret (only hashes are stored);
revoking is audited here, in the audit log, with the admin who did it, and by the database
itself (``token_audit``, migration 0003). Tokens are created with ``rudder token create``
(the database function ``rudder_token_create``, audited the same two ways)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from controlplane.api.deps import INT64_MAX, Svc, allowed
from controlplane.api.models import AUTHENTICATED, Ignored, TokenList, TokenRevoked, operation, responses
from controlplane.audit.records import AuditEntry, AuditStage, Decision
from controlplane.auth import Action, Principal
from controlplane.protocol.errors import InvalidRequest, NotFound

router = APIRouter(tags=["tokens"])

Admin = Annotated[Principal, Depends(allowed(Action.ADMIN))]


@router.get("/tokens", response_model=TokenList, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED), openapi_extra=operation(Action.ADMIN))
async def list_tokens(_: Admin, svc: Svc) -> dict[str, Any]:
    """Every API token, oldest first: id, name, role, created, expiry, revocation (no secret)."""
    return {"tokens": await svc.cp.tokens.list()}


@router.post("/tokens/{token_id}/revoke", response_model=TokenRevoked, response_model_exclude_unset=True,
             responses=responses(*AUTHENTICATED, 400, 404),
             openapi_extra=operation(Action.ADMIN, body=Ignored, required=False))
async def revoke_token(admin: Admin, svc: Svc, request: Request, token_id: int) -> dict[str, Any]:
    """Revoke a token at once (on every replica within 5 s); a revoked token stays revoked."""
    if not 1 <= token_id <= INT64_MAX:
        raise InvalidRequest(f"token_id must be in 1..{INT64_MAX}", field="token_id")
    if not await svc.cp.tokens.revoke(token_id):
        raise NotFound(f"no unrevoked token {token_id}", field="token_id")
    peer = request.client.host if request.client else None
    await svc.cp.audit.append(AuditEntry(
        event_id=None, stage=AuditStage.DECISION, decision=Decision.ACCEPTED,
        reason_code="token_revoked", reason=f"API token {token_id} revoked by {admin.name}",
        actor=admin.name, roles=admin.roles, auth_method="bearer",
        source_ip=svc.gate.source_of(request) if peer else None,
        request_id=request.state.request_id, op="token_revoke", changes={"token_id": token_id},
    ))
    return {"id": token_id, "revoked": True}
