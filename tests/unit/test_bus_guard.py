"""Hostile but well-formed bus input (issue 7 item 3): the pure checks. A payload's ids must equal
its subject's, every size is bounded, timestamps carry a time zone, worker URLs match an
allow-list, drops are logged once per source and counted, and a policy stream that went backwards
is recognised."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from controlplane.protocol import limits
from controlplane.protocol.errors import InvalidRequest, SubjectMismatch, ValidationFailed
from controlplane.protocol.events import (
    AckStatus,
    ApplyAck,
    KvDumpReply,
    KvEvent,
    KvStored,
    MembershipEvent,
    MembershipOp,
    PolicyEvent,
    RouterStatus,
    StoredBlock,
    WorkerRecord,
    check_ack_subject,
    check_kv_dump,
    check_kv_subject,
    check_membership_subject,
    check_policy_subject,
    check_router_status_key,
    decode_apply_ack,
    decode_kv_event,
    decode_membership_event,
    decode_policy_event,
    decode_router_status,
)
from controlplane.protocol.guard import DEFAULT_WORKER_URL_ALLOW, Drops, UrlAllowList
from controlplane.protocol.policy import PolicyKind, PolicyOp
from controlplane.protocol.subjects import (
    acks_subject,
    kv_subject,
    membership_subject,
    policy_subject,
)
from router.policy_state import PolicyState, stream_went_backwards
from router.settings import RouterSettings
from tests.policy_keys import session_keys

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MODEL = "org/model-1.5:q4"


def _record(wid: int = 7, **kw: Any) -> WorkerRecord:
    base: dict[str, Any] = {"instance_id": wid, "model": MODEL, "url": "http://10.0.0.5:8000",
                            "block_size": 16, "kv_total_blocks": 1000, "max_num_batched_tokens": 8192,
                            "started_at": T0}
    base.update(kw)
    return WorkerRecord(**base)


def _membership(wid: int = 7) -> MembershipEvent:
    return MembershipEvent(op=MembershipOp.HEARTBEAT, worker=_record(wid), at=T0)


def _payload(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(event.to_bytes())
    return out


# -- ids must match the subject -------------------------------------------------------------------


def test_membership_ids_must_match_the_subject() -> None:
    check_membership_subject(membership_subject(MODEL, 7), _membership(7))
    with pytest.raises(SubjectMismatch) as info:
        check_membership_subject(membership_subject(MODEL, 8), _membership(7))  # speaks for 7 on 8's subject
    assert info.value.field == "worker" and info.value.facts["subject"] == membership_subject(MODEL, 8)
    assert "7" in info.value.message and "8" in info.value.message
    with pytest.raises(SubjectMismatch):
        check_membership_subject(membership_subject("other", 7), _membership(7))
    assert issubclass(SubjectMismatch, InvalidRequest)


def test_kv_dump_ack_status_and_policy_ids_must_match() -> None:
    kv = KvEvent(instance_id=7, event_id=0, data=KvStored(blocks=[StoredBlock(block_hash=1, tokens_hash=1)]))
    check_kv_subject(kv_subject(MODEL, 7), MODEL, kv)
    with pytest.raises(SubjectMismatch) as info:
        check_kv_subject(kv_subject(MODEL, 9), MODEL, kv)
    assert info.value.field == "instance_id"
    with pytest.raises(SubjectMismatch):
        check_kv_subject(kv_subject("other", 7), MODEL, kv)

    dump = KvDumpReply(instance_id=7, last_event_id=0, ranks=[])
    check_kv_dump(7, dump)
    with pytest.raises(SubjectMismatch):
        check_kv_dump(8, dump)

    ack = ApplyAck(router_id="r-a", model=MODEL, kind=PolicyKind.SELECTION, revision=3,
                   status=AckStatus.ACK, at=T0)
    check_ack_subject(acks_subject("r-a"), ack)
    with pytest.raises(SubjectMismatch) as info:
        check_ack_subject(acks_subject("r-b"), ack)
    assert info.value.field == "router_id"

    status = RouterStatus(router_id="r-a", models=[MODEL], started_at=T0, heartbeat_at=T0)
    check_router_status_key("r-a", status)
    with pytest.raises(SubjectMismatch):
        check_router_status_key("r-b", status)

    event = PolicyEvent(event_id=uuid.uuid4(), model=MODEL, kind=PolicyKind.SELECTION, op=PolicyOp.PATCH,
                        expected_revision=0, document={}, actor="a", request_id="r", at=T0)
    check_policy_subject(policy_subject(MODEL, "selection"), event)
    with pytest.raises(SubjectMismatch):
        check_policy_subject(policy_subject(MODEL, "busy_threshold"), event)
    with pytest.raises(SubjectMismatch):
        check_policy_subject(policy_subject("other", "selection"), event)


# -- bounds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("dp_size", 10**6),
    ("dp_size", limits.MAX_DP_SIZE + 1),
    ("block_size", limits.MAX_BLOCK_SIZE + 1),
    ("kv_total_blocks", limits.MAX_KV_TOTAL_BLOCKS + 1),
    ("max_num_batched_tokens", limits.MAX_BATCHED_TOKENS + 1),
    ("url", "http://10.0.0.5/" + "a" * limits.MAX_URL_CHARS),
    ("tokenizer", "t" * (limits.MAX_TOKENIZER_CHARS + 1)),
    ("model", "m" * 300),
    ("cache_tiers", ["device"] * (limits.MAX_CACHE_TIERS + 1)),
])
def test_worker_record_sizes_are_bounded(field: str, value: Any) -> None:
    payload = _payload(_membership())
    payload["worker"][field] = value
    with pytest.raises(InvalidRequest) as info:
        decode_membership_event(payload)
    assert info.value.field == f"worker.{field}"


def test_the_largest_accepted_worker_record_still_decodes() -> None:
    payload = _payload(_membership())
    payload["worker"].update(dp_size=limits.MAX_DP_SIZE, block_size=limits.MAX_BLOCK_SIZE)
    payload["load"] = [{"dp_rank": r, "active_prefill_tokens": limits.MAX_LOAD_VALUE}
                       for r in range(limits.MAX_DP_SIZE)]
    assert decode_membership_event(payload).worker.dp_size == limits.MAX_DP_SIZE


@pytest.mark.parametrize("load", [
    [{"dp_rank": 0, "active_prefill_tokens": limits.MAX_LOAD_VALUE + 1}],
    [{"dp_rank": 0, "running": -1}],
    [{"dp_rank": 1}],  # dp_size is 1
    [{"dp_rank": r % 1} for r in range(limits.MAX_DP_SIZE + 1)],
])
def test_per_rank_load_is_bounded(load: list[dict[str, int]]) -> None:
    payload = _payload(_membership())
    payload["load"] = load
    with pytest.raises(InvalidRequest) as info:
        decode_membership_event(payload)
    assert info.value.field.startswith("load") or "dp_rank" in info.value.message


def test_kv_event_lists_and_hashes_are_bounded() -> None:
    blocks = [{"block_hash": i, "tokens_hash": i} for i in range(limits.MAX_KV_EVENT_BLOCKS + 1)]
    too_many = {"instance_id": 7, "event_id": 0, "data": {"type": "stored", "blocks": blocks}}
    with pytest.raises(InvalidRequest) as info:
        decode_kv_event(too_many)
    assert info.value.field == "data.stored.blocks"
    removed = {"instance_id": 7, "event_id": 0, "data": {"type": "removed", "block_hashes": [2**64]}}
    with pytest.raises(InvalidRequest):
        decode_kv_event(removed)
    rank = {"instance_id": 7, "event_id": 0, "dp_rank": limits.MAX_DP_SIZE, "data": {"type": "cleared"}}
    with pytest.raises(InvalidRequest) as info:
        decode_kv_event(rank)
    assert info.value.field == "dp_rank"


def test_ack_and_status_strings_are_bounded() -> None:
    ack = _payload(ApplyAck(router_id="r-a", model=MODEL, kind=PolicyKind.SELECTION, revision=1,
                            status=AckStatus.NACK, at=T0))
    ack["detail"] = "x" * (limits.MAX_DETAIL_CHARS + 1)
    with pytest.raises(InvalidRequest) as info:
        decode_apply_ack(ack)
    assert info.value.field == "detail"
    status = _payload(RouterStatus(router_id="r-a", models=[MODEL], started_at=T0, heartbeat_at=T0))
    status["models"] = [f"m{i}" for i in range(limits.MAX_ROUTER_MODELS + 1)]
    with pytest.raises(InvalidRequest) as info:
        decode_router_status(status)
    assert info.value.field == "models"


# -- timestamps carry a time zone -----------------------------------------------------------------


def test_naive_timestamps_are_refused_everywhere() -> None:
    naive = "2026-01-01T00:00:00"
    status = _payload(RouterStatus(router_id="r-a", models=[MODEL], started_at=T0, heartbeat_at=T0))
    status["heartbeat_at"] = naive
    with pytest.raises(InvalidRequest) as info:
        decode_router_status(status)
    assert info.value.field == "heartbeat_at"
    membership = _payload(_membership())
    membership["at"] = naive
    with pytest.raises(InvalidRequest) as info:
        decode_membership_event(membership)
    assert info.value.field == "at"
    membership = _payload(_membership())
    membership["worker"]["started_at"] = naive
    with pytest.raises(InvalidRequest):
        decode_membership_event(membership)
    policy = _payload(PolicyEvent(event_id=uuid.uuid4(), model=MODEL, kind=PolicyKind.SELECTION,
                                  op=PolicyOp.PATCH, expected_revision=0, document={}, actor="a",
                                  request_id="r", at=T0))
    policy["at"] = naive
    with pytest.raises(InvalidRequest):
        decode_policy_event(policy)
    with pytest.raises(ValidationError):
        ApplyAck(router_id="r-a", model=MODEL, kind=PolicyKind.SELECTION, revision=1,
                 status=AckStatus.ACK, at=datetime(2026, 1, 1))  # naive: the point of the test
    # Any zone is fine (it is compared correctly with UTC).
    status["heartbeat_at"] = "2026-01-01T02:00:00+02:00"
    assert decode_router_status(status).heartbeat_at == T0


# -- worker URL allow-list ------------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8001", "http://localhost:9000/v1", "https://10.1.2.3", "http://172.20.0.4:80",
    "http://192.168.1.9:8000", "http://[::1]:8000", "http://[fd12::1]:8000", "http://LOCALHOST:1",
    "http://[::ffff:10.0.0.1]:80",
])
def test_default_allow_list_takes_loopback_and_private_ranges(url: str) -> None:
    UrlAllowList.parse(DEFAULT_WORKER_URL_ALLOW).check(url)


@pytest.mark.parametrize(("url", "why"), [
    ("http://169.254.169.254/latest/meta-data", "allow-list"),  # cloud metadata: link-local
    ("http://8.8.8.8:80", "allow-list"),
    ("http://evil.example.com:8000", "allow-list"),
    ("http://172.32.0.1", "allow-list"),  # just outside 172.16/12
    ("http://[::ffff:8.8.8.8]:80", "allow-list"),
    ("ftp://127.0.0.1/x", "scheme"),
    ("file:///etc/passwd", "scheme"),
    ("127.0.0.1:8000", "scheme"),
    ("http://user:pw@127.0.0.1:8000", "user information"),
    ("http://127.0.0.1:99999", "not a URL"),
    ("http://", "no host"),
])
def test_default_allow_list_refuses_the_rest(url: str, why: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        UrlAllowList.parse(DEFAULT_WORKER_URL_ALLOW).check(url)
    assert info.value.field == "url" and why in info.value.message


def test_allow_list_names_suffixes_and_networks() -> None:
    allow = UrlAllowList.parse("worker-1, *.svc.cluster.local, 203.0.113.0/24, 198.51.100.7")
    for ok in ("http://worker-1:8000", "http://w.ns.svc.cluster.local", "http://203.0.113.9",
               "https://198.51.100.7:443"):
        assert allow.allows(ok), ok
    for bad in ("http://worker-2:8000", "http://svc.cluster.local.evil", "http://127.0.0.1",
                "http://198.51.100.8", "http://xsvc.cluster.local"):
        assert not allow.allows(bad), bad


@pytest.mark.parametrize("spec", ["", " , ", "not a host!", "10.0.0.0/33", "*."])
def test_bad_allow_list_is_refused_naming_the_setting(spec: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        UrlAllowList.parse(spec)
    assert info.value.field == "worker_url_allow"
    with pytest.raises(ValidationError) as verr:
        RouterSettings(models=["m"], worker_url_allow=spec)
    assert "worker_url_allow" in str(verr.value)


def test_router_setting_defaults_to_loopback_and_private(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = session_keys().verify_path
    assert RouterSettings(models=["m"], policy_verify_keys=keys).url_allow_list.allows("http://127.0.0.1:1")
    monkeypatch.setenv("RUDDER_WORKER_URL_ALLOW", "203.0.113.0/24")
    allow = RouterSettings(models=["m"], policy_verify_keys=keys).url_allow_list
    assert allow.allows("http://203.0.113.1") and not allow.allows("http://127.0.0.1")


# -- drops: logged once per source, counted every time ---------------------------------------------


def test_drops_log_once_per_source_and_count_every_time(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[tuple[str, str]] = []
    drops = Drops(logging.getLogger("test.drops"), count=lambda k, r: counted.append((k, r)), max_sources=2)
    with caplog.at_level(logging.WARNING, logger="test.drops"):
        for _ in range(3):
            drops.drop("membership", "subject_mismatch", "rudder.workers.m.1", "names 2")
        drops.drop("membership", "url_not_allowed", "rudder.workers.m.1", "bad url")
        for i in range(5):
            drops.drop("kv", "malformed", f"rudder.kv.m.{i}", "x")
    lines = [r.getMessage() for r in caplog.records]
    assert len(counted) == 9 and drops.totals[("membership", "subject_mismatch")] == 3
    assert sum("rudder.workers.m.1 (subject_mismatch): names 2" in line for line in lines) == 1
    assert sum("url_not_allowed" in line for line in lines) == 1
    assert not any("rudder.kv.m." in line for line in lines)  # past the bound: counted, not logged
    assert sum("no longer logging" in line for line in lines) == 1


def test_drops_log_payload_text_on_one_line(caplog: pytest.LogCaptureFixture) -> None:
    drops = Drops(logging.getLogger("test.drops.line"))
    with caplog.at_level(logging.WARNING, logger="test.drops.line"):
        drops.drop("router_status", "malformed", "key r-a", "bad\nFAKE LOG LINE " + "x" * 2000)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "bad\\nFAKE" in line and len(line) < 700


# -- a policy stream that went backwards -----------------------------------------------------------


def test_stream_going_backwards_is_recognised() -> None:
    later = T0 + timedelta(minutes=5)
    assert stream_went_backwards(known_created=T0, created=T0, last_seq=10, max_seen=10) is None
    assert stream_went_backwards(known_created=None, created=T0, last_seq=10, max_seen=4) is None
    recreated = stream_went_backwards(known_created=T0, created=later, last_seq=50, max_seen=10)
    assert recreated is not None and "created again" in recreated
    shorter = stream_went_backwards(known_created=None, created=None, last_seq=2, max_seen=10)
    assert shorter is not None and "below the applied revision 10" in shorter


def test_resync_forgets_revisions_and_keeps_the_last_good_values() -> None:
    state = PolicyState(router_id="r", models=["m"], startup={k: {} for k in PolicyKind},
                        cache_inputs=frozenset(), keyring=session_keys().keyring)

    def event(expected: int, temperature: float) -> bytes:
        return PolicyEvent(event_id=uuid.uuid4(), model="m", kind=PolicyKind.SELECTION, op=PolicyOp.PATCH,
                           expected_revision=expected, document={"router_temperature": temperature},
                           actor="a", request_id="r", at=T0).to_bytes()

    def signed(payload: bytes) -> tuple[bytes, dict[str, str]]:
        return payload, session_keys().headers_for("m", PolicyKind.SELECTION, payload)

    assert state.apply("m", PolicyKind.SELECTION, 40, *signed(event(0, 0.5))).outcome.value == "ACK"
    assert state.max_seen() == 40
    # Without a re-sync the new stream's revision 3 would be skipped as "already seen".
    assert state.apply("m", PolicyKind.SELECTION, 3, *signed(event(0, 0.7))).outcome.value == "SKIP"
    assert state.resync() == {"m|selection": 40}
    doc = state.get("m", PolicyKind.SELECTION)
    assert doc.revision == 0 and doc.effective["router_temperature"] == 0.5  # last good values
    applied = state.apply("m", PolicyKind.SELECTION, 3, *signed(event(0, 0.7)))
    assert applied.outcome.value == "ACK" and not applied.gap
    assert doc.revision == 3 and doc.effective["router_temperature"] == 0.7
