"""Tokens: only through audited functions; expiry (issue 17 item 6).

The database password was an admin token: the app role could INSERT an admin token or set a
revoked token's ``revoked_at`` back to NULL, unaudited. Now:

- the app role may only SELECT ``api_tokens``; it creates and revokes tokens through two
  ``SECURITY DEFINER`` functions owned by the schema owner, ``rudder_token_create`` and
  ``rudder_token_revoke``, each of which writes its own row to ``token_audit`` (insert-only, like
  the audit tables: the app role may only read it) naming the database user that called it;
- a trigger on ``api_tokens`` refuses, even to the owner, any change but the one revocation: no
  un-revoking, no new role, hash, name or expiry for an existing token;
- ``api_tokens.expires_at`` (NULL: never): a token past it does not authenticate.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

from migrations import grants

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# ---- frozen at 0003 (see 0002: never the live lists) ------------------------------------------
_GRANTS_AT_0003: dict[str, tuple[str, ...]] = {
    "audit_log": ("SELECT", "INSERT"),
    "router_acks": ("SELECT", "INSERT"),
    "api_tokens": ("SELECT",),
    "token_audit": ("SELECT",),
}
_FUNCTIONS_AT_0003: tuple[str, ...] = (
    "rudder_token_create(text, text, text, timestamptz)",
    "rudder_token_revoke(bigint)",
)
# ---------------------------------------------------------------------------------------------

GUARD = """
CREATE OR REPLACE FUNCTION rudder_token_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.revoked_at IS NOT NULL THEN
        RAISE EXCEPTION 'rudder: api token % is revoked: it stays revoked', OLD.id
            USING ERRCODE = 'P0001';
    END IF;
    IF NEW.revoked_at IS NULL OR NEW.id <> OLD.id OR NEW.name <> OLD.name OR NEW.role <> OLD.role
            OR NEW.token_hash <> OLD.token_hash OR NEW.created_at <> OLD.created_at
            OR NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN
        RAISE EXCEPTION 'rudder: api token %: only its revocation may change it', OLD.id
            USING ERRCODE = 'P0001';
    END IF;
    RETURN NEW;
END;
$$
"""

CREATE = """
CREATE OR REPLACE FUNCTION rudder_token_create(p_name text, p_role text, p_hash text,
                                               p_expires_at timestamptz) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    new_id bigint;
BEGIN
    INSERT INTO api_tokens (name, role, token_hash, expires_at)
        VALUES (p_name, p_role, p_hash, p_expires_at) RETURNING id INTO new_id;
    INSERT INTO token_audit (action, token_id, name, role, expires_at, db_user)
        VALUES ('create', new_id, p_name, p_role, p_expires_at, session_user);
    RETURN new_id;
END;
$$
"""

REVOKE = """
CREATE OR REPLACE FUNCTION rudder_token_revoke(p_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    t api_tokens%ROWTYPE;
BEGIN
    UPDATE api_tokens SET revoked_at = now() WHERE id = p_id AND revoked_at IS NULL
        RETURNING * INTO t;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO token_audit (action, token_id, name, role, expires_at, db_user)
        VALUES ('revoke', t.id, t.name, t.role, t.expires_at, session_user);
    RETURN t.token_hash;
END;
$$
"""


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "token_audit",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("token_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("db_user", sa.Text(), nullable=False),
        sa.CheckConstraint("action IN ('create', 'revoke')", name="token_audit_action_check"),
    )
    for when in ("BEFORE UPDATE OR DELETE", "BEFORE TRUNCATE"):
        name = "token_audit_no_update_delete" if "DELETE" in when else "token_audit_no_truncate"
        each = "ROW" if "DELETE" in when else "STATEMENT"
        op.execute(f"CREATE TRIGGER {name} {when} ON token_audit FOR EACH {each} "
                   "EXECUTE FUNCTION rudder_refuse_change()")
    op.execute(GUARD)
    op.execute("CREATE TRIGGER api_tokens_guard BEFORE UPDATE ON api_tokens FOR EACH ROW "
               "EXECUTE FUNCTION rudder_token_guard()")
    op.execute("CREATE TRIGGER api_tokens_no_delete BEFORE DELETE OR TRUNCATE ON api_tokens "
               "FOR EACH STATEMENT EXECUTE FUNCTION rudder_refuse_change()")
    op.execute(CREATE)
    op.execute(REVOKE)
    grants.apply(op.get_bind(), context.config.attributes.get("app_role") or grants.app_role_name(),
                 privileges=_GRANTS_AT_0003, functions=_FUNCTIONS_AT_0003)


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS rudder_token_revoke(bigint)")
    op.execute("DROP FUNCTION IF EXISTS rudder_token_create(text, text, text, timestamptz)")
    op.execute("DROP TRIGGER IF EXISTS api_tokens_no_delete ON api_tokens")
    op.execute("DROP TRIGGER IF EXISTS api_tokens_guard ON api_tokens")
    op.execute("DROP FUNCTION IF EXISTS rudder_token_guard()")
    op.drop_table("token_audit")
    op.drop_column("api_tokens", "expires_at")
