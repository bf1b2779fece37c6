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
from tests.policy_keys import PolicyKeys, session_keys


async def publish_policy(
    js: JetStreamContext, model: str, document: dict[str, Any], *, expected_revision: int,
    kind: PolicyKind = PolicyKind.SELECTION, keys: PolicyKeys | None = None,
) -> int:
    """Publish a whole-document event with compare-and-set, signed as the control plane signs
    (by the session's key unless ``keys`` names another); returns its revision."""
    event = PolicyEvent(
        event_id=uuid.uuid4(), model=model, kind=kind, op=PolicyOp.PATCH,
        expected_revision=expected_revision, changes=dict(document), document=dict(document),
        actor="test", request_id=uuid.uuid4().hex, at=datetime.now(UTC),
    )
    subject, payload = policy_subject(model, kind.value), event.to_bytes()
    ack = await js.publish(
        subject, payload,
        headers={HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected_revision), HDR_MSG_ID: str(event.event_id),
                 **(keys or session_keys()).sign(subject, payload)},
    )
    return int(ack.seq)


async def publish_raw(js: JetStreamContext, model: str, payload: bytes, *, expected_revision: int,
                      kind: str = "selection", signed: bool = True) -> int:
    """Publish any bytes; signed by the session's key unless ``signed`` is False."""
    subject = policy_subject(model, kind)
    headers = {HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected_revision), HDR_MSG_ID: uuid.uuid4().hex}
    if signed:
        headers.update(session_keys().sign(subject, payload))
    ack = await js.publish(subject, payload, headers=headers)
    return int(ack.seq)
