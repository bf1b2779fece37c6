"""``/tokens``: the API tokens (admin role). Listing shows no secret (only hashes are stored);
revoking is audited here, in the audit log, with the admin who did it, and by the database
itself (``token_audit``, migration 0003). Tokens are created with ``rudder token create``
(the database function ``rudder_token_create``, audited the same two ways).

A revocation is a write: like the policy writes, every refusal of one (401, 403, a bad id, 404)
is recorded in the audit log with the caller and the id it named, and a refusal that cannot be
recorded answers 503 instead.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path
from pydantic import WithJsonSchema

from controlplane.api.deps import INT64_MAX, Svc, Writer, allowed
from controlplane.api.models import AUTHENTICATED, Ignored, TokenList, TokenRevoked, operation, responses
from controlplane.audit.records import AuditEntry, AuditStage, Decision
from controlplane.auth import Action, Principal
from controlplane.protocol.errors import AuditUnavailable, InvalidRequest, NotFound, RudderError
from controlplane.writepath import RequestContext

router = APIRouter(tags=["tokens"])

Admin = Annotated[Principal, Depends(allowed(Action.ADMIN))]
#: Read as text and parsed by the route, after the caller is authorized (a bad id from a caller
#: who may not revoke is a 401/403, recorded), though documented as the integer it must be.
TokenId = Annotated[str, Path(), WithJsonSchema({"type": "integer", "minimum": 1, "maximum": INT64_MAX})]


@router.get("/tokens", response_model=TokenList, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED), openapi_extra=operation(Action.ADMIN))
async def list_tokens(_: Admin, svc: Svc) -> dict[str, Any]:
    """Every API token, oldest first: id, name, role, created, expiry, revocation (no secret)."""
    return {"tokens": await svc.cp.tokens.list()}


def _named(raw: str) -> int | str:
    """The id as the caller named it: a number if it is one, else its text (cut)."""
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 19 else raw[:64]


def _token_id(raw: str) -> int:
    named = _named(raw)
    if not isinstance(named, int) or not 1 <= named <= INT64_MAX:
        raise InvalidRequest(f"token_id must be an integer in 1..{INT64_MAX}", field="token_id")
    return named


def _entry(ctx: RequestContext, *, decision: Decision, reason_code: str, reason: str,
           token_id: int | str) -> AuditEntry:
    return AuditEntry(
        event_id=None, stage=AuditStage.DECISION, decision=decision, reason_code=reason_code,
        reason=reason, actor=ctx.actor, roles=ctx.roles, auth_method=ctx.auth_method,
        source_ip=ctx.source_ip, user_agent=ctx.user_agent, request_id=ctx.request_id,
        op="token_revoke", changes={"token_id": token_id},
    )


@router.post("/tokens/{token_id}/revoke", response_model=TokenRevoked, response_model_exclude_unset=True,
             responses=responses(*AUTHENTICATED, 400, 404),
             openapi_extra=operation(Action.ADMIN, body=Ignored, required=False))
async def revoke_token(ctx: Writer, svc: Svc, token_id: TokenId) -> dict[str, Any]:
    """Revoke a token at once (on every replica within 5 s); a revoked token stays revoked."""
    try:
        admin = ctx.authorize(Action.ADMIN)
        number = _token_id(token_id)
        if not await svc.cp.tokens.revoke(number):
            raise NotFound(f"no unrevoked token {number}", field="token_id")
    except AuditUnavailable:
        raise
    except RudderError as exc:
        await svc.cp.audit.append(_entry(ctx, decision=Decision.REJECTED, reason_code=exc.code,
                                         reason=exc.message, token_id=_named(token_id)))
        raise
    await svc.cp.audit.append(_entry(ctx, decision=Decision.ACCEPTED, reason_code="token_revoked",
                                     reason=f"API token {number} revoked by {admin.name}", token_id=number))
    return {"id": number, "revoked": True}
