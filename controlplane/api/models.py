"""The admin API's answers, its error body, and how a route describes itself in /openapi.json.

The write bodies are the write path's (controlplane/protocol/requests.py); a route declares its
body with :func:`operation` (the write path reads and checks it, not FastAPI: a refused body is
audited with the caller's identity like any other refusal).

Answers built here (writes, documents, history, thresholds, health) are exact: every field is
declared. Answers passed through from the stores (routers, workers, ACKs, audit rows, verify and
reconcile reports) are open: their known fields are declared (all optional), any other field is
passed through as it is, so a field added by its owner reaches the caller. Routes answer with
``response_model_exclude_unset``: a field the route did not set is not invented (no ``null`` added).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from controlplane.auth import Action
from controlplane.protocol.manifests import ManifestSpec
from controlplane.protocol.policy import PolicyKind, PolicyOp
from controlplane.protocol.requests import WriteRequest

Number = int | float

#: Where /openapi.json keeps every model's schema.
REF = "#/components/schemas/{model}"


class Exact(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- errors -----------------------------------------------------------------------------------


class ErrorDetail(Open):
    """One error; its facts (``expected_revision``, ``head_revision``, ``retry_after``,
    ``required``, ``weights``, ``routers``, ``allow`` ...) follow ``code`` and ``message``."""

    code: str = Field(description="The error class's code, e.g. revision_conflict.")
    message: str
    field: str | None = Field(default=None, description="The request field (or header) at fault.")


class ErrorBody(Exact):
    """Every error of the admin API, whatever the route (docs/api.md lists the codes)."""

    error: ErrorDetail


ERRORS: dict[int, str] = {
    400: "invalid_request: broken JSON, a wrong shape or type, a missing or bad parameter",
    401: "unauthenticated: no, unknown or revoked token (WWW-Authenticate: Bearer)",
    403: "forbidden: the token's role may not do this (`required` names the action)",
    404: "not_found: no such document revision, model, audit record or route",
    409: "revision_conflict: `expected_revision` is not the head (`head_revision` says what is)",
    413: "payload_too_large: the body is over the limit (64 KiB by default)",
    415: "unsupported_media_type: the body is not application/json",
    422: "validation_failed, capability_mismatch: an unknown field or parameter, a value out of "
         "range, NaN or Infinity; `field` names it",
    429: "rate_limited: too many failed authentications from this address (Retry-After)",
    500: "internal_error: a bug; see the control plane's log",
    503: "audit_unavailable, log_unavailable, log_ambiguous: PostgreSQL or NATS did not answer "
         "(Retry-After); nothing was changed, or, for log_ambiguous, the reconciler settles it",
}

#: Every authenticated route can answer these.
AUTHENTICATED = (401, 403, 429, 500, 503)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers of a route, each with the one error body."""
    return {status: {"model": ErrorBody, "description": ERRORS[status]} for status in sorted(statuses)}


def answer(content: dict[str, Any]) -> JSONResponse:
    """A write's answer, rendered as it is: the write path builds exactly the declared model's
    fields (``WriteAnswer``, ``ThresholdsWritten``; the Schemathesis test checks every answer
    against /openapi.json), so the hot path skips FastAPI's validation and re-serialisation of
    ``response_model``, which stays declared for the schema."""
    return JSONResponse(content)


def operation(action: Action | None, *, body: type[WriteRequest] | type[BaseModel] | None = None,
              required: bool = True) -> dict[str, Any]:
    """What /openapi.json says of a route beyond its parameters: the bearer token and the action
    its role needs (``x-rudder-action``), and the JSON body it takes (checked by the write path)."""
    extra: dict[str, Any] = {}
    if action is not None:
        extra["security"] = [{"bearer": []}]
        extra["x-rudder-action"] = action.value
    if body is not None:
        extra["requestBody"] = {"required": required, "content": {"application/json": {
            "schema": {"$ref": REF.format(model=body.__name__)}}}}
    return extra


# ---- policy -----------------------------------------------------------------------------------


class Change(Exact):
    before: Number | None
    after: Number | None


class WriteAnswer(Exact):
    """A write's outcome. ``revision`` is the new head (for a dry run, the unchanged head);
    ``changed`` is false when the write changed nothing (then nothing was published)."""

    model: str
    kind: PolicyKind
    op: PolicyOp
    revision: int
    previous_revision: int
    document: dict[str, Number] = Field(description="The document's overrides after the write.")
    changes: dict[str, Number | None] = Field(description="What the write set (null: removed).")
    diff: dict[str, Change]
    event_id: str | None
    dry_run: bool
    changed: bool


