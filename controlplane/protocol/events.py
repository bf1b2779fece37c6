"""Every message on the bus: frozen, versioned pydantic models (DESIGN §2, §5, §6).

A stored event is never rewritten. Each model carries ``schema_version``; a newer reader upcasts an
older payload in ``decode_*`` (today every schema is at version 1, so the upcasters are identity;
the place to add one is marked).
"""

from __future__ import annotations

import enum
import math
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controlplane.protocol import limits as L
from controlplane.protocol.errors import InvalidRequest, SubjectMismatch
from controlplane.protocol.policy import CacheInput, PolicyKind, PolicyOp
from controlplane.protocol.subjects import (
    MAX_MODEL_NAME_BYTES,
    acks_subject,
    kv_subject,
    membership_subject,
    policy_subject,
    restore_subject,
    router_load_subject,
    router_status_key,
)

U64_MAX = L.U64_MAX
# Every timestamp on the bus carries its time zone: a naive one is refused at decode (comparing it
# with an aware one raises, which once made every PATCH answer 500).
Timestamp = AwareDatetime
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME_BYTES)]
RouterId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
Count = Annotated[int, Field(ge=0, le=L.MAX_LOAD_VALUE)]
Hash64 = Annotated[int, Field(ge=0, le=U64_MAX)]
Rank = Annotated[int, Field(ge=0, lt=L.MAX_DP_SIZE)]


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude=self._absent()).encode()

    def _absent(self) -> Any:
        """What the payload leaves out (pydantic's ``exclude``): a later schema's optional field
        left empty, so that the payload is the earlier schema exactly, which a reader not yet
        upgraded (unknown keys forbidden) reads. None: nothing."""
        return None


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
    model: ModelName
    kind: PolicyKind
    op: PolicyOp
    expected_revision: int = Field(ge=0)
    changes: dict[str, float | int | None] = Field(default_factory=dict, max_length=L.MAX_DOCUMENT_KEYS)
    document: dict[str, float | int] = Field(max_length=L.MAX_DOCUMENT_KEYS)
    actor: str = Field(max_length=L.MAX_ID_CHARS)
    request_id: str = Field(max_length=L.MAX_ID_CHARS)
    at: Timestamp
    rollback_to: int | None = None


def decode_policy_event(data: bytes | str | dict[str, Any]) -> PolicyEvent:
    # Upcasters for schema_version < current go here.
    event: PolicyEvent = _decode(PolicyEvent, data)
    return event


class RestoreRequest(_Event):
    """A router's question on ``rudder.restore.<router_id>``: the last document the control plane
    wrote for (model, kind). ``nonce`` is fresh per question and comes back signed, so an old
    answer cannot be replayed."""

    schema_version: Literal[1] = 1
    router_id: RouterId
    model: ModelName
    kind: PolicyKind
    nonce: str = Field(min_length=16, max_length=64)


class PolicyRestored(_Event):
    """The control plane's answer: the document of the newest revision its audit log says it
    wrote (``revision`` 0 and ``{}``: none), for the asking router and nonce."""

    schema_version: Literal[1] = 1
    router_id: RouterId
    model: ModelName
    kind: PolicyKind
    nonce: str = Field(min_length=16, max_length=64)
    revision: int = Field(ge=0)
    event_id: uuid.UUID | None = None
    document: dict[str, float | int] = Field(max_length=L.MAX_DOCUMENT_KEYS)


class SignedRestore(_Event):
    """:class:`PolicyRestored` as signed bytes: ``payload`` is its JSON, ``key_id`` and
    ``signature`` the policy key's signature over ``rudder.restore.<router_id>`` and the payload
    (core request/reply carries no headers through :class:`bus.client.Message.respond`)."""

    payload: str = Field(max_length=64 * 1024)
    key_id: str = Field(max_length=64)
    signature: str = Field(max_length=128)


def decode_restore_request(data: bytes | str | dict[str, Any]) -> RestoreRequest:
    request: RestoreRequest = _decode(RestoreRequest, data)
    return request


def decode_signed_restore(data: bytes | str | dict[str, Any]) -> SignedRestore:
    signed: SignedRestore = _decode(SignedRestore, data)
    return signed


def decode_policy_restored(data: bytes | str | dict[str, Any]) -> PolicyRestored:
    restored: PolicyRestored = _decode(PolicyRestored, data)
    return restored


