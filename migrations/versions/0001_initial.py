"""Initial schema: audit_log (insert-only, hash-chained), router_acks, api_tokens.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Raised for UPDATE/DELETE (row trigger) and TRUNCATE (statement trigger). SQLSTATE P0001 with a
# message naming the table and the operation.
REFUSE_CHANGE = """
CREATE OR REPLACE FUNCTION rudder_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rudder: % is insert-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'P0001', HINT = 'audit records are never rewritten';
END;
$$
"""


def _insert_only(table: str) -> None:
    op.execute(
        f"CREATE TRIGGER {table}_no_update_delete BEFORE UPDATE OR DELETE ON {table} "
        "FOR EACH ROW EXECUTE FUNCTION rudder_refuse_change()"
    )
    op.execute(
        f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
        "FOR EACH STATEMENT EXECUTE FUNCTION rudder_refuse_change()"
    )


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("stage", sa.Text(), nullable=False),
        sa.Column("decision", sa.Text(), nullable=False),
        sa.Column("reason_code", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("actor", sa.Text(), nullable=True),
        sa.Column(
            "roles", postgresql.ARRAY(sa.Text()), nullable=False,
            server_default=sa.text("'{}'::text[]"),
        ),
        sa.Column("auth_method", sa.Text(), nullable=True),
        sa.Column("source_ip", sa.Text(), nullable=True),
        sa.Column("user_agent", sa.Text(), nullable=True),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("kind", sa.Text(), nullable=True),
        sa.Column("op", sa.Text(), nullable=True),
        sa.Column("expected_revision", sa.BigInteger(), nullable=True),
        sa.Column("head_revision", sa.BigInteger(), nullable=True),
        sa.Column("new_revision", sa.BigInteger(), nullable=True),
        sa.Column("changes", postgresql.JSONB(), nullable=True),
        sa.Column("before", postgresql.JSONB(), nullable=True),
        sa.Column("after", postgresql.JSONB(), nullable=True),
        sa.Column("dry_run", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("prev_hash", sa.Text(), nullable=False),
        sa.Column("row_hash", sa.Text(), nullable=False),
        sa.CheckConstraint("stage IN ('received', 'decision')", name="audit_log_stage_check"),
        sa.CheckConstraint(
            "decision IN ('pending', 'accepted', 'rejected')", name="audit_log_decision_check"
        ),
    )
    op.create_index("ix_audit_log_model_kind", "audit_log", ["model", "kind"])
    op.create_index("ix_audit_log_event_id", "audit_log", ["event_id"])
    op.create_index("ix_audit_log_actor", "audit_log", ["actor"])
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ux_audit_log_prev_hash", "audit_log", ["prev_hash"], unique=True)

    op.create_table(
        "router_acks",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("router_id", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column(
            "effective", postgresql.JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("status IN ('ACK', 'NACK')", name="router_acks_status_check"),
    )
    op.create_index(
        "ix_router_acks_router_model_kind_at", "router_acks", ["router_id", "model", "kind", "at"]
    )
    op.create_index("ix_router_acks_at", "router_acks", ["at"])

    op.create_table(
        "api_tokens",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("token_hash", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "role IN ('viewer', 'operator', 'auditor', 'admin')", name="api_tokens_role_check"
        ),
        sa.UniqueConstraint("token_hash", name="api_tokens_token_hash_key"),
    )

    op.execute(REFUSE_CHANGE)
    _insert_only("audit_log")
    _insert_only("router_acks")


def downgrade() -> None:
    for table in ("router_acks", "audit_log"):
        op.execute(f"DROP TRIGGER IF EXISTS {table}_no_truncate ON {table}")
        op.execute(f"DROP TRIGGER IF EXISTS {table}_no_update_delete ON {table}")
    op.execute("DROP FUNCTION IF EXISTS rudder_refuse_change()")
    op.drop_table("api_tokens")
    op.drop_table("router_acks")
    op.drop_table("audit_log")