class AppliedView(Exact):
    """One live router's view of the document."""

    router_id: str
    applied_revision: int
    effective: dict[str, Number | None]
    in_sync: bool
    last_nack: str | None
    last_nack_revision: int | None


class PolicyDocument(Exact):
    model: str
    kind: PolicyKind
    revision: int
    document: dict[str, Number]
    updated_at: str | None
    actor: str | None
    routers: list[AppliedView]


class Documents(Exact):
    documents: list[PolicyDocument]


class Revision(Exact):
    """One revision of a document. A stored message that is not a valid policy event has only
    ``revision``, ``event_id``, ``op`` (null) and ``error``."""

    revision: int
    event_id: str | None
    op: PolicyOp | None
    error: str | None = None
    expected_revision: int | None = None
    actor: str | None = None
    at: str | None = None
    changes: dict[str, Number | None] | None = None
    document: dict[str, Number] | None = None
    rollback_to: int | None = None
    request_id: str | None = None
    signed_by: str | None = None


class History(Exact):
    model: str
    kind: PolicyKind
    revisions: list[Revision] = Field(description="Newest first.")


class Thresholds(Exact):
    model: str
    revision: int
    thresholds: dict[str, Number]


class ThresholdsWritten(Exact):
    model: str
    revision: int
    thresholds: dict[str, Number]
    changed: bool = Field(description="False: the merge changed nothing and nothing was published.")
    event_id: str | None
    dry_run: bool


# ---- fleet ------------------------------------------------------------------------------------


class RouterView(Open):
    router_id: str | None = None
    models: list[str] | None = None
    role: str | None = None
    mode: str | None = None
    url: str | None = None
    cache_inputs: list[str] | None = None
    applied: dict[str, dict[str, Any]] | None = Field(default=None, description=(
        '"<model>|<kind>": {revision, effective, last_nack, last_nack_revision}'))
    startup: dict[str, Any] | None = None
    heartbeat_at: str | None = None
    started_at: str | None = None
    policy_resync: dict[str, Any] | None = None
    calibration: list[dict[str, Any]] | None = None
    quarantined: list[dict[str, Any]] | None = None


class Routers(Open):
    routers: list[RouterView] | None = None
    heads: dict[str, int] | None = Field(default=None, description='"<model>|<kind>": head revision')
    rejected: list[dict[str, Any]] | None = Field(default=None, description=(
        "Router status entries dropped as unusable: {key, reason}"))


class WorkerView(Open):
    """A live worker: its membership record, when it was last seen, and its load by rank."""

    instance_id: int | None = None
    model: str | None = None
    role: str | None = None
    url: str | None = None
    dp_size: int | None = None
    block_size: int | None = None
    kv_total_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    tokenizer: str | None = None
    cache_tiers: list[str] | None = None
    engine: str | None = None
    started_at: str | None = None
    timing: dict[str, Any] | None = None
    last_seen: str | None = None
    state: str | None = Field(default=None, description="The last membership op (join, heartbeat)")
    load: list[dict[str, Any]] | None = None
    quarantined: list[dict[str, Any]] | None = Field(default=None, description=(
        'Routers that no longer believe its claims: [{"router_id", "claims": ["cache", "timing"]}]'))


class Workers(Open):
    workers: list[WorkerView] | None = None


class AckView(Open):
    id: int | None = None
    router_id: str | None = None
    model: str | None = None
    kind: str | None = None
    revision: int | None = None
    status: str | None = Field(default=None, description="ACK or NACK")
    detail: str | None = None
    event_id: str | None = None
    effective: dict[str, Any] | None = None
    at: str | None = None


class Acks(Open):
    acks: list[AckView] | None = None


class DecisionCandidate(Open):
    """One candidate of a decision: its cost and, under the time cost, each of its terms (they
    add up to ``cost_ms``; ``cache_credit_ms`` is the prefill its cached prefix saves, already
    taken off)."""

    instance_id: int | None = None
    dp_rank: int | None = None
    cost_ms: float | None = None
    overlap_blocks: int | None = None
    cached_tokens: float | None = None
    uncached_tokens: float | None = None
    queued_tokens: int | None = None
    running: int | None = None
    ttft_ms: float | None = None
    queued_prefill_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    busy_ms: float | None = None
    interference_ms: float | None = None
    decode_growth_ms: float | None = None
    arrival_wait_ms: float | None = None
    cache_credit_ms: float | None = None
    chosen: bool | None = None


