"""Fixtures for control-plane integration tests: a migrated database and a token per role."""

from __future__ import annotations

import pytest

from migrations import upgrade_async
from tests.integration.cp_support import Tokens, make_tokens


@pytest.fixture(scope="module")
async def db(database_url: str, database_owner_url: str) -> str:
    """The module's fresh database, migrated to head by its owner; the app role's URL."""
    await upgrade_async(database_owner_url)
    return database_url


@pytest.fixture(scope="module")
async def tokens(db: str) -> Tokens:
    return await make_tokens(db)
