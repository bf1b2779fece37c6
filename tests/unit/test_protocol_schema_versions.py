"""Bus payloads across a rolling upgrade: a later schema reads the earlier one, and what a writer
sends without the later fields is the earlier schema exactly, so a reader not yet upgraded (its
models forbid unknown keys) reads it. Found writing KV schema 2: membership schema 1 events were
written with ``"timing": null``, which a schema 1 router refused."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from controlplane.protocol.events import (
    EngineTiming,
    KvCleared,
    KvDumpRank,
    KvDumpReply,
    KvEvent,
    MembershipEvent,
    MembershipOp,
    WorkerRecord,
    decode_kv_dump,
    decode_kv_event,
    decode_membership_event,
)

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def _earlier(model: type[BaseModel], drop: str, **replace: Any) -> type[BaseModel]:
    """``model`` as its schema 1 reader knew it: without ``drop``, schema_version 1 only, unknown
    keys refused."""
    fields: dict[str, Any] = {name: (info.annotation, info) for name, info in model.model_fields.items()
                              if name != drop}
    fields["schema_version"] = (Literal[1], 1)
    fields.update(replace)
    built: type[BaseModel] = create_model(f"{model.__name__}V1", __config__=ConfigDict(extra="forbid"), **fields)
    return built


KvEventV1 = _earlier(KvEvent, "started_at")
KvDumpReplyV1 = _earlier(KvDumpReply, "started_at")
_record_fields: dict[str, Any] = {n: (i.annotation, i) for n, i in WorkerRecord.model_fields.items() if n != "timing"}
WorkerRecordV1 = create_model("WorkerRecordV1", __config__=ConfigDict(extra="forbid"), **_record_fields)
MembershipEventV1 = _earlier(MembershipEvent, "", worker=(WorkerRecordV1, ...))


def _record(**update: Any) -> WorkerRecord:
    return WorkerRecord(instance_id=7, model="m", url="http://w", block_size=4, kv_total_blocks=10,
                        max_num_batched_tokens=8, started_at=NOW, **update)


def test_kv_events_and_dumps_without_a_stamp_are_schema_1_and_an_old_router_reads_them() -> None:
    event = KvEvent(instance_id=7, event_id=3, data=KvCleared())
    dump = KvDumpReply(instance_id=7, last_event_id=3, ranks=[KvDumpRank(blocks=[(None, 1, 1)])])
    for payload, earlier in ((event.to_bytes(), KvEventV1), (dump.to_bytes(), KvDumpReplyV1)):
        assert b"started_at" not in payload
        assert earlier.model_validate_json(payload).schema_version == 1  # type: ignore[attr-defined]
    assert decode_kv_event(event.to_bytes()) == event
    assert decode_kv_dump(dump.to_bytes()) == dump


def test_a_stamped_kv_event_or_dump_is_schema_2_which_an_old_router_refuses_and_a_new_one_reads() -> None:
    event = KvEvent(instance_id=7, event_id=3, data=KvCleared(), started_at=NOW)
    dump = KvDumpReply(instance_id=7, last_event_id=3, ranks=[], started_at=NOW)
    for payload, earlier in ((event.to_bytes(), KvEventV1), (dump.to_bytes(), KvDumpReplyV1)):
        with pytest.raises(ValidationError):  # hence: routers before workers
            earlier.model_validate_json(payload)
    again = decode_kv_event(event.to_bytes())
    assert (again.schema_version, again.started_at) == (2, NOW)
    assert decode_kv_dump(dump.to_bytes()).started_at == NOW


def test_membership_without_timing_is_schema_1_as_an_old_router_reads_it() -> None:
    plain = MembershipEvent(op=MembershipOp.JOIN, worker=_record(), at=NOW)
    payload = plain.to_bytes()
    assert b"timing" not in payload
    assert MembershipEventV1.model_validate_json(payload).schema_version == 1  # type: ignore[attr-defined]
    assert decode_membership_event(payload) == plain
    timed = MembershipEvent(op=MembershipOp.JOIN, at=NOW, worker=_record(
        timing=EngineTiming(prefill_ms=(1.0, 0.01, 0.0), decode_ms=(5.0, 1.0, 0.0))))
    with pytest.raises(ValidationError):
        MembershipEventV1.model_validate_json(timed.to_bytes())
    assert decode_membership_event(timed.to_bytes()) == timed
