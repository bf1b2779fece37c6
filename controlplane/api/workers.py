"""``/workers/{instance_id}/manifest`` and ``/workers/manifests``: what each worker may claim,
issued by an admin (issue 17). The control plane signs the manifest and publishes it on
``rudder.manifests.<instance_id>``; routers bound the worker's membership record by it. Every
issue, accepted or refused, is written to the audit log (op ``manifest_issue``)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from controlplane.api.deps import ReadPolicy, Svc, allowed, json_body
from controlplane.api.models import AUTHENTICATED, ManifestIssued, ManifestList, operation, responses
from controlplane.audit.records import AuditEntry, AuditStage, Decision
from controlplane.auth import Action, Principal
from controlplane.protocol.errors import InvalidRequest, RudderError
from controlplane.protocol.limits import U64_MAX
from controlplane.protocol.manifests import ManifestSpec, parse_spec

router = APIRouter(tags=["workers"])

Admin = Annotated[Principal, Depends(allowed(Action.ADMIN))]
OP = "manifest_issue"


@router.get("/workers/manifests", response_model=ManifestList, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED), openapi_extra=operation(Action.READ_POLICY))
async def list_manifests(_: ReadPolicy, svc: Svc) -> dict[str, Any]:
    """The last manifest issued to each worker, with whether its signature verifies."""
    return {"manifests": await svc.cp.manifests.list()}


@router.put("/workers/{instance_id}/manifest", response_model=ManifestIssued, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED, 400, 413, 415, 422),
            openapi_extra=operation(Action.ADMIN, body=ManifestSpec))
async def issue_manifest(admin: Admin, svc: Svc, request: Request, instance_id: int) -> dict[str, Any]:
    """Issue (or replace) worker ``instance_id``'s manifest: its model, role, engine, block
    size, maxima of ``dp_size`` and KV blocks, the URLs it may announce, optionally its timing
    prior. Routers cap its membership record by it."""
    entry = AuditEntry(event_id=None, stage=AuditStage.DECISION, decision=Decision.ACCEPTED,
                       actor=admin.name, roles=admin.roles, auth_method="bearer",
                       source_ip=svc.gate.source_of(request), request_id=request.state.request_id, op=OP)
    try:
        if not 1 <= instance_id <= U64_MAX:
            raise InvalidRequest(f"instance_id must be in 1..{U64_MAX}", field="instance_id")
        spec = parse_spec(await json_body(request, svc.cp.settings.max_body_bytes))
    except RudderError as exc:
        await svc.cp.audit.append(dataclasses.replace(
            entry, decision=Decision.REJECTED, reason_code=exc.code, reason=exc.message[:500],
            changes={"instance_id": instance_id}))
        raise
    manifest, seq = await svc.cp.manifests.issue(instance_id, spec, actor=admin.name)
    issued = manifest.model_dump(mode="json")
    await svc.cp.audit.append(dataclasses.replace(
        entry, reason_code="manifest_issued", model=spec.model, new_revision=seq,
        reason=f"manifest of worker {instance_id} issued by {admin.name} (revision {seq})",
        changes={"instance_id": instance_id}, after=issued))
    return {"instance_id": instance_id, "revision": seq, "manifest": issued}
