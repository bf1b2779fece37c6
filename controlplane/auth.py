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
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from controlplane.audit.records import format_time
from controlplane.audit.store import bounded, make_engine
from controlplane.audit.tables import api_tokens
from controlplane.protocol.errors import InvalidRequest

TOKEN_PREFIX = "rdr_"


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

    async def create(self, name: str, role: Role | str) -> tuple[str, int]:
        """Create a token; returns (plaintext, id). The plaintext is never stored or shown again.

        Raises ``InvalidRequest`` for an unknown role or an empty name.
        """
        try:
            role = Role(role)
        except ValueError as exc:
            raise InvalidRequest(
                f"role must be one of {[r.value for r in Role]}", field="role"
            ) from exc
        if not name.strip():
            raise InvalidRequest("a token needs a name", field="name")
        token = generate_token()
        async with self._db("create"), self._engine.begin() as conn:
            token_id = (
                await conn.execute(
                    insert(api_tokens)
                    .values(name=name, role=role.value, token_hash=hash_token(token))
                    .returning(api_tokens.c.id)
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
                        api_tokens.c.token_hash, api_tokens.c.revoked_at,
                    ).where(api_tokens.c.token_hash == digest)
                )
            ).first()
        if row is None or not hmac.compare_digest(str(row.token_hash), digest):
            return None
        if row.revoked_at is not None:
            self._cache.pop(digest, None)
            return None
        principal = Principal(name=row.name, role=Role(row.role), token_id=int(row.id))
        if self._cache_ttl_s > 0:
            if len(self._cache) >= self._cache_size:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= self._cache_size:
                    self._cache.clear()
            self._cache[digest] = (now + self._cache_ttl_s, principal)
        return principal

    async def revoke(self, token_id: int) -> bool:
        """Revoke a token; ``False`` if no such token or it was already revoked."""
        async with self._db("revoke"), self._engine.begin() as conn:
            row = (
                await conn.execute(
                    update(api_tokens)
                    .where(api_tokens.c.id == token_id, api_tokens.c.revoked_at.is_(None))
                    .values(revoked_at=func.now())
                    .returning(api_tokens.c.token_hash)
                )
            ).first()
        if row is None:
            return False
        self._cache.pop(str(row.token_hash), None)
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
                    select(c.id, c.name, c.role, c.created_at, c.revoked_at).order_by(c.id)
                )
            ).all()
        return [
            {
                "id": int(r.id), "name": r.name, "role": r.role,
                "created_at": format_time(r.created_at),
                "revoked_at": None if r.revoked_at is None else format_time(r.revoked_at),
                "revoked": r.revoked_at is not None,
            }
            for r in rows
        ]


def create_token_sync(url: str, name: str, role: Role | str) -> str:
    """Create a token from synchronous code (``rudder token create``, ``rudder up``).

    Runs its own event loop in a worker thread, so it also works when the calling thread already
    runs one. Returns the plaintext token. Raises ``AuditUnavailable`` / ``InvalidRequest``.
    """

    async def run() -> str:
        store = TokenStore.from_url(url, pool_size=1)
        try:
            token, _ = await store.create(name, role)
            return token
        finally:
            await store.close()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rudder-token") as pool:
        return pool.submit(asyncio.run, run()).result()


__all__ = [
    "ROLE_ACTIONS",
    "Action",
    "Principal",
    "Role",
    "TokenStore",
    "create_token_sync",
    "generate_token",
    "hash_token",
]
