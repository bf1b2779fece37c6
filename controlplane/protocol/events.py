"""Every message on the bus: frozen, versioned pydantic models (DESIGN §2, §5, §6).

A stored event is never rewritten. Each model carries ``schema_version``; a newer reader upcasts an
older payload in ``decode_*`` (today every schema is at version 1, so the upcasters are identity;
the place to add one is marked).
"""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.protocol.errors import InvalidRequest
from controlplane.protocol.policy import CacheInput, PolicyKind, PolicyOp

U64_MAX = 2**64 - 1


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def _decode(cls: type[Any], data: bytes | str | dict[str, Any]) -> Any:
    try:
        if isinstance(data, dict):
            return cls.model_validate(data)
        return cls.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "payload"
        raise InvalidRequest(f"bad {cls.__name__} payload: {loc}: {first['msg']}", field=loc) from exc


# ---------------------------------------------------------------------------------------------
# Policy


class PolicyEvent(_Event):
    """One accepted change of a policy document. The revision comes from the stream sequence."""

    schema_version: Literal[1] = 1
    event_id: uuid.UUID
    model: str
    kind: PolicyKind
    op: PolicyOp
    expected_revision: int = Field(ge=0)
    changes: dict[str, float | int | None] = Field(default_factory=dict)
    document: dict[str, float | int]
    actor: str
    request_id: str
    at: datetime
    rollback_to: int | None = None


def decode_policy_event(data: bytes | str | dict[str, Any]) -> PolicyEvent:
    # Upcasters for schema_version < current go here.
    event: PolicyEvent = _decode(PolicyEvent, data)
    return event


class AckStatus(enum.StrEnum):
    ACK = "ACK"
    NACK = "NACK"


class ApplyAck(_Event):
    """A router's report that it applied (ACK) or refused (NACK) one policy revision."""

    schema_version: Literal[1] = 1
    router_id: str
    model: str
    kind: PolicyKind
    revision: int
    status: AckStatus
    detail: str = ""
    event_id: uuid.UUID | None = None
    effective: dict[str, float | int | None] = Field(default_factory=dict)
    at: datetime


def decode_apply_ack(data: bytes | str | dict[str, Any]) -> ApplyAck:
    ack: ApplyAck = _decode(ApplyAck, data)
    return ack


class AppliedDocument(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    revision: int
    effective: dict[str, float | int | None]
    last_nack: str | None = None
    last_nack_revision: int | None = None


class RouterRole(enum.StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class RouterStatus(_Event):
    """A router's status in the ``RUDDER_ROUTERS`` bucket, refreshed every heartbeat."""

    schema_version: Literal[1] = 1
    router_id: str
    models: list[str]
    role: RouterRole = RouterRole.AGGREGATED
    mode: str = "kv"
    url: str = ""
    cache_inputs: list[CacheInput] = Field(default_factory=list)
    startup: dict[str, dict[str, float | int | None]] = Field(default_factory=dict)
    # key: "<model>|<kind>"
    applied: dict[str, AppliedDocument] = Field(default_factory=dict)
    started_at: datetime
    heartbeat_at: datetime


def doc_key(model: str, kind: PolicyKind | str) -> str:
    return f"{model}|{PolicyKind(kind).value}"


def decode_router_status(data: bytes | str | dict[str, Any]) -> RouterStatus:
    status: RouterStatus = _decode(RouterStatus, data)
    return status


# ---------------------------------------------------------------------------------------------
# Membership


class WorkerRole(enum.StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class MembershipOp(enum.StrEnum):
    JOIN = "join"
    HEARTBEAT = "heartbeat"
    LEAVE = "leave"


class WorkerRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    instance_id: int = Field(gt=0, le=U64_MAX)
    model: str
    role: WorkerRole = WorkerRole.AGGREGATED
    url: str
    dp_size: int = Field(default=1, ge=1)
    block_size: int = Field(gt=0)
    kv_total_blocks: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)
    tokenizer: str = "rudder-bytes"
    cache_tiers: list[CacheInput] = Field(default_factory=lambda: [CacheInput.DEVICE])
    engine: str = "mock"
    started_at: datetime


class RankLoad(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    dp_rank: int = Field(default=0, ge=0)
    active_decode_blocks: int = Field(default=0, ge=0)
    active_prefill_tokens: int = Field(default=0, ge=0)
    kv_used_blocks: int = Field(default=0, ge=0)
    running: int = Field(default=0, ge=0)
    waiting: int = Field(default=0, ge=0)


class MembershipEvent(_Event):
    schema_version: Literal[1] = 1
    op: MembershipOp
    worker: WorkerRecord
    load: list[RankLoad] = Field(default_factory=list)
    at: datetime


def decode_membership_event(data: bytes | str | dict[str, Any]) -> MembershipEvent:
    event: MembershipEvent = _decode(MembershipEvent, data)
    return event


# ---------------------------------------------------------------------------------------------
# KV cache events


class StoredBlock(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    block_hash: int = Field(ge=0, le=U64_MAX)  # chain hash (identifies the prefix)
    tokens_hash: int = Field(ge=0, le=U64_MAX)  # hash of this block's tokens alone


class KvStored(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["stored"] = "stored"
    parent_hash: int | None = Field(default=None, ge=0, le=U64_MAX)
    blocks: list[StoredBlock]


class KvRemoved(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["removed"] = "removed"
    block_hashes: list[int]


class KvCleared(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["cleared"] = "cleared"


KvData = Annotated[KvStored | KvRemoved | KvCleared, Field(discriminator="type")]


class KvEvent(_Event):
    schema_version: Literal[1] = 1
    instance_id: int = Field(gt=0, le=U64_MAX)
    dp_rank: int = Field(default=0, ge=0)
    event_id: int = Field(ge=0)
    tier: CacheInput = CacheInput.DEVICE
    data: KvData


def decode_kv_event(data: bytes | str | dict[str, Any]) -> KvEvent:
    event: KvEvent = _decode(KvEvent, data)
    return event


class KvDumpRank(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    dp_rank: int = 0
    tier: CacheInput = CacheInput.DEVICE
    # Each stored block as (parent chain hash or None, chain hash, tokens hash), parents first.
    blocks: list[tuple[int | None, int, int]] = Field(default_factory=list)


class KvDumpReply(_Event):
    """Answer to a request on ``rudder.kvdump.<instance_id>``: the full cache state."""

    schema_version: Literal[1] = 1
    instance_id: int
    last_event_id: int
    ranks: list[KvDumpRank]
    partial: bool = False  # True when the agent attached late and cannot see every block


def decode_kv_dump(data: bytes | str | dict[str, Any]) -> KvDumpReply:
    reply: KvDumpReply = _decode(KvDumpReply, data)
    return reply
