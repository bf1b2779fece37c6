"""API tokens against a real PostgreSQL: hashed at rest, constant-time checked, revocable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

import migrations
from cli.embedded import EmbeddedPostgres
from controlplane.audit.store import AuditStore
from controlplane.auth import Action, Principal, Role, TokenStore, create_token_sync, hash_token
from controlplane.protocol.errors import AuditUnavailable, InvalidRequest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
async def db(database_url: str, database_owner_url: str) -> str:
    await migrations.upgrade_async(database_owner_url)
    return database_url


@pytest.fixture
async def tokens(db: str) -> AsyncIterator[TokenStore]:
    audit = AuditStore.from_url(db)
    try:
        yield TokenStore(audit.engine)  # shares the audit store's engine
    finally:
        await audit.close()


async def test_create_authenticate_revoke(tokens: TokenStore) -> None:
    plaintext, token_id = await tokens.create("ci-operator", Role.OPERATOR)
    assert plaintext.startswith("rdr_")
    principal = await tokens.authenticate(plaintext)
    assert principal == Principal(name="ci-operator", role=Role.OPERATOR, token_id=token_id)
    assert principal.can(Action.WRITE_POLICY) and not principal.can(Action.READ_AUDIT)

    assert await tokens.revoke(token_id) is True
    assert await tokens.authenticate(plaintext) is None  # at once on this replica (cache dropped)
    assert await tokens.revoke(token_id) is False
    assert await tokens.revoke(10**12) is False
    listed = {t["id"]: t for t in await tokens.list()}
    assert listed[token_id]["revoked"] is True and listed[token_id]["revoked_at"] is not None
    assert listed[token_id]["role"] == "operator" and "token_hash" not in listed[token_id]


@pytest.mark.parametrize("wrong", [None, "", "rdr_", "Bearer x", "rdr_" + "A" * 43, "x" * 5000])
async def test_wrong_tokens_are_refused(tokens: TokenStore, wrong: str | None) -> None:
    await tokens.create("someone", Role.ADMIN)
    assert await tokens.authenticate(wrong) is None


async def test_a_near_miss_is_refused(tokens: TokenStore) -> None:
    plaintext, _ = await tokens.create("near", Role.VIEWER)
    flipped = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    assert await tokens.authenticate(flipped) is None
    assert await tokens.authenticate(plaintext + "x") is None
    assert await tokens.authenticate(plaintext) is not None


async def test_only_the_hash_is_stored(tokens: TokenStore, db: str) -> None:
    plaintext, token_id = await tokens.create("hashed", Role.AUDITOR)
    conn = await asyncpg.connect(db.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        row = await conn.fetchrow("SELECT * FROM api_tokens WHERE id = $1", token_id)
        dump = await conn.fetchval("SELECT string_agg(t::text, '|') FROM api_tokens t")
    finally:
        await conn.close()
    assert row is not None and row["token_hash"] == hash_token(plaintext)
    assert plaintext not in dump and plaintext[4:] not in dump


async def test_revocation_on_another_replica(db: str) -> None:
    a = TokenStore.from_url(db)
    b = TokenStore.from_url(db, timeout_s=2.0)
    b_uncached = TokenStore(b.engine, cache_ttl_s=0)
    try:
        plaintext, token_id = await a.create("shared", Role.VIEWER)
        assert await b_uncached.authenticate(plaintext) is not None
        assert await a.revoke(token_id)
        assert await b_uncached.authenticate(plaintext) is None
    finally:
        await a.close()
        await b.close()


async def test_bad_role_or_name(tokens: TokenStore) -> None:
    with pytest.raises(InvalidRequest) as info:
        await tokens.create("x", "superuser")
    assert info.value.field == "role"
    with pytest.raises(InvalidRequest) as info:
        await tokens.create("  ", Role.VIEWER)
    assert info.value.field == "name"


async def test_create_token_sync_from_inside_a_running_loop(db: str, tokens: TokenStore) -> None:
    plaintext = create_token_sync(db, "cli-admin", "admin")
    principal = await tokens.authenticate(plaintext)
    assert principal is not None and principal.role is Role.ADMIN and principal.name == "cli-admin"
    # and from a plain thread, as `rudder token create` does
    other = await asyncio.to_thread(create_token_sync, db, "cli-viewer", Role.VIEWER)
    assert (await tokens.authenticate(other)) is not None


async def test_postgres_down_is_audit_unavailable(own_postgres: EmbeddedPostgres) -> None:
    await migrations.upgrade_async(own_postgres.url)
    store = TokenStore.from_url(own_postgres.url, timeout_s=1.0)
    uncached = TokenStore(store.engine, cache_ttl_s=0)
    try:
        plaintext, _ = await store.create("t", Role.OPERATOR)
        await asyncio.to_thread(own_postgres.stop)
        with pytest.raises(AuditUnavailable) as info:
            await uncached.authenticate(plaintext)
        assert info.value.__cause__ is not None
        with pytest.raises(AuditUnavailable):
            await store.create("u", Role.VIEWER)
        await asyncio.to_thread(own_postgres.start)
        assert await uncached.authenticate(plaintext) is not None
    finally:
        await store.close()


# ---- issue 17: the database password is not an admin token -------------------------------------


async def test_a_minted_or_unrevoked_token_with_the_app_role_is_refused(db: str, tokens: TokenStore) -> None:
    """The app role (the control plane's database password) can neither insert an admin token
    nor un-revoke one; what it creates or revokes goes through the audited functions."""
    plaintext, token_id = await tokens.create("to-revoke", Role.ADMIN)
    assert await tokens.revoke(token_id)
    conn = await asyncpg.connect(db.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        minted = "rdr_" + "m" * 43
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("INSERT INTO api_tokens (name, role, token_hash) VALUES ('mallory', 'admin', $1)",
                               hash_token(minted))
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("UPDATE api_tokens SET revoked_at = NULL WHERE id = $1", token_id)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("DELETE FROM token_audit")
        audited = await conn.fetch("SELECT action, db_user FROM token_audit WHERE token_id = $1 ORDER BY id",
                                   token_id)
        assert [r["action"] for r in audited] == ["create", "revoke"]
        me = await conn.fetchval("SELECT current_user")
        assert all(r["db_user"] == me for r in audited)
    finally:
        await conn.close()
    assert await tokens.authenticate(minted) is None
    assert await tokens.authenticate(plaintext) is None  # still revoked
    assert not await tokens.revoke(token_id)  # and stays so


async def test_an_expired_token_is_refused(tokens: TokenStore) -> None:
    from datetime import UTC, datetime, timedelta

    plaintext, _ = await tokens.create("short", Role.VIEWER,
                                       expires_at=datetime.now(UTC) + timedelta(seconds=1))
    assert await tokens.authenticate(plaintext) is not None
    deadline = asyncio.get_running_loop().time() + 5
    while await tokens.authenticate(plaintext) is not None:  # refused once the second is over
        assert asyncio.get_running_loop().time() < deadline, "an expired token still authenticates"
        await asyncio.sleep(0.05)
    listed = {t["name"]: t for t in await tokens.list()}
    assert listed["short"]["expired"] is True and listed["short"]["expires_at"] is not None
    with pytest.raises(InvalidRequest):
        await tokens.create("past", Role.VIEWER, expires_at=datetime.now(UTC) - timedelta(seconds=1))
