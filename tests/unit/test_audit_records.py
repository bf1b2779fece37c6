"""Canonical JSON and the audit row hash: stable, and sensitive to every field (pure, no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from controlplane.audit.audit_chain import chain_rows, decode_cursor, encode_cursor
from controlplane.audit.records import (
    GENESIS_HASH,
    AuditEntry,
    AuditRow,
    AuditStage,
    Decision,
    canonical_json,
    compute_row_hash,
)
from controlplane.protocol.errors import InvalidRequest

AT = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
EVENT = uuid.UUID("12345678-1234-5678-1234-567812345678")


def full_entry(**overrides: Any) -> AuditEntry:
    values: dict[str, Any] = dict(
        event_id=EVENT, stage=AuditStage.DECISION, decision=Decision.ACCEPTED,
        reason_code="ok", reason="fine", actor="alice", roles=["operator"], auth_method="token",
        source_ip="10.0.0.1", user_agent="rudder/1", request_id="req-1", model="m/x:1",
        kind="selection", op="patch", expected_revision=4, head_revision=4, new_revision=9,
        changes={"overlap_score_credit": 0.5, "router_temperature": None},
        before={"overlap_score_credit": 1.0}, after={"overlap_score_credit": 0.5},
        dry_run=False, at=AT,
    )
    values.update(overrides)
    return AuditEntry(**values)


def full_row(**overrides: Any) -> AuditRow:
    entry = full_entry()
    (row,) = chain_rows([entry], last_id=6, last_hash=GENESIS_HASH)
    return dataclasses.replace(row, **overrides) if overrides else row


def test_canonical_json_is_sorted_compact_utf8() -> None:
    assert canonical_json({"b": 1, "a": [1, 2], "é": "ü"}) == '{"a":[1,2],"b":1,"é":"ü"}'.encode()
    assert canonical_json({"x": {"z": None, "y": True}}) == b'{"x":{"y":true,"z":null}}'


def test_canonical_json_numbers_survive_a_jsonb_round_trip() -> None:
    # JSONB hands 1.0 back as 1.0, 1e20 as the integer 100000000000000000000: same bytes.
    assert canonical_json({"v": 1.0}) == canonical_json({"v": 1}) == b'{"v":1}'
    assert canonical_json({"v": 1e20}) == canonical_json({"v": 10**20})
    assert canonical_json({"v": 0.1}) == b'{"v":0.1}'
    assert canonical_json({"v": 1e-7}) == canonical_json(json.loads('{"v": 0.0000001}'))
    assert canonical_json({"v": -0.0}) == b'{"v":0}'
    assert canonical_json({"v": True}) == b'{"v":true}'  # bool is not turned into 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_canonical_json_refuses_non_finite_numbers(bad: float) -> None:
    with pytest.raises(ValueError):
        canonical_json({"v": bad})


def test_canonical_json_renders_times_uuids_and_enums() -> None:
    other_zone = AT.astimezone(timezone(timedelta(hours=5)))
    assert canonical_json({"at": other_zone}) == b'{"at":"2026-01-02T03:04:05.678901+00:00"}'
    assert canonical_json({"e": EVENT}) == f'{{"e":"{EVENT}"}}'.encode()
    assert canonical_json({"s": AuditStage.RECEIVED}) == b'{"s":"received"}'


def test_row_hash_is_known_and_stable() -> None:
    fields = {"id": 1, "at": AT, "stage": "received"}
    expected = hashlib.sha256(
        b"0" * 64 + b'{"at":"2026-01-02T03:04:05.678901+00:00","id":1,"stage":"received"}'
    ).hexdigest()
    assert compute_row_hash(GENESIS_HASH, fields) == expected
    assert compute_row_hash(GENESIS_HASH, dict(reversed(list(fields.items())))) == expected


def test_row_hash_matches_for_python_values_and_the_json_export() -> None:
    row = full_row()
    assert row.expected_hash() == row.row_hash
    exported = json.loads(json.dumps(row.to_dict()))
    assert compute_row_hash(exported["prev_hash"], exported) == row.row_hash
    assert exported["at"] == "2026-01-02T03:04:05.678901+00:00"
    assert exported["event_id"] == str(EVENT)
    assert exported["id"] == 7 and exported["prev_hash"] == GENESIS_HASH


CHANGED_VALUES: dict[str, Any] = {
    "id": 8, "event_id": uuid.uuid4(), "stage": AuditStage.RECEIVED, "decision": Decision.PENDING,
    "reason_code": "other", "reason": "other", "actor": "bob", "roles": ["admin"],
    "auth_method": "mtls", "source_ip": "10.0.0.2", "user_agent": "curl", "request_id": "req-2",
    "model": "m/y", "kind": "busy_threshold", "op": "reset", "expected_revision": 5,
    "head_revision": 5, "new_revision": 10, "changes": {"overlap_score_credit": 0.6},
    "before": {}, "after": {"overlap_score_credit": 0.6}, "dry_run": True,
    "at": AT + timedelta(microseconds=1),
}


def test_every_field_is_covered_by_the_hash_test() -> None:
    names = {f.name for f in dataclasses.fields(AuditRow)} - {"prev_hash", "row_hash"}
    assert names == set(CHANGED_VALUES)


@pytest.mark.parametrize("name", sorted(CHANGED_VALUES))
def test_changing_any_field_changes_the_hash(name: str) -> None:
    row = full_row()
    overrides = {name: CHANGED_VALUES[name]}
    if name == "stage":
        overrides["decision"] = Decision.PENDING
    if name == "decision":
        overrides["stage"] = AuditStage.RECEIVED
    changed = dataclasses.replace(row, **overrides)
    assert changed.expected_hash() != row.row_hash


def test_changing_prev_hash_changes_the_hash() -> None:
    row = full_row()
    assert compute_row_hash("f" * 64, row.hashed_fields()) != row.row_hash


def test_chain_rows_links_each_row_to_the_previous() -> None:
    entries = [full_entry(), full_entry(actor="bob"), full_entry(actor="carol")]
    rows = chain_rows(entries, last_id=10, last_hash="a" * 64)
    assert [r.id for r in rows] == [11, 12, 13]
    assert rows[0].prev_hash == "a" * 64
    assert rows[1].prev_hash == rows[0].row_hash and rows[2].prev_hash == rows[1].row_hash
    assert all(r.expected_hash() == r.row_hash for r in rows)


def test_entries_are_normalised_and_checked() -> None:
    entry = full_entry(at=AT.astimezone(timezone(timedelta(hours=-3))), stage="decision",
                       decision="rejected", event_id=str(EVENT))
    assert entry.at.tzinfo is UTC and entry.at == AT
    assert entry.stage is AuditStage.DECISION and entry.decision is Decision.REJECTED
    assert entry.event_id == EVENT
    with pytest.raises(ValueError, match="timezone"):
        full_entry(at=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="pending"):
        full_entry(stage=AuditStage.RECEIVED, decision=Decision.ACCEPTED)
    with pytest.raises(ValueError, match="never pending"):
        full_entry(stage=AuditStage.DECISION, decision=Decision.PENDING)


def test_cursor_round_trip_and_refusal() -> None:
    assert decode_cursor(encode_cursor(12345)) == 12345
    for bad in ["", "!!!", "djI6MTI", encode_cursor(0), "bm90LWEtY3Vyc29y"]:
        with pytest.raises(InvalidRequest) as info:
            decode_cursor(bad)
        assert info.value.field == "cursor"


def test_text_the_database_cannot_hold_is_recorded_as_a_replacement_character() -> None:
    """PostgreSQL holds no NUL in text or JSONB, and an unpaired surrogate is no UTF-8: a refusal
    naming such input could not be written (the admin API fuzzer found every caller answered 503
    instead of its refusal being recorded)."""
    entry = full_entry(model="a\x00b", reason="unknown parameter '\x00'", user_agent="x\ud800",
                       changes={"k\x00": ["\x00", {"n": "\udfff"}], "ok": 1.5})
    assert entry.model == "a\ufffdb" and entry.reason == "unknown parameter '\ufffd'"
    assert entry.user_agent == "x\ufffd"
    assert entry.changes == {"k\ufffd": ["\ufffd", {"n": "\ufffd"}], "ok": 1.5}
    assert b"\\u0000" not in canonical_json(entry.hashed_fields())  # hashed as stored
