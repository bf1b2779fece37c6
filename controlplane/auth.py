"""Bearer tokens, roles and what each role may do (DESIGN §4 step 1).

Tokens are ``rdr_`` + 32 random bytes (URL-safe base64). Only their SHA-256 is stored; a request's
token is hashed, looked up by that hash, and compared with ``hmac.compare_digest``. There is no
"open" mode: without a valid, unrevoked token ``authenticate`` returns ``None`` and the API
answers 401.

Database failures raise ``AuditUnavailable`` (the API answers 503: it fails closed).
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import enum
import getpass
import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from controlplane.audit.db import bounded, make_engine
from controlplane.audit.records import AuditEntry, AuditStage, Decision, format_time
from controlplane.audit.tables import api_tokens
from controlplane.protocol.errors import InvalidRequest

TOKEN_PREFIX = "rdr_"
AUTH_FAILURES = "auth_failures"  # reason_code of a window's summary row


class Role(enum.StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    AUDITOR = "auditor"
    ADMIN = "admin"


class Action(enum.StrEnum):
    READ_POLICY = "read_policy"
    WRITE_POLICY = "write_policy"
    READ_AUDIT = "read_audit"
    ADMIN = "admin"


ROLE_ACTIONS: dict[Role, frozenset[Action]] = {
    Role.VIEWER: frozenset({Action.READ_POLICY}),
    Role.OPERATOR: frozenset({Action.READ_POLICY, Action.WRITE_POLICY}),
    Role.AUDITOR: frozenset({Action.READ_POLICY, Action.READ_AUDIT}),
    Role.ADMIN: frozenset(Action),
}


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name, its role and the token's id (for the audit log)."""

    name: str
    role: Role
    token_id: int

    def can(self, action: Action) -> bool:
        return action in ROLE_ACTIONS[self.role]

    @property
    def roles(self) -> list[str]:
        return [self.role.value]


