"""``/decisions/{request_id}``: why a request went where it went (the routers' sampled records)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from controlplane.api.deps import ReadPolicy, Svc
from controlplane.api.models import AUTHENTICATED, Decisions, operation, responses
from controlplane.auth import Action

router = APIRouter(tags=["decisions"])


@router.get("/decisions/{request_id}", response_model=Decisions, response_model_exclude_unset=True,
            responses=responses(*AUTHENTICATED, 404), openapi_extra=operation(Action.READ_POLICY))
async def decisions(request_id: Annotated[str, Path(min_length=1, max_length=128)], _: ReadPolicy,
                    svc: Svc) -> dict[str, Any]:
    """The routers' records of the request's selection: every candidate with each term of its
    predicted-time cost, the chosen worker and why, then the measured TTFT and cached tokens
    (asked of the live routers over the bus; 404 when none kept one: see
    ``RUDDER_DECISION_SAMPLE``)."""
    return await svc.cp.decisions.find(request_id)
