"""Shared fixtures: real nats-server (JetStream, anonymous connections refused) and real PostgreSQL.

Every NATS server trusts the session's bus authority (:mod:`tests.buskit`); tests connect with the
credentials of the identity they stand for. ``RUDDER_TEST_DATABASE_URL`` names an external
PostgreSQL instead; fault tests that stop and restart a server start their own
(``own_nats`` / ``own_postgres``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from cli.embedded import EmbeddedNats, EmbeddedPostgres
from tests import buskit

EXTERNAL_PG = os.environ.get("RUDDER_TEST_DATABASE_URL")


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


def _fresh_database(server: EmbeddedPostgres | None) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    if server is not None:
        return server.create_database(name)
    # External server: create a database through it.
    import asyncio

    import asyncpg

    assert EXTERNAL_PG
    base = EXTERNAL_PG.replace("postgresql+asyncpg://", "postgresql://")

    async def create() -> None:
        conn = await asyncpg.connect(base)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    head, _, _ = EXTERNAL_PG.rpartition("/")
    return f"{head}/{name}"


@pytest.fixture(scope="module")
def database_url(postgres_server: EmbeddedPostgres | None) -> str:
    """A fresh, empty database per test module (migrations not applied)."""
    return _fresh_database(postgres_server)


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
