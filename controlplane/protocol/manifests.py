"""Worker manifests: what the operator issued a worker, which bounds what it may claim (issue 17).

A worker's membership record is its own word. A :class:`WorkerManifest` is the operator's: issued
through the admin API (admin role, audited), signed by the control plane
(:attr:`~controlplane.protocol.signing.Purpose.MANIFEST`, with the policy key) and published on
``rudder.manifests.<instance_id>`` (stream ``RUDDER_MANIFESTS``), which only the control plane's
credential may publish to and routers may only read. A router verifies each manifest with its
policy verify keys and bounds every membership record of that worker by it (:func:`bound`):

- ``model``, ``role``, ``block_size`` and ``engine`` must be the issued ones, and the URL must
  match ``url_allow`` (the syntax of ``RUDDER_WORKER_URL_ALLOW``): otherwise the record is refused;
- ``dp_size`` and ``kv_total_blocks`` above the issued maxima are cut to them;
- an issued ``timing`` replaces whatever prior the worker advertises.

A worker without a manifest is bounded by the router's conservative defaults
(:class:`router.claims.ClaimCaps`). Pure: pydantic only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from controlplane.protocol import limits as L
from controlplane.protocol.errors import InvalidRequest, SubjectMismatch, ValidationFailed
from controlplane.protocol.events import (
    EngineTiming,
    MembershipEvent,
    ModelName,
    Timestamp,
    WorkerRole,
    _decode,
)
from controlplane.protocol.guard import UrlAllowList
from controlplane.protocol.subjects import MANIFESTS_PREFIX

MANIFEST_SCHEMA_VERSION: Literal[1] = 1


class ManifestSpec(BaseModel):
    """What an operator issues for one worker (the body of ``PUT /workers/{id}/manifest``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    model: ModelName
    role: WorkerRole = WorkerRole.AGGREGATED
    max_dp_size: int = Field(default=1, ge=1, le=L.MAX_DP_SIZE)
    block_size: int = Field(gt=0, le=L.MAX_BLOCK_SIZE)
    max_kv_blocks: int = Field(gt=0, le=L.MAX_KV_TOTAL_BLOCKS)
    engine: str = Field(default="mock", min_length=1, max_length=L.MAX_ENGINE_CHARS)
    url_allow: str = Field(min_length=1, max_length=L.MAX_URL_CHARS)
    timing: EngineTiming | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, value: Any) -> Any:
        return WorkerRole(value) if isinstance(value, str) and value in set(WorkerRole) else value

    @field_validator("url_allow")
    @classmethod
    def _url_allow(cls, value: str) -> str:
        UrlAllowList.parse(value, field="url_allow")  # raises naming the entry
        return value


class WorkerManifest(BaseModel):
    """A manifest as published: the spec, whose worker it is, who issued it and when."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = MANIFEST_SCHEMA_VERSION
    instance_id: int = Field(gt=0, le=L.U64_MAX)
    spec: ManifestSpec
    issued_by: str = Field(max_length=L.MAX_ID_CHARS)
    issued_at: Timestamp

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def decode_manifest(data: bytes | str | dict[str, Any]) -> WorkerManifest:
    """Raises InvalidRequest naming the field."""
    manifest: WorkerManifest = _decode(WorkerManifest, data)
    return manifest


def manifest_instance_id(subject: str) -> int:
    """The worker a manifest subject speaks for. Raises InvalidRequest."""
    prefix, _, tail = subject.rpartition(".")
    if prefix != MANIFESTS_PREFIX or not tail.isdigit():
        raise InvalidRequest(f"{subject!r} is not a manifest subject", field="subject")
    return int(tail)


def check_manifest_subject(subject: str, manifest: WorkerManifest) -> None:
    """A manifest speaks only for the worker of its subject. Raises SubjectMismatch."""
    if manifest_instance_id(subject) != manifest.instance_id:
        raise SubjectMismatch(f"manifest for worker {manifest.instance_id} published on {subject}",
                              field="instance_id")


def bound(event: MembershipEvent, manifest: WorkerManifest) -> tuple[MembershipEvent, list[str]]:
    """The event with its record bounded by ``manifest``, and the names of the fields cut.

    Raises ValidationFailed naming the field when the record is outside the manifest (another
    model, role, block size or engine, or a URL the manifest does not allow)."""
    rec, spec = event.worker, manifest.spec
    for field, claimed, issued in (("model", rec.model, spec.model), ("role", rec.role, spec.role),
                                   ("block_size", rec.block_size, spec.block_size),
                                   ("engine", rec.engine, spec.engine)):
        if claimed != issued:
            raise ValidationFailed(f"worker {rec.instance_id} claims {field}={claimed!r}; its manifest "
                                   f"issues {issued!r}", field=field)
    try:
        UrlAllowList.parse(spec.url_allow, field="url_allow").check(rec.url)
    except ValidationFailed as exc:
        raise ValidationFailed(f"worker {rec.instance_id}: url outside its manifest's url_allow "
                               f"({exc.message})", field="url") from exc
    update: dict[str, object] = {}
    if rec.dp_size > spec.max_dp_size:
        update["dp_size"] = spec.max_dp_size
    if rec.kv_total_blocks > spec.max_kv_blocks:
        update["kv_total_blocks"] = spec.max_kv_blocks
    cut = sorted(update)
    if spec.timing is not None and rec.timing != spec.timing:
        update["timing"] = spec.timing  # the issued prior, not the advertised one (not a "cut")
    if not update:
        return event, []
    worker = rec.model_copy(update=update)
    load = [r for r in event.load if r.dp_rank < worker.dp_size]
    return event.model_copy(update={"worker": worker, "load": load}), cut


def parse_spec(body: Any) -> ManifestSpec:
    """``body`` (decoded JSON) as a :class:`ManifestSpec`. Raises InvalidRequest (400: not an
    object) or ValidationFailed (422) naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", field="body")
    try:
        return ManifestSpec.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise ValidationFailed(f"{field}: {first['msg']}", field=field) from None
