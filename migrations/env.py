"""Alembic environment for Rudder (async engine; asyncpg URLs).

Three ways in:
- ``config.attributes["connection"]``: a synchronous ``Connection`` handed in by the caller
  (e.g. from ``AsyncConnection.run_sync``); migrations run on it.
- ``config.attributes["url"]`` or ``sqlalchemy.url``: a ``postgresql+asyncpg://`` URL; an async
  engine is created and driven with ``asyncio.run`` (so this must not run inside an event loop:
  ``migrations.upgrade`` runs it in a worker thread).
- offline (``alembic upgrade --sql``): the SQL is printed.

Every online run takes a transaction-scoped advisory lock first, so control-plane replicas that
start together run the migrations one after the other instead of racing on CREATE TABLE.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from controlplane.audit.tables import metadata
from migrations import grants

MIGRATION_LOCK_KEY = 0x52554444_4D494752  # "RUDDMIGR"

config = context.config
target_metadata = metadata


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass url= to migrations.upgrade or set sqlalchemy.url")
    return str(url)


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        context.run_migrations()
        if config.attributes.get("apply_grants"):
            # Idempotent: a renamed app role, or a table added by a later migration, gets its
            # grants from the one list in migrations/grants.py on every upgrade.
            grants.apply(connection, config.attributes.get("app_role") or grants.app_role_name(),
                         functions=grants.APP_FUNCTIONS)


async def _run_async(url: str) -> None:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run_on)
            await conn.commit()
    finally:
        await engine.dispose()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
    else:
        asyncio.run(_run_async(_url()))


if context.is_offline_mode():
    run_offline()
else:
    run_online()
