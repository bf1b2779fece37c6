"""Where the CLI finds its server, token and database URL.

Order: the flag, then the environment variable (``RUDDER_SERVER``, ``RUDDER_TOKEN``,
``RUDDER_DATABASE_URL``), then ``.rudder/credentials`` in the current directory, which
``rudder up`` writes. The database URL there is the control plane's role, never the schema
owner's: ``rudder db upgrade`` alone takes the owner's (``RUDDER_DATABASE_OWNER_URL``).
The file holds ``KEY=value`` lines (``#`` comments, optional quotes), the same
syntax as a shell ``.env`` file so ``set -a; . .rudder/credentials`` also works.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SERVER = "http://127.0.0.1:8080"
CREDENTIALS_FILE = Path(".rudder") / "credentials"


def parse_credentials(text: str) -> dict[str, str]:
    """Parse ``KEY=value`` lines; blank lines, comments and malformed lines are ignored."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def read_credentials(path: Path | None = None) -> dict[str, str]:
    path = CREDENTIALS_FILE if path is None else path
    try:
        return parse_credentials(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return {}


def format_credentials(values: Mapping[str, str]) -> str:
    lines = ["# written by `rudder up`; read by the rudder CLI when no flag or variable is set"]
    lines += [f"{key}={value}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def write_credentials(path: Path, values: Mapping[str, str]) -> None:
    """Write the file with mode 0600 from the first byte (it holds an admin token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(format_credentials(values))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Settings:
    """What every command gets from the callback: the admin API address, token, output mode."""

    server: str = DEFAULT_SERVER
    token: str | None = field(default=None, repr=False)
    json: bool = False
    timeout: float = 10.0


def resolve(
    server: str | None,
    token: str | None,
    *,
    json_output: bool = False,
    credentials: Mapping[str, str] | None = None,
) -> Settings:
    """Fill what neither flag nor environment gave from the credentials file.

    ``server``/``token`` arrive already resolved from flag then environment (typer's ``envvar``).
    """
    if server is None or token is None:
        creds = read_credentials() if credentials is None else credentials
        server = server or creds.get("RUDDER_SERVER") or None
        token = token or creds.get("RUDDER_TOKEN") or None
    return Settings(server=(server or DEFAULT_SERVER).rstrip("/"), token=token, json=json_output)


def database_url(flag: str | None) -> str:
    """Database URL for the commands that talk to Postgres directly (token, db)."""
    if flag:
        return flag
    env = os.environ.get("RUDDER_DATABASE_URL")
    if env:
        return env
    creds = read_credentials()
    if creds.get("RUDDER_DATABASE_URL"):
        return creds["RUDDER_DATABASE_URL"]
    from controlplane.settings import ControlPlaneSettings

    # The field's default, not a whole ControlPlaneSettings(): that one needs the signing key.
    default = ControlPlaneSettings.model_fields["database_url"].default
    return str(default.get_secret_value())


def database_owner_url(flag: str | None) -> str | None:
    """The schema owner's URL, for ``rudder db upgrade`` only: the flag, then
    ``RUDDER_DATABASE_OWNER_URL``. Never read from ``.rudder/credentials`` (which holds the
    control plane's role) and never defaulted to ``RUDDER_DATABASE_URL``."""
    return flag or os.environ.get("RUDDER_DATABASE_OWNER_URL") or None


def app_role_from_url(url: str | None) -> str | None:
    """The user name in a database URL (``postgresql+asyncpg://user:pw@host/db``), if any."""
    if not url:
        return None
    from urllib.parse import unquote, urlsplit

    try:
        user = urlsplit(url).username
    except ValueError:
        return None
    return unquote(user) if user else None
