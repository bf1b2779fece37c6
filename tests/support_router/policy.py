"""Publishing policy events straight onto RUDDER_POLICY with CAS, as the control plane does."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from nats.js import JetStreamContext

from controlplane.protocol.events import PolicyEvent
from controlplane.protocol.policy import PolicyKind, PolicyOp
from controlplane.protocol.subjects import (
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_MSG_ID,
    policy_subject,
)


async def publish_policy(
    js: JetStreamContext, model: str, document: dict[str, Any], *, expected_revision: int,
    kind: PolicyKind = PolicyKind.SELECTION,
) -> int:
    """Publish a whole-document event with compare-and-set; returns its revision."""
    event = PolicyEvent(
        event_id=uuid.uuid4(), model=model, kind=kind, op=PolicyOp.PATCH,
        expected_revision=expected_revision, changes=dict(document), document=dict(document),
        actor="test", request_id=uuid.uuid4().hex, at=datetime.now(UTC),
    )
    ack = await js.publish(
        policy_subject(model, kind.value), event.to_bytes(),
        headers={HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected_revision), HDR_MSG_ID: str(event.event_id)},
    )
    return int(ack.seq)


async def publish_raw(js: JetStreamContext, model: str, payload: bytes, *, expected_revision: int,
                      kind: str = "selection") -> int:
    ack = await js.publish(
        policy_subject(model, kind), payload,
        headers={HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected_revision), HDR_MSG_ID: uuid.uuid4().hex},
    )
    return int(ack.seq)
