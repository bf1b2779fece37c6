"""The audit database schema as SQLAlchemy 2 models (DESIGN §4).

These models describe the schema for queries and for Alembic's autogenerate comparison; the schema
itself is created by the migrations in ``migrations/versions`` (never by ``create_all`` in
production). ``audit_log`` and ``router_acks`` are insert-only: a trigger installed by the migration
refuses UPDATE, DELETE and TRUNCATE on both, and both are hash-chained (``prev_hash``,
``row_hash``). The control plane's role may only SELECT and INSERT them (``migrations.grants``).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Identity,
    Index,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class AuditLogRow(Base):
    __tablename__ = "audit_log"
    __table_args__ = (
        CheckConstraint("stage IN ('received', 'decision')", name="audit_log_stage_check"),
        CheckConstraint(
            "decision IN ('pending', 'accepted', 'rejected')", name="audit_log_decision_check"
        ),
        Index("ix_audit_log_model_kind", "model", "kind"),
        Index("ix_audit_log_event_id", "event_id"),
        Index("ix_audit_log_actor", "actor"),
        Index("ix_audit_log_at", "at"),
        # One successor per row: a fork of the chain cannot be stored even by a writer that
        # bypassed the advisory lock.
        Index("ux_audit_log_prev_hash", "prev_hash", unique=True),
    )

    # Assigned by the store (last id + 1 under the chain lock): the id is part of the row hash.
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    event_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    stage: Mapped[str] = mapped_column(Text)
    decision: Mapped[str] = mapped_column(Text)
    reason_code: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str | None] = mapped_column(Text)
    roles: Mapped[list[str]] = mapped_column(
        ARRAY(Text), server_default=text("'{}'::text[]")
    )
    auth_method: Mapped[str | None] = mapped_column(Text)
    source_ip: Mapped[str | None] = mapped_column(Text)
    user_agent: Mapped[str | None] = mapped_column(Text)
    request_id: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(Text)
    kind: Mapped[str | None] = mapped_column(Text)
    op: Mapped[str | None] = mapped_column(Text)
    expected_revision: Mapped[int | None] = mapped_column(BigInteger)
    head_revision: Mapped[int | None] = mapped_column(BigInteger)
    new_revision: Mapped[int | None] = mapped_column(BigInteger)
    changes: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    after: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    dry_run: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    prev_hash: Mapped[str] = mapped_column(Text)
    row_hash: Mapped[str] = mapped_column(Text)


class RouterAckRow(Base):
    __tablename__ = "router_acks"
    __table_args__ = (
        CheckConstraint("status IN ('ACK', 'NACK')", name="router_acks_status_check"),
        Index("ix_router_acks_router_model_kind_at", "router_id", "model", "kind", "at"),
        Index("ix_router_acks_at", "at"),
        Index("ux_router_acks_stream_seq", "stream_seq", unique=True),
        Index("ux_router_acks_prev_hash", "prev_hash", unique=True),
    )

    # Assigned by the store (last id + 1 under the ACK chain lock): the id is part of the hash.
    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    router_id: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(Text)
    revision: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(Text)
    detail: Mapped[str] = mapped_column(Text, server_default=text("''"))
    event_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    effective: Mapped[dict[str, Any]] = mapped_column(
        JSONB, server_default=text("'{}'::jsonb")
    )
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # RUDDER_ACKS stream sequence of the message this row records (NULL for rows from before
    # migration 0002): unique, so an ACK delivered twice is stored once.
    stream_seq: Mapped[int | None] = mapped_column(BigInteger)
    prev_hash: Mapped[str] = mapped_column(Text)
    row_hash: Mapped[str] = mapped_column(Text)


class ApiTokenRow(Base):
    __tablename__ = "api_tokens"
    __table_args__ = (
        CheckConstraint(
            "role IN ('viewer', 'operator', 'auditor', 'admin')", name="api_tokens_role_check"
        ),
        UniqueConstraint("token_hash", name="api_tokens_token_hash_key"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    role: Mapped[str] = mapped_column(Text)
    token_hash: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=text("now()")
    )
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TokenAuditRow(Base):
    """What the token functions did (migration 0003): insert-only, written by the database."""

    __tablename__ = "token_audit"
    __table_args__ = (
        CheckConstraint("action IN ('create', 'revoke')", name="token_audit_action_check"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=text("now()"))
    action: Mapped[str] = mapped_column(Text)
    token_id: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str] = mapped_column(Text)
    role: Mapped[str] = mapped_column(Text)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    db_user: Mapped[str] = mapped_column(Text)


metadata = Base.metadata
audit_log: Table = metadata.tables["audit_log"]
router_acks: Table = metadata.tables["router_acks"]
api_tokens: Table = metadata.tables["api_tokens"]
token_audit: Table = metadata.tables["token_audit"]
