"""Shared fixtures: real nats-server (JetStream) and real PostgreSQL.

``RUDDER_TEST_NATS_URL`` / ``RUDDER_TEST_DATABASE_URL`` name external servers instead; fault tests
that stop and restart a server always start their own (``own_nats`` / ``own_postgres``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from cli.embedded import EmbeddedNats, EmbeddedPostgres

EXTERNAL_NATS = os.environ.get("RUDDER_TEST_NATS_URL")
EXTERNAL_PG = os.environ.get("RUDDER_TEST_DATABASE_URL")


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rudder")


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A JetStream server per test module (it starts in ~30 ms), so streams never leak."""
    if EXTERNAL_NATS:
        yield EXTERNAL_NATS
        return
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A server this test may stop and restart (same store, same port)."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
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
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()
