"""Audit records and the hash chain, as pure data (DESIGN §4). No database imports here.

An ``AuditEntry`` is what the write path wants recorded; the store turns it into an ``AuditRow``
by giving it the next ``id`` and linking it into the chain::

    row_hash = sha256(prev_hash || canonical_json(every field of the row except the two hashes))

The first row's ``prev_hash`` is ``GENESIS_HASH`` (64 zeros). Because ``id`` and ``at`` are inside
the hashed fields, an auditor holding a JSON export (``AuditRow.to_dict()``) can re-verify the chain
without the database: ``compute_row_hash`` gives the same digest for a row's Python values and for
its JSON-safe form.

Canonical JSON is stable across a round trip through PostgreSQL JSONB: keys are sorted, there is no
whitespace, text is UTF-8 (not ``\\u`` escapes), a float with an integral value is written as
that integer (JSONB may hand ``1e20`` back as the integer ``100000000000000000000``) and every
other float as its shortest round-trip ``repr``. NaN and infinities are refused (JSONB cannot
hold them).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, date, datetime
from typing import Any

GENESIS_HASH = "0" * 64


class AuditStage(enum.StrEnum):
    """``received`` is written before publishing; ``decision`` once the outcome is known."""

    RECEIVED = "received"
    DECISION = "decision"


class Decision(enum.StrEnum):
    PENDING = "pending"
    ACCEPTED = "accepted"
    REJECTED = "rejected"


def utcnow() -> datetime:
    return datetime.now(UTC)


def _as_utc(value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("audit times must be timezone-aware (UTC)")
    return value.astimezone(UTC)


#: What PostgreSQL cannot store in text or JSONB (NUL) and what is no Unicode scalar (an unpaired
#: surrogate, from a JSON ``\ud800`` escape): a row holding one could not be written, so a
#: refusal that names a caller's bad input would answer 503 instead of being recorded.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(value: Any) -> Any:
    """``value`` with every unstorable character in its strings (keys too) replaced by U+FFFD."""
    if isinstance(value, str):
        return _UNSTORABLE.sub("\ufffd", value)
    if isinstance(value, Mapping):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


def format_time(value: datetime) -> str:
    """ISO-8601 in UTC with microseconds, e.g. ``2026-01-02T03:04:05.000006+00:00``."""
    return _as_utc(value).isoformat(timespec="microseconds")


@dataclass(frozen=True, kw_only=True)
class AuditEntry:
    """One audit record as the write path states it (the store adds id and hashes).

    A ``received`` entry is always ``pending``; a ``decision`` entry is ``accepted`` or
    ``rejected``. ``at`` must be timezone-aware; it is stored in UTC. Raises ``ValueError``
    otherwise (a programming error, not a client error).
    """

    event_id: uuid.UUID | None
    stage: AuditStage
    decision: Decision
    reason_code: str | None = None
    reason: str | None = None
    actor: str | None = None
    roles: list[str] = field(default_factory=list)
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
    dry_run: bool = False
    at: datetime = field(default_factory=utcnow)

    def __post_init__(self) -> None:
        stage = AuditStage(self.stage)
        decision = Decision(self.decision)
        if stage is AuditStage.RECEIVED and decision is not Decision.PENDING:
            raise ValueError("a received record is always pending")
        if stage is AuditStage.DECISION and decision is Decision.PENDING:
            raise ValueError("a decision record is accepted or rejected, never pending")
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "decision", decision)
        object.__setattr__(self, "at", _as_utc(self.at))
        object.__setattr__(self, "roles", [str(r) for r in self.roles])
        for name in ("reason_code", "reason", "actor", "auth_method", "source_ip", "user_agent",
                     "request_id", "model", "kind", "op", "changes", "before", "after"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, storable(value))
        if isinstance(self.event_id, str):
            object.__setattr__(self, "event_id", uuid.UUID(self.event_id))

    def hashed_fields(self) -> dict[str, Any]:
        """Every field of the record (Python values), as hashed and stored."""
        return {f.name: getattr(self, f.name) for f in fields(AuditEntry)}


@dataclass(frozen=True, kw_only=True)
class AuditRow(AuditEntry):
    """A stored audit record: the entry plus its place in the chain."""

    id: int
    prev_hash: str
    row_hash: str

    def hashed_fields(self) -> dict[str, Any]:
        out = super().hashed_fields()
        out["id"] = self.id
        return out

    def expected_hash(self) -> str:
        """The row hash recomputed from this row's fields and its stored ``prev_hash``."""
        return compute_row_hash(self.prev_hash, self.hashed_fields())

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe values: ISO-8601 UTC strings, UUIDs as strings, enums as their values."""
        out = {k: _json_safe(v) for k, v in self.hashed_fields().items()}
        out["prev_hash"] = self.prev_hash
        out["row_hash"] = self.row_hash
        return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return format_time(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _canonical(value: Any) -> Any:
    """Normalise ``value`` so that ``json.dumps`` renders it the same before and after JSONB."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot hash a non-finite number: {value!r}")
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, datetime):
        return format_time(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"cannot hash a value of type {type(value).__name__}")


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, stable numbers (see the module docstring).

    Raises ``ValueError`` for NaN/Infinity and ``TypeError`` for values JSON cannot carry.
    """
    return json.dumps(
        _canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


#: The columns of a ``router_acks`` row covered by its ``row_hash`` (all but the two hashes).
ACK_HASHED_FIELDS = (
    "id", "stream_seq", "router_id", "model", "kind", "revision", "status", "detail", "event_id",
    "effective", "at",
)


def ack_hashed_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The hashed fields of an ACK row from any mapping holding its columns (Python values)."""
    return {name: values[name] for name in ACK_HASHED_FIELDS}


def compute_row_hash(prev_hash: str, row_fields: Mapping[str, Any]) -> str:
    """sha256 hex of ``prev_hash`` (ASCII hex) followed by the canonical JSON of ``row_fields``.

    ``row_fields`` holds every column of the row except ``prev_hash`` and ``row_hash`` (those two
    are dropped if present, so a ``to_dict()`` export can be passed as it is).
    """
    body = {k: v for k, v in row_fields.items() if k not in ("prev_hash", "row_hash")}
    digest = hashlib.sha256()
    digest.update(prev_hash.encode("ascii"))
    digest.update(canonical_json(body))
    return digest.hexdigest()
