"""Fuzzing every input a process reads from the bus or a request (issue 18, item 4), Hypothesis:
random bytes, random JSON and mutations of valid messages. Never an unhandled exception (only
``InvalidRequest`` and its subclasses), and never a state change from an invalid message."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.protocol.checkpoints import AuditCheckpoint, ChainSegment, decode_checkpoint
from controlplane.protocol.errors import InvalidRequest
from controlplane.protocol.events import (
    AckStatus,
    ApplyAck,
    KvDumpReply,
    KvEvent,
    KvStored,
    MembershipEvent,
    MembershipOp,
    RouterStatus,
    StoredBlock,
    WorkerRecord,
    check_ack_subject,
    check_kv_subject,
    check_membership_subject,
    check_policy_subject,
    check_router_status_key,
    decode_apply_ack,
    decode_kv_dump,
    decode_kv_event,
    decode_membership_event,
    decode_policy_event,
    decode_router_status,
)
from controlplane.protocol.policy import (
    PolicyKind,
    apply_patch,
    parse_kind,
    validate_changes,
    validate_document,
    validate_unset,
)
from controlplane.protocol.subjects import (
    acks_subject,
    decode_model_key,
    kv_subject,
    membership_subject,
    parse_policy_subject,
    policy_subject,
    router_status_key,
)
from router.commands import ApplyPolicy
from router.policy_state import Outcome
from router.scheduler import Scheduler
from router.targets import (
    HDR_DP_RANK,
    HDR_PREFILL,
    HDR_PREFILL_DP_RANK,
    HDR_TTFT_SLO,
    HDR_WORKER,
    parse_pin,
    parse_targets,
    parse_ttft_slo,
)
from tests.policy_keys import session_keys
from tests.unit.test_router_scheduler import Clock, _sched

pytestmark = pytest.mark.timeout(60)

NOW = datetime(2026, 6, 1, tzinfo=UTC)
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: Per decoder and strategy (7 decoders x 3 strategies).
FUZZ_DECODER = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)

_RECORD = WorkerRecord(instance_id=7, model="m", url="http://w7", block_size=4, kv_total_blocks=100,
                       max_num_batched_tokens=64, started_at=NOW)


def _policy_sample() -> dict[str, Any]:
    return {"event_id": str(uuid.uuid4()), "model": "m", "kind": "selection", "op": "patch",
            "expected_revision": 0, "changes": {"router_temperature": 0.5},
            "document": {"router_temperature": 0.5}, "actor": "t", "request_id": "q", "at": NOW.isoformat()}


# decoder, a valid message, and the check a consumer runs on it against its subject
DECODERS: dict[str, tuple[Callable[[Any], Any], dict[str, Any], Callable[[Any], None]]] = {
    "policy": (decode_policy_event, _policy_sample(),
               lambda e: check_policy_subject(policy_subject("m", "selection"), e)),
    "ack": (decode_apply_ack, ApplyAck(router_id="r1", model="m", kind=PolicyKind.SELECTION, revision=3,
                                       status=AckStatus.ACK, at=NOW).model_dump(mode="json"),
            lambda e: check_ack_subject(acks_subject("r1"), e)),
    "router_status": (decode_router_status,
                      RouterStatus(router_id="r1", models=["m"], started_at=NOW, heartbeat_at=NOW)
                      .model_dump(mode="json"),
                      lambda e: check_router_status_key(router_status_key("r1"), e)),
    "membership": (decode_membership_event,
                   MembershipEvent(op=MembershipOp.JOIN, worker=_RECORD, at=NOW).model_dump(mode="json"),
                   lambda e: check_membership_subject(membership_subject("m", 7), e)),
    "kv_event": (decode_kv_event,
                 KvEvent(instance_id=7, event_id=1, data=KvStored(blocks=[StoredBlock(block_hash=1, tokens_hash=2)]))
                 .model_dump(mode="json"),
                 lambda e: check_kv_subject(kv_subject("m", 7), "m", e)),
    "kv_dump": (decode_kv_dump, KvDumpReply(instance_id=7, last_event_id=0, ranks=[]).model_dump(mode="json"),
                lambda e: None),
    "checkpoint": (decode_checkpoint,
                   AuditCheckpoint(at=NOW, writer="cp", audit=ChainSegment(last_id=0, last_hash="0" * 64),
                                   acks=ChainSegment(last_id=0, last_hash="0" * 64)).model_dump(mode="json"),
                   lambda e: None),
}


def _decodes_or_refuses(name: str, data: Any) -> None:
    decode, _, check_subject = DECODERS[name]
    try:
        event = decode(data)
        check_subject(event)
    except InvalidRequest:
        return


@st.composite
def mutated(draw: st.DrawFn, sample: dict[str, Any]) -> dict[str, Any]:
    """A valid message with one to three fields replaced by random JSON, removed or added."""
    out = json.loads(json.dumps(sample))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        if action == "add" or not out:
            out[draw(st.text(max_size=10))] = draw(json_values)
        else:
            key = draw(st.sampled_from(sorted(out)))
            if action == "remove":
                del out[key]
            else:
                out[key] = draw(json_values)
    return out


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_the_valid_sample_decodes(name: str) -> None:
    decode, sample, check_subject = DECODERS[name]
    check_subject(decode(sample))


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ_DECODER
@given(data=st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_invalid_request(name: str, data: bytes) -> None:
    _decodes_or_refuses(name, data)


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ_DECODER
@given(value=json_values)
def test_random_json_never_raises_anything_but_invalid_request(name: str, value: Any) -> None:
    _decodes_or_refuses(name, json.dumps(value).encode())


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ_DECODER
@given(data=st.data())
def test_mutated_messages_never_raise_anything_but_invalid_request(name: str, data: st.DataObject) -> None:
    sample = DECODERS[name][1]
    _decodes_or_refuses(name, json.dumps(data.draw(mutated(sample))).encode())


@FUZZ
@given(subject=st.text(max_size=60), key=st.text(max_size=40))
def test_subject_and_key_parsing(subject: str, key: str) -> None:
    for fn, arg in ((parse_policy_subject, subject), (decode_model_key, key)):
        try:
            fn(arg)  # type: ignore[operator]
        except InvalidRequest:
            pass


# -- router targets (nvext and headers) ---------------------------------------------------------

header_names = st.sampled_from([HDR_WORKER, HDR_PREFILL, HDR_DP_RANK, HDR_PREFILL_DP_RANK, HDR_TTFT_SLO,
                                "x-other"])
nvext_keys = st.sampled_from(["backend_instance_id", "decode_worker_id", "prefill_worker_id", "dp_rank",
                              "prefill_dp_rank", "ttft_slo_ms", "other"])


@FUZZ
@given(nvext=st.one_of(json_values, st.dictionaries(nvext_keys, json_values, max_size=5)),
       headers=st.dictionaries(header_names, st.text(max_size=24), max_size=4))
def test_nvext_and_headers_never_raise_anything_but_invalid_request(nvext: Any, headers: dict[str, str]) -> None:
    from controlplane.protocol.events import RouterRole

    for parse in (lambda: parse_targets(nvext, headers), lambda: parse_ttft_slo(nvext, headers),
                  *(lambda role=role: parse_pin(nvext, headers, role=role) for role in RouterRole)):
        try:
            parse()
        except InvalidRequest:
            pass


# -- policy patches -----------------------------------------------------------------------------


@FUZZ
@given(kind=st.one_of(st.sampled_from([k.value for k in PolicyKind]), json_values),
       parameters=st.one_of(json_values, st.dictionaries(st.text(max_size=30), json_values, max_size=5)),
       unset=json_values)
def test_policy_patch_parsing_never_raises_anything_but_invalid_request(kind: Any, parameters: Any,
                                                                        unset: Any) -> None:
    try:
        k = parse_kind(kind)
    except InvalidRequest:
        return
    try:
        changes = validate_changes(k, parameters)
    except InvalidRequest:
        changes = None
    if changes is not None:
        # What validates applies to a valid document and gives a valid document.
        validate_document(k, apply_patch({}, changes))
    for fn in (lambda: validate_document(k, parameters), lambda: validate_unset(k, unset)):
        try:
            fn()
        except InvalidRequest:
            pass


# -- the scheduler: an invalid policy message changes nothing ------------------------------------


@FUZZ
@given(payload=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                         mutated(_policy_sample()).map(lambda d: json.dumps(d).encode())),
       signed=st.booleans())
def test_junk_policy_is_nacked_and_changes_nothing(payload: bytes, signed: bool) -> None:
    headers = session_keys().headers_for("m", PolicyKind.SELECTION, payload) if signed else {}

    def state(x: Scheduler) -> tuple[object, ...]:
        """What a policy message may change: applied revisions and effective values, the
        selection parameters (a NACK's own record, ``last_nack``, aside)."""
        return ({k: (v.revision, v.effective) for k, v in x.policy.applied().items()}, x.params("m"))

    async def run() -> None:
        s = _sched(Clock())
        s.start()
        try:
            before = await s.inspect(state)
            try:
                applied = await s.call(ApplyPolicy("m", PolicyKind.SELECTION, 5, payload, headers))
            except InvalidRequest:
                return
            after = await s.inspect(state)
            if applied.result.outcome is Outcome.ACK:
                return  # (a mutation that is still a valid, signed event)
            assert applied.result.outcome is Outcome.NACK, applied.result
            assert after == before
        finally:
            await s.stop()

    asyncio.run(run())
