"""Alembic migrations for Rudder's PostgreSQL schema, runnable from an installed package.

``upgrade(url)`` is what ``rudder db upgrade`` and ``rudder up`` call; ``upgrade_async(url)`` is the
same from inside an event loop. The Alembic ``Config`` is built in code with ``script_location``
pointing at this package's folder, so no ``alembic.ini`` has to be found at run time.

Raises ``AuditUnavailable`` when the database cannot be reached or refuses the migration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.exc import SQLAlchemyError

from controlplane.protocol.errors import AuditUnavailable
from migrations.grants import GrantError

HERE = Path(__file__).resolve().parent

# Alembic keeps the running migration in module-level proxies (``alembic.context``,
# ``alembic.op``), so two upgrades in one process must not overlap. Across processes the
# Alembic environment takes a PostgreSQL advisory lock instead.
_IN_PROCESS = threading.Lock()

__all__ = ["alembic_config", "current_head", "upgrade", "upgrade_async"]


def alembic_config(url: str, *, app_role: str | None = None) -> Config:
    """An Alembic config for ``url`` (``postgresql+asyncpg://…``, the schema owner) and this
    package's scripts; ``app_role`` is the control plane's role to grant to (``grants``)."""
    config = Config()
    config.set_main_option("script_location", str(HERE))
    # Passed through attributes, not set_main_option: configparser would choke on '%' in URLs.
    config.attributes["url"] = url
    config.attributes["app_role"] = app_role
    return config


def current_head() -> str:
    """The newest revision shipped in ``versions/``."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("")).get_current_head()
    assert head is not None
    return head


def _upgrade_here(url: str, revision: str, app_role: str | None) -> None:
    try:
        with _IN_PROCESS:
            config = alembic_config(url, app_role=app_role)
            config.attributes["apply_grants"] = revision == "head"
            command.upgrade(config, revision)
    except GrantError as exc:
        raise AuditUnavailable(f"database migration failed: {exc}") from exc
    except (OSError, TimeoutError, SQLAlchemyError) as exc:
        raise AuditUnavailable(f"database migration failed: {exc}") from exc
    except Exception as exc:
        # asyncpg raises its own exception classes while connecting (outside SQLAlchemy's
        # wrapping); they all derive from asyncpg.PostgresError / InterfaceError.
        import asyncpg  # type: ignore[import-untyped]

        if isinstance(exc, asyncpg.PostgresError | asyncpg.InterfaceError):
            raise AuditUnavailable(f"database migration failed: {exc}") from exc
        raise


def upgrade(url: str, revision: str = "head", *, app_role: str | None = None) -> None:
    """Apply migrations up to ``revision`` as the schema owner (``url``) and grant the control
    plane's ``app_role`` (default ``RUDDER_DATABASE_APP_ROLE``, then ``rudder_app``) what it may
    do; idempotent (a second call changes nothing).

    Runs in a worker thread so that the Alembic environment's own ``asyncio.run`` never meets
    a running event loop: safe to call from sync code, from a thread, or from a coroutine
    (where ``upgrade_async`` avoids blocking the loop).
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rudder-migrate") as pool:
        pool.submit(_upgrade_here, url, revision, app_role).result()


async def upgrade_async(url: str, revision: str = "head", *, app_role: str | None = None) -> None:
    """``upgrade`` without blocking the running event loop."""
    await asyncio.to_thread(upgrade, url, revision, app_role=app_role)
