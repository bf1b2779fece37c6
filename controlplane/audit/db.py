"""The database edge of the audit store: engine, time bounds and the one error translation.

Errors
    Every database error or timeout (``OSError``, asyncpg errors, SQLAlchemy errors,
    ``TimeoutError``) is translated here, once, into ``AuditUnavailable`` (``raise … from exc``),
    by :func:`bounded`: the audit chains and the token store (``controlplane/auth.py``) all go
    through it. Each operation is bounded by ``timeout_s``. Connections are checked with a ping on
    checkout and invalidated on error (:func:`make_engine`), so a store recovers by itself after
    PostgreSQL restarts.

Query arguments
    The few checks shared by the audit and ACK queries (a limit in range, an aware time)
    raise ``InvalidRequest`` naming the argument.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg  # type: ignore[import-untyped]
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from controlplane.protocol.errors import AuditUnavailable, InvalidRequest

#: Errors that mean "the database did not do it": translated into ``AuditUnavailable``.
DB_ERRORS: tuple[type[BaseException], ...] = (
    OSError,  # includes ConnectionError and TimeoutError (asyncio.TimeoutError is TimeoutError)
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    SQLAlchemyError,  # DBAPIError, OperationalError, InterfaceError, pool TimeoutError, ...
)

#: The most rows one query answers.
MAX_LIMIT = 1000


def _describe(exc: BaseException) -> str:
    text_ = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text_}" if text_ else type(exc).__name__


def unavailable(message: str, cause: BaseException | None) -> AuditUnavailable:
    """An ``AuditUnavailable`` caused by ``cause``, for a waiter failed on someone else's behalf
    (the group-commit writer answering its callers), where ``raise … from`` cannot be used."""
    err = AuditUnavailable(message)
    err.__cause__ = cause
    err.__suppress_context__ = True
    return err


@contextlib.asynccontextmanager
async def bounded(what: str, timeout_s: float) -> AsyncIterator[None]:
    """Bound a database block by ``timeout_s`` and translate every database error, once, here:
    the one place where asyncpg/SQLAlchemy/OS errors become ``AuditUnavailable``."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except DB_ERRORS as exc:
        raise AuditUnavailable(f"{what} unavailable: {_describe(exc)}") from exc


def make_engine(url: str, *, pool_size: int = 10, timeout_s: float = 2.0) -> AsyncEngine:
    """An asyncpg engine whose every wait is bounded by ``timeout_s``.

    ``pool_pre_ping`` replaces connections that died with a PostgreSQL restart; the server-side
    ``statement_timeout`` ends a statement (e.g. a lock wait) whose client already gave up.
    """
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=timeout_s,
        pool_pre_ping=True,
        connect_args={
            "timeout": timeout_s,
            "command_timeout": timeout_s,
            "server_settings": {
                "application_name": "rudder-controlplane",
                "statement_timeout": str(int(timeout_s * 1000)),
            },
        },
    )


@dataclass(frozen=True)
class Db:
    """One engine and the time bound of every operation on it, shared by both chains."""

    engine: AsyncEngine
    timeout_s: float

    def bounded(self, what: str) -> contextlib.AbstractAsyncContextManager[None]:
        """``bounded`` for an audit store operation called ``what``."""
        return bounded(f"audit store ({what})", self.timeout_s)

    @contextlib.asynccontextmanager
    async def read(self, what: str) -> AsyncIterator[AsyncConnection]:
        """A pooled connection for reads, bounded and translated."""
        async with self.bounded(what), self.engine.connect() as conn:
            yield conn


def check_limit(limit: int) -> None:
    """Raises ``InvalidRequest`` (field ``limit``) unless ``1 <= limit <= MAX_LIMIT``."""
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}", field="limit")


def aware(value: datetime, name: str) -> datetime:
    """``value`` in UTC; raises ``InvalidRequest`` (field ``name``) for a naive time."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidRequest(f"{name} must carry a timezone", field=name)
    return value.astimezone(UTC)

