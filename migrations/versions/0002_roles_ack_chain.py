"""App-role grants; router_acks hash-chained and keyed by their ACK-stream sequence.

- ``router_acks`` gains ``stream_seq`` (the ``RUDDER_ACKS`` stream sequence of the message a row
  records; unique, so a redelivered or twice-consumed ACK is stored once), ``prev_hash`` and
  ``row_hash`` (the same chain as ``audit_log``: sha256 of the previous hash and the canonical JSON
  of the row). Rows written before this migration are linked here, oldest first, with their
  ``stream_seq`` left NULL (they came over core NATS).
- The app role (``migrations.grants``) gets SELECT/INSERT on the audit and ACK tables and what
  tokens need, nothing else.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime
from typing import Any

import sqlalchemy as sa
from alembic import context, op

from migrations import grants

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# ---- frozen at 0002 -------------------------------------------------------------------------
# The ACK chain hash exactly as it was when this migration was written: the hashed fields, the
# canonical JSON and the digest, copied from controlplane/audit/records.py (GENESIS_HASH,
# ACK_HASHED_FIELDS, _canonical, canonical_json, format_time, compute_row_hash). A migration must
# write tomorrow what it wrote yesterday: importing the live code, a later change to the hashed
# fields or the canonical form would silently change the hashes this migration gives old rows.
# Never edit this copy; a new hash is a new migration. tests/unit/test_migration_frozen.py checks
# that it equals the live hash for the fields of today.

_GENESIS_HASH = "0" * 64

_ACK_HASHED_FIELDS = (
    "id", "stream_seq", "router_id", "model", "kind", "revision", "status", "detail", "event_id",
    "effective", "at",
)


def _format_time(value: datetime) -> str:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("audit times must be timezone-aware (UTC)")
    return value.astimezone(UTC).isoformat(timespec="microseconds")


def _canonical(value: Any) -> Any:
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
        return _format_time(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"cannot hash a value of type {type(value).__name__}")


def ack_row_hash(prev_hash: str, row: Mapping[str, Any]) -> str:
    """sha256 hex of ``prev_hash`` (ASCII hex) and the canonical JSON of the row's hashed fields."""
    body = {name: row[name] for name in _ACK_HASHED_FIELDS}
    digest = hashlib.sha256()
    digest.update(prev_hash.encode("ascii"))
    digest.update(json.dumps(
        _canonical(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8"))
    return digest.hexdigest()


#: What this migration grants the app role: the tables that exist at 0002. Not the live
#: ``grants.APP_GRANTS``, which may name tables a later migration creates (this one would then
#: fail on a fresh database); the live list is applied after every upgrade to head by env.py.
_GRANTS_AT_0002: dict[str, tuple[str, ...]] = {
    "audit_log": ("SELECT", "INSERT"),
    "router_acks": ("SELECT", "INSERT"),
    "api_tokens": ("SELECT", "INSERT", "UPDATE (revoked_at)"),
}

# ---------------------------------------------------------------------------------------------


def _link_existing_acks() -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.text(
        "SELECT id, router_id, model, kind, revision, status, detail, event_id, effective, at "
        "FROM router_acks ORDER BY id")).mappings().all()
    if not rows:
        return
    # The owner lifts its own trigger for the one-time link of old rows, in this transaction.
    op.execute("ALTER TABLE router_acks DISABLE TRIGGER router_acks_no_update_delete")
    prev = _GENESIS_HASH
    for row in rows:
        row_hash = ack_row_hash(prev, {**row, "stream_seq": None})
        bind.execute(sa.text("UPDATE router_acks SET prev_hash = :p, row_hash = :h WHERE id = :i"),
                     {"p": prev, "h": row_hash, "i": row["id"]})
        prev = row_hash
    op.execute("ALTER TABLE router_acks ENABLE TRIGGER router_acks_no_update_delete")


def upgrade() -> None:
    op.add_column("router_acks", sa.Column("stream_seq", sa.BigInteger(), nullable=True))
    op.add_column("router_acks", sa.Column("prev_hash", sa.Text(), nullable=True))
    op.add_column("router_acks", sa.Column("row_hash", sa.Text(), nullable=True))
    _link_existing_acks()
    op.alter_column("router_acks", "prev_hash", nullable=False)
    op.alter_column("router_acks", "row_hash", nullable=False)
    op.create_index("ux_router_acks_stream_seq", "router_acks", ["stream_seq"], unique=True)
    op.create_index("ux_router_acks_prev_hash", "router_acks", ["prev_hash"], unique=True)
    grants.apply(op.get_bind(), context.config.attributes.get("app_role") or grants.app_role_name(),
                 privileges=_GRANTS_AT_0002)


def downgrade() -> None:
    op.drop_index("ux_router_acks_prev_hash", table_name="router_acks")
    op.drop_index("ux_router_acks_stream_seq", table_name="router_acks")
    op.drop_column("router_acks", "row_hash")
    op.drop_column("router_acks", "prev_hash")
    op.drop_column("router_acks", "stream_seq")