def check_restore_subject(subject: str, request: RestoreRequest) -> None:
    """``rudder.restore.<router_id>`` must name the asking router."""
    if subject != restore_subject(request.router_id):
        raise _mismatch("restore request", "router_id", subject, request.router_id, subject)


class AckStatus(enum.StrEnum):
    ACK = "ACK"
    NACK = "NACK"


class ApplyAck(_Event):
    """A router's report that it applied (ACK) or refused (NACK) one policy revision."""

    schema_version: Literal[1] = 1
    router_id: RouterId
    model: ModelName
    kind: PolicyKind
    revision: int = Field(ge=0)
    status: AckStatus
    detail: str = Field(default="", max_length=L.MAX_DETAIL_CHARS)
    event_id: uuid.UUID | None = None
    effective: dict[str, float | int | None] = Field(default_factory=dict, max_length=L.MAX_DOCUMENT_KEYS)
    at: Timestamp


def decode_apply_ack(data: bytes | str | dict[str, Any]) -> ApplyAck:
    ack: ApplyAck = _decode(ApplyAck, data)
    return ack


class AppliedDocument(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    revision: int = Field(ge=0)
    effective: dict[str, float | int | None] = Field(max_length=L.MAX_DOCUMENT_KEYS)
    last_nack: str | None = Field(default=None, max_length=L.MAX_DETAIL_CHARS)
    last_nack_revision: int | None = None


class RouterRole(enum.StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class PolicyResync(BaseModel):
    """The last time a router found ``RUDDER_POLICY`` gone backwards and re-synced."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    at: Timestamp
    reason: str = Field(max_length=L.MAX_DETAIL_CHARS)
    count: int = Field(ge=1)


class WorkerCalibration(BaseModel):
    """One worker's timing model as a router fitted it (issue 9), in its status."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str
    instance_id: int
    source: str  # "fitted"; "scaled" or "pooled" before (router.calibration); or the prior's source
    prefill_ms: tuple[float, float, float]
    decode_ms: tuple[float, float, float]
    # ms of a first token, and of a decode step, per request running on the worker (router.cost.time's
    # r and dn; decision 110).
    running_ms: float = 0.0
    decode_running_ms: float = 0.0
    prefill_fitted: bool = False
    decode_fitted: bool = False
    prefill_samples: int = 0
    decode_samples: int = 0
    ttft_mae_ms: float | None = None
    ttft_p90_error_ms: float | None = None


class WorkerQuarantine(BaseModel):
    """A worker whose claims a router no longer believes (issue 17), in its status: ``cache``, its
    KV claims (no cache credit); ``timing``, its claimed timing prior (the router's own is used)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str
    instance_id: int
    cache: bool = False
    timing: bool = False


class RouterStatus(_Event):
    """A router's status in the ``RUDDER_ROUTERS`` bucket, refreshed every heartbeat."""

    schema_version: Literal[1] = 1
    router_id: RouterId
    models: list[ModelName] = Field(max_length=L.MAX_ROUTER_MODELS)
    role: RouterRole = RouterRole.AGGREGATED
    mode: str = Field(default="kv", max_length=32)
    url: str = Field(default="", max_length=L.MAX_URL_CHARS)
    cache_inputs: list[CacheInput] = Field(default_factory=list, max_length=L.MAX_CACHE_TIERS)
    startup: dict[str, dict[str, float | int | None]] = Field(default_factory=dict, max_length=8)
    # key: "<model>|<kind>"
    applied: dict[str, AppliedDocument] = Field(
        default_factory=dict, max_length=len(PolicyKind) * L.MAX_ROUTER_MODELS
    )
    started_at: Timestamp
    heartbeat_at: Timestamp
    policy_resync: PolicyResync | None = None
    # Per-worker timing fits of the router's time cost (optional; absent from older routers).
    calibration: list[WorkerCalibration] = Field(default_factory=list, max_length=L.MAX_ROUTER_MODELS)
    # Workers whose claims it no longer believes (optional; absent from older routers).
    quarantined: list[WorkerQuarantine] = Field(default_factory=list, max_length=L.MAX_ROUTER_MODELS)


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


class EngineTiming(BaseModel):
    """The engine's own timing model, as its membership record advertises it (issue 9): the
    router's prior for that worker until it has fitted one from what it observed.

    Per engine step, in milliseconds: prefill ``p0 + p1·N + p2·N²`` for N uncached tokens computed
    in the step (chunked at ``max_num_batched_tokens``), decode ``d0 + d1·u + d2·u²`` at KV usage
    u ∈ [0, 1], at least ``decode_min_ms``. ``source`` says where the numbers come from
    (``mock``: the mock's own formula divided by its speed-up ratio; ``vllm-default``: a generic
    prior for a vLLM engine). ``version`` is this object's own schema version."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: Literal[1] = 1
    source: str = Field(default="mock", max_length=64)
    prefill_ms: tuple[float, float, float]
    decode_ms: tuple[float, float, float]
    decode_min_ms: float = Field(default=0.0, ge=0)

    @field_validator("prefill_ms", "decode_ms")
    @classmethod
    def _finite(cls, value: tuple[float, float, float]) -> tuple[float, float, float]:
        if not all(math.isfinite(v) for v in value):
            raise ValueError("coefficients must be finite")
        return value


# DESIGN §6's formula (the reference simulator's fit of vLLM on one GPU): the prior of an engine that
# advertises nothing better (a vLLM worker), and of a schema 1 record (no timing at all).
DEFAULT_PREFILL_MS = (16.50142, 1.518344e-2, 4.209989e-7)
DEFAULT_DECODE_MS = (5.74, 54.01, -25.74)
DEFAULT_DECODE_MIN_MS = 1.0


class WorkerRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    instance_id: int = Field(gt=0, le=U64_MAX)
    model: ModelName
    role: WorkerRole = WorkerRole.AGGREGATED
    url: str = Field(min_length=1, max_length=L.MAX_URL_CHARS)
    dp_size: int = Field(default=1, ge=1, le=L.MAX_DP_SIZE)
    block_size: int = Field(gt=0, le=L.MAX_BLOCK_SIZE)
    kv_total_blocks: int = Field(gt=0, le=L.MAX_KV_TOTAL_BLOCKS)
    max_num_batched_tokens: int = Field(gt=0, le=L.MAX_BATCHED_TOKENS)
    tokenizer: str = Field(default="rudder-bytes", min_length=1, max_length=L.MAX_TOKENIZER_CHARS)
    cache_tiers: list[CacheInput] = Field(
        default_factory=lambda: [CacheInput.DEVICE], max_length=L.MAX_CACHE_TIERS
    )
    engine: str = Field(default="mock", max_length=L.MAX_ENGINE_CHARS)
    started_at: Timestamp
    # Since membership schema 2; absent in schema 1 records (the router then uses its default).
    timing: EngineTiming | None = None


class RankLoad(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    dp_rank: Rank = 0
    active_decode_blocks: Count = 0
    active_prefill_tokens: Count = 0
    kv_used_blocks: Count = 0
    running: Count = 0
    waiting: Count = 0


MEMBERSHIP_SCHEMA_VERSION = 2


class MembershipEvent(_Event):
    """Schema 2 adds ``worker.timing`` (optional). A reader of schema 2 reads schema 1 events
    unchanged (no timing); a schema 1 reader refuses schema 2 events, so upgrade routers (the
    readers) before workers. An event without timing is written as schema 1, so a worker that
    advertises no timing stays readable by old routers."""

    schema_version: Literal[1, 2] = 1
    op: MembershipOp
    worker: WorkerRecord
    load: list[RankLoad] = Field(default_factory=list, max_length=L.MAX_DP_SIZE)
    # The worker's own clock: shown, never used for liveness (the receiver's clock decides).
    at: Timestamp

    @model_validator(mode="after")
    def _ranks(self) -> MembershipEvent:
        for i, rank in enumerate(self.load):
            if rank.dp_rank >= self.worker.dp_size:
                raise ValueError(
                    f"load.{i}.dp_rank={rank.dp_rank} is not below worker.dp_size={self.worker.dp_size}"
                )
        return self

    @model_validator(mode="after")
    def _version(self) -> MembershipEvent:
        if self.worker.timing is not None and self.schema_version < 2:
            object.__setattr__(self, "schema_version", MEMBERSHIP_SCHEMA_VERSION)
        return self

    def _absent(self) -> Any:
        return {"worker": {"timing"}} if self.worker.timing is None else None  # schema 1


def decode_membership_event(data: bytes | str | dict[str, Any]) -> MembershipEvent:
    # Schema 1 → 2: ``worker.timing`` is absent (None); nothing to rewrite.
    event: MembershipEvent = _decode(MembershipEvent, data)
    return event


# ---------------------------------------------------------------------------------------------
# KV cache events


class StoredBlock(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    block_hash: Hash64  # chain hash (identifies the prefix)
    tokens_hash: Hash64  # hash of this block's tokens alone


class KvStored(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["stored"] = "stored"
    parent_hash: int | None = Field(default=None, ge=0, le=U64_MAX)
    blocks: list[StoredBlock] = Field(max_length=L.MAX_KV_EVENT_BLOCKS)


class KvRemoved(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["removed"] = "removed"
    block_hashes: list[Hash64] = Field(max_length=L.MAX_KV_EVENT_BLOCKS)


class KvCleared(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["cleared"] = "cleared"


KvData = Annotated[KvStored | KvRemoved | KvCleared, Field(discriminator="type")]


KV_SCHEMA_VERSION = 2


class _ProcessStamped(_Event):
    """Schema 2 of the KV events and dumps adds ``started_at``: the worker process's own stamp,
    its membership record's ``started_at``. A worker restarted under its instance id numbers its
    events from 1 again; the stamp tells a router which process an event or a dump comes from, so
    a late one of a dead process never lands in its successor's index. A reader of schema 2 reads
    schema 1 unchanged (no stamp: taken as today); a schema 1 reader refuses schema 2, so upgrade
    routers (the readers) before workers, as for membership schema 2. Without a stamp the payload
    is written as schema 1."""

    schema_version: Literal[1, 2] = 1
    started_at: Timestamp | None = None

    @model_validator(mode="after")
    def _version(self) -> _ProcessStamped:
        if self.started_at is not None and self.schema_version < 2:
            object.__setattr__(self, "schema_version", KV_SCHEMA_VERSION)
        return self

    def _absent(self) -> Any:
        return {"started_at"} if self.started_at is None else None  # schema 1


class KvEvent(_ProcessStamped):
    instance_id: int = Field(gt=0, le=U64_MAX)
    dp_rank: Rank = 0
    event_id: int = Field(ge=0, le=U64_MAX)
    tier: CacheInput = CacheInput.DEVICE
    data: KvData


def decode_kv_event(data: bytes | str | dict[str, Any]) -> KvEvent:
    # Schema 1 → 2: ``started_at`` is absent (None); nothing to rewrite.
    event: KvEvent = _decode(KvEvent, data)
    return event


class KvDumpRank(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    dp_rank: Rank = 0
    tier: CacheInput = CacheInput.DEVICE
    # Each stored block as (parent chain hash or None, chain hash, tokens hash), parents first.
    blocks: list[tuple[Hash64 | None, Hash64, Hash64]] = Field(
        default_factory=list, max_length=L.MAX_KV_DUMP_BLOCKS
    )


class KvDumpReply(_ProcessStamped):
    """Answer to a request on ``rudder.kvdump.<instance_id>``: the full cache state of the process
    ``started_at`` names (schema 2)."""

    instance_id: int = Field(gt=0, le=U64_MAX)
    last_event_id: int = Field(ge=-1, le=U64_MAX)
    ranks: list[KvDumpRank] = Field(max_length=L.MAX_DP_SIZE * len(CacheInput))
    partial: bool = False  # True when the agent attached late and cannot see every block


def decode_kv_dump(data: bytes | str | dict[str, Any]) -> KvDumpReply:
    reply: KvDumpReply = _decode(KvDumpReply, data)
    return reply


# ---------------------------------------------------------------------------------------------
# Decisions: "why did this request go there?" (router.decisions), asked over the bus


class DecisionQuery(_Event):
    """A request on ``rudder.decisions.<router_id>``: that router's records of one request."""

    schema_version: Literal[1] = 1
    request_id: str = Field(min_length=1, max_length=128)


class DecisionReply(_Event):
    """A router's answer to a :class:`DecisionQuery`: its records of the request ([] if it has
    none: not routed there, not sampled, or dropped from its bounded log). Each record is
    router.decisions.DecisionRecord as a JSON object."""

    schema_version: Literal[1] = 1
    router_id: str = Field(min_length=1, max_length=64)
    decisions: list[dict[str, Any]] = Field(max_length=64)


def decode_decision_query(data: bytes | str | dict[str, Any]) -> DecisionQuery:
    query: DecisionQuery = _decode(DecisionQuery, data)
    return query


def decode_decision_reply(data: bytes | str | dict[str, Any]) -> DecisionReply:
    reply: DecisionReply = _decode(DecisionReply, data)
    return reply


# ---------------------------------------------------------------------------------------------
# Router replicas' bookings (router.peers)

InstanceId = Annotated[int, Field(gt=0, le=U64_MAX)]
#: One rank's bookings: (instance_id, dp_rank, requests, prefill_tokens, blocks).
RankBooked = tuple[InstanceId, Rank, Count, Count, Count]
#: A request finished there: (instance_id, dp_rank, its prompt's last full block hash, seconds ago).
FinishedThere = tuple[InstanceId, Rank, Hash64, Annotated[float, Field(ge=0, le=86_400)]]


class RouterLoad(_Event):
    """What a router has booked on each worker rank and not yet seen finish (router.bookings), on
    ``rudder.routerload.<router_id>`` for its peers: a whole snapshot each time (only the ranks
    with bookings), so a lost message is made good by the next; and its expected-returns events.
    ``boot`` names the publishing process and ``seq`` counts its snapshots: a receiver keeps the
    newest of each boot. Core NATS, never stored."""

    schema_version: Literal[1] = 1
    router_id: RouterId
    boot: str = Field(min_length=1, max_length=32)
    seq: int = Field(ge=0, le=U64_MAX)
    ranks: list[RankBooked] = Field(default_factory=list, max_length=L.MAX_ROUTER_LOAD_RANKS)
    # The expected returns (router.returns) since the previous snapshot: requests that finished
    # here, and entries a return seen here closed (their hashes). Sent once: a lost message loses them.
    finished: list[FinishedThere] = Field(default_factory=list, max_length=L.MAX_ROUTER_LOAD_EVENTS)
    returned: list[Hash64] = Field(default_factory=list, max_length=L.MAX_ROUTER_LOAD_EVENTS)


def decode_router_load(data: bytes | str | dict[str, Any]) -> RouterLoad:
    load: RouterLoad = _decode(RouterLoad, data)
    return load


# ---------------------------------------------------------------------------------------------
# A payload speaks only for its subject (DESIGN §9). One pure check per message kind; each raises
# SubjectMismatch naming the payload field, the subject and both ids. The subject (or KV key) is
# what NATS permissions bind to an identity, so it is the id that counts.


def _mismatch(what: str, field: str, subject: str, payload_value: object, subject_value: str) -> SubjectMismatch:
    return SubjectMismatch(
        f"{what} on {subject!r} names {field}={payload_value!r}, not its subject's {subject_value!r}",
        field=field, subject=subject,
    )


def check_membership_subject(subject: str, event: MembershipEvent) -> None:
    """``rudder.workers.<model_key>.<instance_id>`` must name the record's model and instance id."""
    expected = membership_subject(event.worker.model, event.worker.instance_id)
    if subject != expected:
        raise _mismatch("membership event", "worker", subject, (event.worker.model, event.worker.instance_id),
                        subject)


def check_kv_subject(subject: str, model: str, event: KvEvent) -> None:
    """``rudder.kv.<model_key>.<instance_id>`` must name the event's instance id (and the model the
    subscriber subscribed for)."""
    if subject != kv_subject(model, event.instance_id):
        raise _mismatch("KV event", "instance_id", subject, event.instance_id, subject)


def check_kv_dump(instance_id: int, reply: KvDumpReply) -> None:
    """A dump requested on ``rudder.kvdump.<instance_id>`` must describe that worker."""
    if reply.instance_id != instance_id:
        raise _mismatch("KV dump", "instance_id", f"rudder.kvdump.{instance_id}", reply.instance_id,
                        str(instance_id))


def check_ack_subject(subject: str, ack: ApplyAck) -> None:
    """``rudder.acks.<router_id>`` must name the ACK's router."""
    if subject != acks_subject(ack.router_id):
        raise _mismatch("ACK", "router_id", subject, ack.router_id, subject)


def check_router_load_subject(subject: str, load: RouterLoad) -> None:
    """``rudder.routerload.<router_id>`` must name the snapshot's router."""
    if subject != router_load_subject(load.router_id):
        raise _mismatch("router load", "router_id", subject, load.router_id, subject)


def check_router_status_key(key: str, status: RouterStatus) -> None:
    """A router's status lives under its own id in ``RUDDER_ROUTERS``."""
    if key != router_status_key(status.router_id):
        raise _mismatch("router status", "router_id", f"key {key}", status.router_id, key)


def check_policy_subject(subject: str, event: PolicyEvent) -> None:
    """``rudder.policy.<model_key>.<kind>`` must name the event's document."""
    if subject != policy_subject(event.model, event.kind.value):
        raise _mismatch("policy event", "model", subject, f"{event.model}|{event.kind.value}", subject)
