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

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

from controlplane.audit.records import GENESIS_HASH, ack_hashed_fields, compute_row_hash
from migrations import grants

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _link_existing_acks() -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.text(
        "SELECT id, router_id, model, kind, revision, status, detail, event_id, effective, at "
        "FROM router_acks ORDER BY id")).mappings().all()
    if not rows:
        return
    # The owner lifts its own trigger for the one-time link of old rows, in this transaction.
    op.execute("ALTER TABLE router_acks DISABLE TRIGGER router_acks_no_update_delete")
    prev = GENESIS_HASH
    for row in rows:
        row_hash = compute_row_hash(prev, ack_hashed_fields({**row, "stream_seq": None}))
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
    grants.apply(op.get_bind(), context.config.attributes.get("app_role") or grants.app_role_name())


def downgrade() -> None:
    op.drop_index("ux_router_acks_prev_hash", table_name="router_acks")
    op.drop_index("ux_router_acks_stream_seq", table_name="router_acks")
    op.drop_column("router_acks", "row_hash")
    op.drop_column("router_acks", "prev_hash")
    op.drop_column("router_acks", "stream_seq")