def generate_token() -> str:
    """A new bearer token: ``rdr_`` + 32 random bytes from ``secrets`` (URL-safe base64)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """SHA-256 hex of the token.

    A fast hash is the right choice here: our tokens carry 256 bits of randomness, so there is
    nothing for a slow, salted password hash (bcrypt, argon2) to protect against guessing, and a
    fast deterministic hash lets a token be looked up by its hash with one indexed query.
    """
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenStore:
    """API tokens in the ``api_tokens`` table.

    Share the audit store's engine (``TokenStore(audit.engine)``) or own one (``from_url``).
    Successful look-ups are cached for ``cache_ttl_s`` (at most 5 s), so a token revoked by
    another control-plane replica stops working within that time (at once on this replica).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        timeout_s: float = 2.0,
        cache_ttl_s: float = 5.0,
        cache_size: int = 1024,
        owns_engine: bool = False,
    ) -> None:
        self._engine = engine
        self._timeout_s = timeout_s
        self._cache_ttl_s = min(max(cache_ttl_s, 0.0), 5.0)
        self._cache_size = cache_size
        self._owns_engine = owns_engine
        self._cache: dict[str, tuple[float, Principal]] = {}

    @classmethod
    def from_url(cls, url: str, *, pool_size: int = 2, timeout_s: float = 2.0) -> TokenStore:
        return cls(
            make_engine(url, pool_size=pool_size, timeout_s=timeout_s),
            timeout_s=timeout_s, owns_engine=True,
        )

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    def _db(self, what: str) -> contextlib.AbstractAsyncContextManager[None]:
        return bounded(f"token store ({what})", self._timeout_s)

    async def create(self, name: str, role: Role | str, *,
                     expires_at: datetime | None = None) -> tuple[str, int]:
        """Create a token (valid until ``expires_at``; None: until revoked); returns (plaintext,
        id). The plaintext is never stored or shown again. Through the database's audited
        function ``rudder_token_create`` (migration 0003): the app role may not insert a token.

        Raises ``InvalidRequest`` for an unknown role, an empty name or a naive/past expiry.
        """
        try:
            role = Role(role)
        except ValueError as exc:
            raise InvalidRequest(
                f"role must be one of {[r.value for r in Role]}", field="role"
            ) from exc
        if not name.strip():
            raise InvalidRequest("a token needs a name", field="name")
        if expires_at is not None and (expires_at.tzinfo is None or expires_at <= datetime.now(UTC)):
            raise InvalidRequest("expires_at must be a time-zone-aware time in the future", field="ttl")
        token = generate_token()
        async with self._db("create"), self._engine.begin() as conn:
            token_id = (
                await conn.execute(
                    select(func.rudder_token_create(name, role.value, hash_token(token), expires_at))
                )
            ).scalar_one()
        return token, int(token_id)

    async def authenticate(self, token: str | None) -> Principal | None:
        """The principal for a valid, unrevoked token, else ``None``."""
        if not token or not token.startswith(TOKEN_PREFIX) or len(token) > 256:
            return None
        digest = hash_token(token)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > now:
            return cached[1]
        async with self._db("authenticate"), self._engine.connect() as conn:
            row = (
                await conn.execute(
                    select(
                        api_tokens.c.id, api_tokens.c.name, api_tokens.c.role,
                        api_tokens.c.token_hash, api_tokens.c.revoked_at, api_tokens.c.expires_at,
                    ).where(api_tokens.c.token_hash == digest)
                )
            ).first()
        if row is None or not hmac.compare_digest(str(row.token_hash), digest):
            return None
        if row.revoked_at is not None or (row.expires_at is not None
                                          and row.expires_at <= datetime.now(UTC)):
            self._cache.pop(digest, None)
            return None
        principal = Principal(name=row.name, role=Role(row.role), token_id=int(row.id))
        ttl = self._cache_ttl_s
        if row.expires_at is not None:  # never cached past its expiry
            ttl = min(ttl, (row.expires_at - datetime.now(UTC)).total_seconds())
        if ttl > 0:
            if len(self._cache) >= self._cache_size:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= self._cache_size:
                    self._cache.clear()
            self._cache[digest] = (now + ttl, principal)
        return principal

    async def revoke(self, token_id: int) -> bool:
        """Revoke a token (the audited function ``rudder_token_revoke``); ``False`` if no such
        token or it was already revoked. A revoked token stays revoked (migration 0003)."""
        async with self._db("revoke"), self._engine.begin() as conn:
            token_hash = (await conn.execute(select(func.rudder_token_revoke(token_id)))).scalar_one()
        if token_hash is None:
            return False
        self._cache.pop(str(token_hash), None)
        return True

    async def close(self) -> None:
        self._cache.clear()
        if self._owns_engine:
            await self._engine.dispose()

    async def list(self) -> builtins.list[dict[str, Any]]:
        """Every token, oldest first, without its hash."""
        c = api_tokens.c
        async with self._db("list"), self._engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(c.id, c.name, c.role, c.created_at, c.revoked_at, c.expires_at).order_by(c.id)
                )
            ).all()
        return [
            {
                "id": int(r.id), "name": r.name, "role": r.role,
                "created_at": format_time(r.created_at),
                "revoked_at": None if r.revoked_at is None else format_time(r.revoked_at),
                "revoked": r.revoked_at is not None,
                "expires_at": None if r.expires_at is None else format_time(r.expires_at),
                "expired": r.expires_at is not None and r.expires_at <= datetime.now(UTC),
            }
            for r in rows
        ]


@dataclass
class FailureWindow:
    """Failed authentications of one source address within one window."""

    source: str
    opened: float  # monotonic clock
    first_at: datetime
    last_at: datetime
    failures: int = 0  # 401s
    refused: int = 0  # 429s once the limit was reached
    unrecorded: int = 0  # failures and refusals not audited one by one

    def summary(self, window_s: float) -> dict[str, Any]:
        """What the window's one audit row states (its ``changes``)."""
        return {
            "count": self.unrecorded, "failures": self.failures, "refused": self.refused,
            "first_at": format_time(self.first_at), "last_at": format_time(self.last_at),
            "window_s": window_s,
        }


