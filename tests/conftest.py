"""Shared fixtures: real nats-server (JetStream, anonymous connections refused) and real PostgreSQL.

Every NATS server trusts the session's bus authority (:mod:`tests.buskit`); tests connect with the
credentials of the identity they stand for. ``RUDDER_TEST_DATABASE_URL`` names an external
PostgreSQL instead; fault tests that stop and restart a server start their own
(``own_nats`` / ``own_postgres``).

Databases come as production has them: owned by ``TEST_OWNER`` (migrations), used through
``TEST_APP`` (the control plane's role, SELECT/INSERT on the audit tables). ``database_url`` is
the app role's URL; ``database_owner_url`` the owner's, for migrations and for tests that play a
hostile owner.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings
from nats.aio.client import Client as NATS

from cli.embedded import (
    DatabaseAccess,
    DatabaseRole,
    EmbeddedNats,
    EmbeddedPostgres,
    new_password,
    scram_verifier,
)
from tests import buskit

EXTERNAL_PG = os.environ.get("RUDDER_TEST_DATABASE_URL")

# Property tests assert what holds, never how long an example took: hypothesis's default 200 ms
# deadline failed a first, cold example on a busy machine (a timing in a pass/fail test).
hypothesis_settings.register_profile("rudder", deadline=None)
hypothesis_settings.load_profile("rudder")


def pytest_configure(config: pytest.Config) -> None:
    """The suite runs what the checkout holds: not a compiled module older than its source
    (router.build; setup.py compiles the router's request path)."""
    from router import build

    if stale := build.stale_modules():
        raise pytest.UsageError(build.advice(stale))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What imports and collection made lives to the session's end: frozen out of the cyclic
    collector's way, as ``router.app.run`` does after start-up. The routers and workers that tests
    run in this process share its collector, and a full collection stops every thread: over the
    unfrozen heap of a whole run, single passes took up to a quarter of a second (an event loop
    stalled that long fails what a test waits for with a deadline)."""
    gc.collect()
    gc.freeze()


TEST_OWNER = DatabaseRole("rudder_owner", new_password())
TEST_APP = DatabaseRole("rudder_app", new_password())


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rudder")


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A JetStream server per test module (it starts in ~30 ms), so streams never leak; the streams
    are created as ``rudder bus init`` does (the bus admin)."""
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"), auth=buskit.authority().server_config)
    server.start()
    try:
        buskit.init_streams(server.url)
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A server this test may stop and restart (same store, same port), streams created."""
    server = EmbeddedNats(tmp_path / "nats", auth=buskit.authority().server_config)
    server.start()
    buskit.init_streams(server.url)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres | None]:
    if EXTERNAL_PG:
        yield None
        return
    server = EmbeddedPostgres(tmp_path_factory.mktemp("pg") / "data")
    server.start()
    try:
        yield server
    finally:
        server.stop(mode="immediate")


def fresh_database(server: EmbeddedPostgres | None) -> DatabaseAccess:
    """A new, empty database owned by ``TEST_OWNER`` (migrations not applied)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    if server is not None:
        return server.provision(name, owner=TEST_OWNER, app=TEST_APP)
    # External server: the same through its superuser URL.
    import asyncio

    import asyncpg

    assert EXTERNAL_PG
    base = EXTERNAL_PG.replace("postgresql+asyncpg://", "postgresql://")

    async def create() -> None:
        conn = await asyncpg.connect(base)
        try:
            for role in (TEST_OWNER, TEST_APP):
                if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role.name):
                    await conn.execute(f'CREATE ROLE "{role.name}" LOGIN')
                await conn.execute(f"ALTER ROLE \"{role.name}\" PASSWORD '{scram_verifier(role.password)}'")
            await conn.execute(f'CREATE DATABASE "{name}" OWNER "{TEST_OWNER.name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    head, _, _ = EXTERNAL_PG.rpartition("/")
    hostpart = head.rpartition("@")[2]

    def url(role: DatabaseRole) -> str:
        return f"postgresql+asyncpg://{role.name}:{role.password}@{hostpart}/{name}"

    return DatabaseAccess(name=name, owner=TEST_OWNER, app=TEST_APP,
                          owner_url=url(TEST_OWNER), app_url=url(TEST_APP))


@pytest.fixture(scope="module")
def database(postgres_server: EmbeddedPostgres | None) -> DatabaseAccess:
    """A fresh, empty database per test module (migrations not applied)."""
    return fresh_database(postgres_server)


@pytest.fixture(scope="module")
def database_url(database: DatabaseAccess) -> str:
    """The module's database as the control plane's app role (what every test uses by default)."""
    return database.app_url


@pytest.fixture(scope="module")
def database_owner_url(database: DatabaseAccess) -> str:
    """The same database as its owner: for migrations, and for tests that play the owner."""
    return database.owner_url


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL this test may stop and restart."""
    server = EmbeddedPostgres(tmp_path / "pgdata")
    server.start()
    try:
        yield server
    finally:
        server.stop(mode="immediate")


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A connection with the bus admin's rights (tests that publish what no service may)."""
    client = await buskit.admin_connect(nats_url)
    try:
        yield client
    finally:
        await client.close()