class Decision(Open):
    """A router's record of one selection (router/decisions.py)."""

    request_id: str | None = None
    router_id: str | None = None
    model: str | None = None
    at: float | None = Field(default=None, description="epoch seconds")
    pool: str | None = None
    mode: str | None = None
    why: list[str] | None = Field(default=None, description=(
        "lowest_cost, tie, objective, explicit_target, busy_filter, temperature_draw or mode"))
    instance_id: int | None = None
    dp_rank: int | None = None
    cost_ms: float | None = None
    prompt_tokens: int | None = None
    candidates_total: int | None = None
    candidates: list[DecisionCandidate] | None = None
    busy: list[int] | None = None
    temperature: float | None = None
    ttft_slo_ms: float | None = None
    revisions: dict[str, int] | None = None
    measured_ttft_ms: float | None = None
    reported_cached_tokens: int | None = None
    status: str | None = None


class Decisions(Open):
    request_id: str | None = None
    decisions: list[Decision] | None = None
    unanswered: list[str] | None = Field(default=None, description="live routers that did not answer in time")


# ---- audit ------------------------------------------------------------------------------------


class AuditRecord(Open):
    """One audit row: every column of DESIGN §4, its id and its place in the hash chain."""

    event_id: str | None = None
    stage: str | None = Field(default=None, description="received or decision")
    decision: str | None = Field(default=None, description="accepted, rejected or pending")
    reason_code: str | None = None
    reason: str | None = None
    actor: str | None = None
    roles: list[str] | None = None
    auth_method: str | None = None
    source_ip: str | None = None
    user_agent: str | None = None
    request_id: str | None = None
    model: str | None = None
    kind: str | None = None
    op: str | None = None
    expected_revision: int | None = None
    head_revision: int | None = None
    new_revision: int | None = None
    changes: dict[str, Any] | None = None
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    dry_run: bool | None = None
    at: str | None = None
    id: int | None = None
    prev_hash: str | None = None
    row_hash: str | None = None


class AuditPage(Open):
    items: list[AuditRecord] | None = Field(default=None, description="Newest first.")
    next_cursor: str | None = None


class Verification(Open):
    """Both hash chains checked against the database and every signed checkpoint."""

    ok: bool | None = None
    checked: int | None = None
    chain: str | None = Field(default=None, description="The chain of the first bad row.")
    first_broken_id: int | None = None
    reason: str | None = None
    head: dict[str, Any] | None = Field(default=None, description=(
        "{audit|acks: {last_id, last_hash}} as verified: keep it elsewhere"))
    chains: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None
    bad_checkpoints: list[str] | None = None


class Reconciliation(Open):
    """The policy stream against the audit log (each finding names its revision, subject, event)."""

    ok: bool | None = None
    resolved: int | None = None
    checked_events: int | None = None
    checked_decisions: int | None = None
    retired: int | None = None
    events_without_decision: list[dict[str, Any]] | None = None
    decisions_without_event: list[dict[str, Any]] | None = None
    duplicate_decisions: list[dict[str, Any]] | None = None
    bad_signatures: list[dict[str, Any]] | None = None
    document_mismatches: list[dict[str, Any]] | None = None
    reused_msg_ids: list[dict[str, Any]] | None = None
    replayed: list[dict[str, Any]] | None = None


class TokenInfo(Exact):
    id: int
    name: str
    role: str
    created_at: str
    revoked_at: str | None
    revoked: bool
    expires_at: str | None
    expired: bool


class TokenList(Exact):
    tokens: list[TokenInfo]


class TokenRevoked(Exact):
    id: int
    revoked: bool


class ManifestIssued(Exact):
    instance_id: int
    revision: int = Field(description="The manifest's sequence on the RUDDER_MANIFESTS stream.")
    manifest: dict[str, Any] = Field(description="The manifest as signed: instance_id, spec, issued_by, issued_at.")


class ManifestView(Open):
    """The last manifest of one worker as the stream holds it."""

    subject: str | None = None
    revision: int | None = None
    verified: bool | None = Field(default=None, description=(
        "Its signature checks against the control plane's keys (routers ignore it otherwise)."))
    problem: str | None = None
    instance_id: int | None = None
    spec: dict[str, Any] | None = None
    issued_by: str | None = None
    issued_at: str | None = None
    signed_by: str | None = None


class ManifestList(Open):
    manifests: list[ManifestView] | None = None


class Ignored(Open):
    """Any JSON object, or none: the body is not read."""


# ---- health -----------------------------------------------------------------------------------


class Health(Exact):
    status: str


class Readiness(Exact):
    ready: bool
    checks: dict[str, str] = Field(description=(
        '"ok", or a fixed word ("unavailable", "disconnected"); the reason is in the log'))


#: Models only a route's ``operation`` names (FastAPI does not see them): /openapi.json adds them.
DECLARED_ONLY: tuple[type[BaseModel], ...] = (Ignored, ManifestSpec)
