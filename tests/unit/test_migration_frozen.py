"""Migrations carry frozen copies of what they used, never the live code (pure, no network).

Migration 0002 links the ACK rows written before it with the ACK chain hash of its time and grants
the app role the tables of its time. These tests prove each copy equal to the live code *for the
fields and tables of today*, without the migration importing it. When the live hash or grant list
changes on purpose, the copy stays as it is: a changed hash is a new migration (and an upcaster
for verifying the old rows), and the comparison here then moves to the known values of 0002.
"""

from __future__ import annotations

import ast
import importlib.util
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from controlplane.audit.records import (
    ACK_HASHED_FIELDS,
    GENESIS_HASH,
    ack_hashed_fields,
    compute_row_hash,
)
from migrations import grants

VERSIONS = Path(__file__).resolve().parents[2] / "migrations" / "versions"
EVENT = uuid.UUID("12345678-1234-5678-1234-567812345678")
AT = datetime(2026, 12, 1, 3, 4, 5, 678901, tzinfo=UTC)


def load(filename: str) -> ModuleType:
    """A migration file as a module, the way Alembic loads it (by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(f"rudder_migration_{filename[:4]}", VERSIONS / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def m0002() -> ModuleType:
    return load("0002_roles_ack_chain.py")


def ack_row(**overrides: Any) -> dict[str, Any]:
    """An ACK row as 0002 reads it from ``router_acks`` (Python values; ``stream_seq`` None)."""
    row: dict[str, Any] = {
        "id": 1, "stream_seq": None, "router_id": "router-a", "model": "org/model:v1",
        "kind": "selection", "revision": 7, "status": "ACK", "detail": "", "event_id": EVENT,
        "effective": {"router_temperature": 0.5, "overlap_score_credit": 1.0}, "at": AT,
    }
    row.update(overrides)
    return row


ROWS = [
    ack_row(),
    ack_row(id=2, status="NACK", detail="überschrieben: \u2603", event_id=None, effective={}),
    ack_row(id=3, kind="busy_threshold", revision=2**40,
            effective={"nested": {"b": [1, 2.5, None, True], "a": 1e20}, "x": -0.0},
            at=AT.astimezone(timezone(timedelta(hours=5, minutes=30)))),
    ack_row(id=4, stream_seq=99, at=datetime(2026, 12, 1, tzinfo=UTC)),
]


def test_no_migration_imports_the_control_plane() -> None:
    for path in sorted(VERSIONS.glob("*.py")):
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        assert not {name for name in imported if name.split(".")[0] == "controlplane"}, path.name


def test_frozen_fields_are_todays_fields(m0002: ModuleType) -> None:
    assert m0002._ACK_HASHED_FIELDS == ACK_HASHED_FIELDS
    assert m0002._GENESIS_HASH == GENESIS_HASH


@pytest.mark.parametrize("row", ROWS, ids=[str(r["id"]) for r in ROWS])
def test_frozen_ack_hash_equals_the_live_hash(m0002: ModuleType, row: dict[str, Any]) -> None:
    for prev in (GENESIS_HASH, "ab" * 32):
        assert m0002.ack_row_hash(prev, row) == compute_row_hash(prev, ack_hashed_fields(row))


def test_frozen_ack_hash_is_pinned(m0002: ModuleType) -> None:
    # The digest 0002 gives this row, whatever the live code does later.
    assert m0002.ack_row_hash(GENESIS_HASH, ack_row()) == (
        "275a64278317e128b615a4420a2daf8ef73861240411fe187f46ce2e74019626")


def test_frozen_ack_hash_refuses_what_the_live_hash_refuses(m0002: ModuleType) -> None:
    with pytest.raises(ValueError):
        m0002.ack_row_hash(GENESIS_HASH, ack_row(effective={"x": float("nan")}))
    with pytest.raises(ValueError, match="timezone"):
        m0002.ack_row_hash(GENESIS_HASH, ack_row(at=datetime(2026, 1, 1)))
    with pytest.raises(TypeError):
        m0002.ack_row_hash(GENESIS_HASH, ack_row(effective={"x": object()}))


def test_frozen_grants_are_todays_grants(m0002: ModuleType) -> None:
    # 0003 changed the live list on purpose (issue 17: tokens only through audited functions);
    # 0002's copy stays what it was, and 0003's copy is today's.
    assert m0002._GRANTS_AT_0002 == {
        "audit_log": ("SELECT", "INSERT"),
        "router_acks": ("SELECT", "INSERT"),
        "api_tokens": ("SELECT", "INSERT", "UPDATE (revoked_at)"),
    }
    m0003 = load("0003_token_functions.py")
    assert m0003._GRANTS_AT_0003 == grants.APP_GRANTS
    assert m0003._FUNCTIONS_AT_0003 == grants.APP_FUNCTIONS
