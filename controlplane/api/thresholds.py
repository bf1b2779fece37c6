"""``/router_policy/busy_threshold`` (alias ``/busy_threshold``): the compatible busy-threshold
API. A POST whose thresholds are all null and that unsets nothing is a read."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from controlplane.api.deps import ReadPolicy, Svc, Write
from controlplane.api.models import AUTHENTICATED, Thresholds, ThresholdsWritten, answer, operation, responses
from controlplane.auth import Action
from controlplane.protocol.errors import InvalidRequest
from controlplane.protocol.requests import ThresholdsUpdate

router = APIRouter(tags=["thresholds"])

PATHS = ("/router_policy/busy_threshold", "/busy_threshold")


async def get_thresholds(_: ReadPolicy, svc: Svc, model: str) -> dict[str, Any]:
    """A model's busy thresholds."""
    return await svc.cp.queries.thresholds(model)


async def post_thresholds(w: Write) -> dict[str, Any] | JSONResponse:
    """Set or unset thresholds; thresholds not named keep their value (the control plane merges
    with the head and retries its own compare-and-set unless ``expected_revision`` is given)."""
    ctx, body, svc = w.ctx, w.body, w.svc
    result = await svc.metrics.decision(svc.cp.writes.set_thresholds(ctx, body))
    if result is None:  # every threshold null and nothing to unset: a read
        ctx.authorize(Action.READ_POLICY)
        model = body.field("model")
        if not isinstance(model, str):
            raise InvalidRequest("model is required", field="model")
        return await svc.cp.queries.thresholds(model)
    return answer({"model": result.model, "revision": result.revision, "thresholds": result.document,
                   "changed": result.changed, "event_id": str(result.event_id) if result.event_id else None,
                   "dry_run": result.dry_run})


for path in PATHS:
    router.add_api_route(path, get_thresholds, methods=["GET"], response_model=Thresholds,
                         response_model_exclude_unset=True, responses=responses(*AUTHENTICATED, 400),
                         openapi_extra=operation(Action.READ_POLICY))
    router.add_api_route(path, post_thresholds, methods=["POST"], response_model=ThresholdsWritten | Thresholds,
                         response_model_exclude_unset=True,
                         responses=responses(*AUTHENTICATED, 400, 404, 409, 413, 415, 422),
                         openapi_extra=operation(Action.WRITE_POLICY, body=ThresholdsUpdate))