class AuthFailureLimiter:
    """Failed authentications counted per source address in fixed windows (pure; clocks passed in).

    A window opens at a source's first failure and lasts ``window_s``. Within it the first
    failure is audited one by one (the caller does that), every other one and every refusal is
    only counted, and the source is refused (429, :meth:`retry_after`) once it reached ``limit``
    failures, until the window ends. An ended window with uncounted attempts is handed out once by
    :meth:`ended`, to be written as ONE audit row with its count, so a source that guesses tokens
    adds at most two rows per window to the hash chain, not one per guess. At most
    ``max_sources`` sources are tracked; past that, new ones share the key ``"*"``.

    The rows are bounded in total too (issue 17), not only per source: at most ``max_rows``
    first failures are audited one by one per ``window_s`` across every source (later ones are
    counted in their window's row), and when more windows end at once than the rows left, the
    rest are merged into one row (source ``"*"``): 10,000 addresses guessing write about
    ``max_rows`` rows a window, not 10,000.

    The limiter only ever sees failures: the caller checks a presented token before a source's
    budget, so a valid token is never refused for its address's (or the shared key's) failures.
    """

    OVERFLOW = "*"

    def __init__(self, *, limit: int, window_s: float, max_sources: int = 10_000,
                 max_rows: int = 100,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_sources = max_sources
        self.max_rows = max_rows
        self._clock = clock
        self._wall = wall
        self._open: dict[str, FailureWindow] = {}
        self._ended: list[FailureWindow] = []
        self._rows_since = clock()
        self._rows_left = max_rows

    def _take_rows(self, wanted: int) -> int:
        """Up to ``wanted`` audit rows from this period's budget; returns how many."""
        now = self._clock()
        if now - self._rows_since >= self.window_s:
            self._rows_since, self._rows_left = now, self.max_rows
        granted = min(wanted, self._rows_left)
        self._rows_left -= granted
        return granted

    def _key(self, source: str) -> str:
        if source in self._open or len(self._open) < self.max_sources:
            return source
        self._expire(self._clock())
        return source if len(self._open) < self.max_sources else self.OVERFLOW

    def _window(self, source: str, *, create: bool) -> FailureWindow | None:
        key = self._key(source)
        now = self._clock()
        w = self._open.get(key)
        if w is not None and now - w.opened >= self.window_s:
            self._close(key)
            w = None
        if w is None and create:
            at = self._wall()
            w = self._open[key] = FailureWindow(source=key, opened=now, first_at=at, last_at=at)
        return w

    def _close(self, key: str) -> None:
        w = self._open.pop(key)
        if w.unrecorded:
            self._ended.append(w)

    def _expire(self, now: float) -> None:
        # Windows are kept in the order they opened (a key is removed when its window closes), so
        # the expired ones are a prefix: this stays cheap while 10,000 sources are tracked.
        expired = []
        for key, w in self._open.items():
            if now - w.opened < self.window_s:
                break
            expired.append(key)
        for key in expired:
            self._close(key)

    def retry_after(self, source: str) -> int | None:
        """Seconds until ``source`` may try again, or ``None`` when it is not refused."""
        w = self._window(source, create=False)
        if w is None or w.failures < self.limit:
            return None
        return max(1, math.ceil(self.window_s - (self._clock() - w.opened)))

    def failed(self, source: str, *, audited_if_first: bool) -> bool:
        """Count a failed authentication; ``True`` if the caller must audit this one by itself
        (the window's first, when the caller audits failures at all)."""
        w = self._window(source, create=True)
        assert w is not None
        w.failures += 1
        w.last_at = self._wall()
        if w.failures == 1 and audited_if_first and self._take_rows(1):
            return True
        w.unrecorded += 1
        return False

    def refused(self, source: str) -> None:
        """Count an attempt refused with 429 (never audited by itself)."""
        w = self._window(source, create=True)
        assert w is not None
        w.refused += 1
        w.unrecorded += 1
        w.last_at = self._wall()

    def ended(self, *, everything: bool = False) -> builtins.list[FailureWindow]:
        """Windows that ended with attempts not audited one by one (each handed out once);
        ``everything``: close the open ones too (at shutdown)."""
        if everything:
            for source in builtins.list(self._open):
                self._close(source)
        else:
            self._expire(self._clock())
        out, self._ended = self._ended, []
        if not out:
            return out
        granted = self._take_rows(len(out))
        if granted == len(out):
            return out
        # Past the budget the rest is one row (even with no budget left: no count is ever lost).
        keep = max(granted - 1, 0)
        return [*out[:keep], _merged(out[keep:])]

    def requeue(self, windows: builtins.list[FailureWindow]) -> None:
        """Hand ``windows`` out again (their audit row could not be written)."""
        self._ended[:0] = windows


def _merged(windows: builtins.list[FailureWindow]) -> FailureWindow:
    """Several ended windows as one (source ``"*"``): the audit row budget is spent."""
    return FailureWindow(
        source=AuthFailureLimiter.OVERFLOW, opened=min(w.opened for w in windows),
        first_at=min(w.first_at for w in windows), last_at=max(w.last_at for w in windows),
        failures=sum(w.failures for w in windows), refused=sum(w.refused for w in windows),
        unrecorded=sum(w.unrecorded for w in windows),
    )


def failure_entry(window: FailureWindow, *, window_s: float) -> AuditEntry:
    """The one audit row of a window's failed authentications after its first (a rejected
    decision with ``reason_code`` ``auth_failures`` and the count in ``changes``)."""
    return AuditEntry(
        event_id=None, stage=AuditStage.DECISION, decision=Decision.REJECTED,
        reason_code=AUTH_FAILURES,
        reason=(f"{window.unrecorded} failed authentication(s) from {window.source} between "
                f"{format_time(window.first_at)} and {format_time(window.last_at)} not recorded one by "
                f"one ({window.refused} refused with 429 after {window.failures} failures)"),
        auth_method="bearer", source_ip=window.source, changes=window.summary(window_s),
        at=window.last_at,
    )


def create_token_sync(url: str, name: str, role: Role | str, *, ttl_s: float | None = None) -> str:
    """Create a token from synchronous code (``rudder token create``, ``rudder up``).

    Runs its own event loop in a worker thread, so it also works when the calling thread already
    runs one. Returns the plaintext token. Raises ``AuditUnavailable`` / ``InvalidRequest``.
    """

    async def run() -> str:
        from controlplane.audit.store import AuditStore  # the store imports nothing of this module

        audit = AuditStore.from_url(url, pool_size=1)
        try:
            expires = None if ttl_s is None else datetime.now(UTC) + timedelta(seconds=ttl_s)
            token, token_id = await TokenStore(audit.engine).create(name, role, expires_at=expires)
            # The database audits the creation itself (token_audit); the audit log says it too.
            await audit.append(AuditEntry(
                event_id=None, stage=AuditStage.DECISION, decision=Decision.ACCEPTED,
                reason_code="token_created", actor=f"cli:{getpass.getuser()}", auth_method="database",
                op="token_create", reason=f"API token {token_id} ({name}, {Role(role).value}) created",
                changes={"token_id": token_id, "name": name, "role": Role(role).value,
                         "expires_at": format_time(expires) if expires else None},
            ))
            return token
        finally:
            await audit.close()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rudder-token") as pool:
        return pool.submit(asyncio.run, run()).result()


__all__ = [
    "ROLE_ACTIONS",
    "Action",
    "AuthFailureLimiter",
    "FailureWindow",
    "Principal",
    "Role",
    "TokenStore",
    "create_token_sync",
    "failure_entry",
    "generate_token",
    "hash_token",
]
