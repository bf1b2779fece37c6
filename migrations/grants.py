"""The control plane's database role and exactly what it may do (DESIGN §9, issue 8).

Migrations run as the owner of the schema; the control plane runs as a separate *app role* that
may only read and append to the audit and ACK tables, read API tokens, and create and revoke
them through the audited functions of migration 0003 (never INSERT or UPDATE them itself):

    audit_log, router_acks   SELECT, INSERT
    api_tokens, token_audit  SELECT
    rudder_token_create, rudder_token_revoke   EXECUTE

It owns nothing, so it cannot ALTER a table, disable a trigger, TRUNCATE, UPDATE or DELETE an
audit row. ``apply(connection, role)`` creates the role (NOLOGIN, when the owner may create roles)
unless it exists, and (re)grants; it is idempotent and run after every ``upgrade`` to head, so a
renamed role or a table added later gets its grants from the same place. Migration 0002 runs it
too, with the list of its own time (a frozen copy: a table added later does not exist yet there).
Raises ``GrantError`` for a role name that is the owner itself or that cannot be created.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from sqlalchemy import text
from sqlalchemy.engine import Connection

DEFAULT_APP_ROLE = "rudder_app"
APP_ROLE_ENV = "RUDDER_DATABASE_APP_ROLE"

#: Table -> privileges of the app role. Column privileges are written ``UPDATE (col)``.
APP_GRANTS: dict[str, tuple[str, ...]] = {
    "audit_log": ("SELECT", "INSERT"),
    "router_acks": ("SELECT", "INSERT"),
    "api_tokens": ("SELECT",),
    "token_audit": ("SELECT",),
}

#: Functions the app role may execute (SECURITY DEFINER, each writes its own ``token_audit`` row).
APP_FUNCTIONS: tuple[str, ...] = (
    "rudder_token_create(text, text, text, timestamptz)",
    "rudder_token_revoke(bigint)",
)

_ROLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class GrantError(RuntimeError):
    """The app role cannot be set up as asked (wrong name, same as the owner, cannot create)."""


def app_role_name(explicit: str | None = None) -> str:
    """The app role: the argument, then ``RUDDER_DATABASE_APP_ROLE``, then ``rudder_app``."""
    name = explicit or os.environ.get(APP_ROLE_ENV) or DEFAULT_APP_ROLE
    if not _ROLE_NAME.fullmatch(name):
        raise GrantError(f"app role {name!r} must be a lower-case SQL identifier ({APP_ROLE_ENV})")
    return name


def apply(connection: Connection, role: str, *,
          privileges: Mapping[str, tuple[str, ...]] = APP_GRANTS,
          functions: tuple[str, ...] = ()) -> None:
    """Create ``role`` if missing (NOLOGIN) and grant it exactly ``privileges`` on tables and
    EXECUTE on ``functions`` (idempotent; nobody else may execute those).

    ``privileges`` and ``functions`` are ``APP_GRANTS`` and ``APP_FUNCTIONS`` (env.py, after every
    upgrade to head) but for a migration, which passes the lists of its own time (what it knows).
    """
    role = app_role_name(role)
    owner = connection.execute(text("SELECT current_user")).scalar_one()
    if role == owner:
        raise GrantError(
            f"the app role {role!r} is the role running the migration: the control plane must "
            "not connect as the schema owner (set RUDDER_DATABASE_OWNER_URL to the owner)")
    exists = connection.execute(
        text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first() is not None
    if not exists:
        may_create = connection.execute(
            text("SELECT rolcreaterole OR rolsuper FROM pg_roles WHERE rolname = current_user")
        ).scalar_one()
        if not may_create:
            raise GrantError(
                f"app role {role!r} does not exist and {owner!r} may not create roles: create it "
                f"(CREATE ROLE {role} LOGIN PASSWORD ...) or grant CREATEROLE to the owner")
        connection.execute(text(f'CREATE ROLE "{role}" NOLOGIN'))
    # Nothing more than listed: start from nothing on every table we grant on.
    for table, granted in privileges.items():
        connection.execute(text(f'REVOKE ALL ON TABLE {table} FROM "{role}"'))
        connection.execute(text(f'REVOKE ALL ON TABLE {table} FROM PUBLIC'))
        connection.execute(text(f'GRANT {", ".join(granted)} ON TABLE {table} TO "{role}"'))
    for function in functions:
        connection.execute(text(f'REVOKE ALL ON FUNCTION {function} FROM PUBLIC'))
        connection.execute(text(f'GRANT EXECUTE ON FUNCTION {function} TO "{role}"'))
    connection.execute(text(f'GRANT USAGE ON SCHEMA public TO "{role}"'))
