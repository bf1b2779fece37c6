"""``rudder token`` and ``rudder db``.

``token create`` and ``db upgrade`` talk to PostgreSQL directly (creating the first admin token
cannot go through an API that requires one); a token is created through the database's audited
function ``rudder_token_create`` and expires after ``--ttl`` (default ``RUDDER_TOKEN_TTL``, 90 days).
``token list`` and ``token revoke`` go through the admin API (``/tokens``, admin role), which
audits who revoked what.
"""

from __future__ import annotations

import enum
import os
import secrets
from typing import Annotated, Any

import typer

from cli import app as shared
from cli.config import app_role_from_url, database_owner_url, database_url
from cli.errors import CliError, ExitCode
from cli.loader import load
from cli.output import print_json, say, show, table

token_app = shared.new_app("API tokens (stored hashed; shown once).")
db_app = shared.new_app("Database schema (Alembic migrations).")

DatabaseOpt = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        help="SQLAlchemy URL; default $RUDDER_DATABASE_URL, then .rudder/credentials.",
        show_default=False,
    ),
]


class RoleName(enum.StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    AUDITOR = "auditor"
    ADMIN = "admin"


def _database_error(action: str, exc: Exception) -> CliError:
    if isinstance(exc, OSError):
        return CliError(ExitCode.UNAVAILABLE, f"{action}: database unreachable: {exc}")
    return CliError(ExitCode.ERROR, f"{action}: {type(exc).__name__}: {exc}")


DEFAULT_TTL = "90d"
_TTL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> float | None:
    """``90d``, ``12h``, ``30m``, ``3600s`` or ``3600`` as seconds; ``never`` as None. Raises
    CliError (usage) naming the option."""
    value = text.strip().lower()
    if value == "never":
        return None
    unit = value[-1:] if value[-1:] in _TTL_UNITS else "s"
    number = value[:-1] if value[-1:] in _TTL_UNITS else value
    try:
        seconds = float(number) * _TTL_UNITS[unit]
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 100 * 365 * 86400:
        raise CliError(ExitCode.USAGE, f"--ttl {text!r}: expected e.g. 90d, 12h, 30m, 3600s or never")
    return seconds


def create_token(url: str, name: str, role: str, *, ttl: str | None = None) -> str:
    """Create a token through the audit store's auth module; returns the secret once. It expires
    after ``ttl`` (default ``RUDDER_TOKEN_TTL``, then 90 days)."""
    ttl_s = parse_ttl(ttl or os.environ.get("RUDDER_TOKEN_TTL") or DEFAULT_TTL)
    create = load("controlplane.auth", "create_token_sync")
    role_enum = load("controlplane.auth", "Role")
    try:
        token: Any = create(url, name, role_enum(role), ttl_s=ttl_s)
    except Exception as exc:  # database drivers raise many types; report them once, here
        raise _database_error("token create", exc) from exc
    return str(token)


def upgrade(url: str, *, app_role: str | None = None) -> None:
    """Migrate as the schema owner (``url``) and grant ``app_role`` its privileges."""
    run = load("migrations", "upgrade")
    try:
        run(url, app_role=app_role)
    except Exception as exc:  # alembic/asyncpg errors, reported with their type
        raise _database_error("db upgrade", exc) from exc


@token_app.command("create")
def token_create(
    role: Annotated[RoleName, typer.Option("--role", help="Role of the new token.")],
    name: Annotated[
        str | None, typer.Option("--name", help="Name shown in the audit log as the actor.")
    ] = None,
    db: DatabaseOpt = None,
    ttl: Annotated[
        str | None, typer.Option("--ttl", help="Lifetime: 90d, 12h, 30m, 3600s or never; default "
                                 "$RUDDER_TOKEN_TTL, then 90d.", show_default=False),
    ] = None,
) -> None:
    """Create a token and print it once (it is stored hashed); audited."""
    token_name = name or f"{role.value}-{secrets.token_hex(3)}"
    token = create_token(database_url(db), token_name, role.value, ttl=ttl)
    if shared.json_mode():
        print_json({"name": token_name, "role": role.value, "token": token})
        return
    typer.echo(f"# token {token_name!r} with role {role.value}; shown only once", err=True)
    say(token)


@token_app.command("list")
def token_list() -> None:
    """Every token: id, name, role, created, expiry, revocation (never the secret)."""
    with shared.client() as api:
        result = api.get("/tokens")
    tokens = result.get("tokens", []) if isinstance(result, dict) else []
    if shared.json_mode():
        print_json(tokens)
        return
    show(table(["id", "name", "role", "created", "expires", "state"], [
        (t["id"], t["name"], t["role"], t["created_at"], t.get("expires_at") or "never",
         "revoked" if t["revoked"] else ("expired" if t.get("expired") else "valid"))
        for t in tokens]))


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int, typer.Argument(min=1, help="The token's id (`rudder token list`).")],
) -> None:
    """Revoke a token at once (every replica within 5 s); audited, and never undone."""
    with shared.client() as api:
        result = api.post(f"/tokens/{token_id}/revoke", {})
    if shared.json_mode():
        print_json(result)
    else:
        say(f"token {token_id} revoked")


@db_app.command("upgrade")
def db_upgrade(
    db: Annotated[
        str | None,
        typer.Option("--database-url", help="The schema OWNER's SQLAlchemy URL; default "
                     "$RUDDER_DATABASE_OWNER_URL (prefer the variable: arguments are visible to "
                     "every local user).", show_default=False),
    ] = None,
    app_role: Annotated[
        str | None,
        typer.Option("--app-role", help="The control plane's role to grant to; default "
                     "$RUDDER_DATABASE_APP_ROLE, then the user of $RUDDER_DATABASE_URL, then "
                     "rudder_app.", show_default=False),
    ] = None,
) -> None:
    """Apply every pending migration as the schema owner and grant the app role (idempotent)."""
    owner = database_owner_url(db)
    if owner is None:
        raise CliError(ExitCode.USAGE, "db upgrade runs as the schema owner: set "
                       "RUDDER_DATABASE_OWNER_URL (or pass --database-url)")
    role = (app_role or os.environ.get("RUDDER_DATABASE_APP_ROLE")
            or app_role_from_url(os.environ.get("RUDDER_DATABASE_URL")))
    upgrade(owner, app_role=role)
    if shared.json_mode():
        print_json({"ok": True})
    else:
        say("database schema is up to date")
