"""The policy event log on a real JetStream: CAS publish, the lost-ack retry, head by direct get,
history, and stream settings (DESIGN §2)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from bus.identities import Identity, IdentityKind
from controlplane.eventlog import PolicyLog
from controlplane.protocol.errors import RevisionConflict
from controlplane.protocol.events import PolicyEvent
from controlplane.protocol.policy import PolicyKind, PolicyOp
from controlplane.protocol.subjects import STREAM_POLICY
from tests import buskit
from tests.policy_keys import session_keys

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def log(nats_url: str) -> AsyncIterator[PolicyLog]:
    nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
    policy_log = session_keys().policy_log(nc)
    yield policy_log
    await nc.close()


def event(model: str, expected: int, temperature: float, event_id: uuid.UUID | None = None) -> PolicyEvent:
    return PolicyEvent(event_id=event_id or uuid.uuid4(), model=model, kind=PolicyKind.SELECTION,
                       op=PolicyOp.PATCH, expected_revision=expected,
                       changes={"router_temperature": temperature},
                       document={"router_temperature": temperature}, actor="t", request_id="r",
                       at=datetime.now(UTC))


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B-Instruct", "qwen2.5:7b", "a model * > ü"])
async def test_cas_publish_head_and_history(log: PolicyLog, model: str) -> None:
    assert await log.head(model, PolicyKind.SELECTION) is None  # revision 0
    first = await log.publish(event(model, 0, 0.1))
    second = await log.publish(event(model, first.revision, 0.2))
    assert second.revision > first.revision and not second.recovered
    head = await log.head(model, PolicyKind.SELECTION)
    assert head is not None and head.revision == second.revision and head.event is not None
    assert head.event.document == {"router_temperature": 0.2}
    assert [s.revision async for s in log.history(model, PolicyKind.SELECTION)] == [first.revision,
                                                                                    second.revision]
    assert (await log.get(model, PolicyKind.SELECTION, first.revision)) is not None
    assert (await log.get(model, PolicyKind.BUSY_THRESHOLD, first.revision)) is None  # other subject


async def test_stale_expectation_is_a_conflict_with_the_head(log: PolicyLog) -> None:
    model = f"m-{uuid.uuid4().hex[:6]}"
    first = await log.publish(event(model, 0, 0.1))
    with pytest.raises(RevisionConflict) as exc:
        await log.publish(event(model, 0, 0.3))
    assert (exc.value.expected_revision, exc.value.head_revision) == (0, first.revision)
    assert exc.value.status_code == 409


async def test_retry_after_a_lost_ack_is_recognised_as_our_own_write(log: PolicyLog) -> None:
    """CAS is checked before de-duplication: re-sending an event whose first publish succeeded
    (its ack lost) gets 10071; the log reads the head back, finds our Nats-Msg-Id, and reports the
    original revision instead of a conflict. Nothing is stored twice."""
    model = f"m-{uuid.uuid4().hex[:6]}"
    mine = event(model, 0, 0.5)
    original = await log.publish(mine)
    retried = await log.publish(mine)  # the same event, the same expectation
    assert retried.recovered and retried.revision == original.revision
    assert [s.revision async for s in log.history(model, PolicyKind.SELECTION)] == [original.revision]


async def test_policy_stream_settings(log: PolicyLog) -> None:
    info = await log.bus.nc.jetstream().stream_info(STREAM_POLICY)
    cfg = info.config
    assert cfg.max_msgs_per_subject == 64 and cfg.allow_direct and cfg.deny_delete and cfg.deny_purge
    assert cfg.duplicate_window == 120
    assert cfg.num_replicas == 1


async def test_the_head_after_a_publish_is_what_a_fresh_reader_verifies(log: PolicyLog, nats_url: str) -> None:
    """The publisher remembers its own event as the head (no second signature check on its next
    write's read): what it returns is exactly what a reader with nothing remembered verifies from
    the stream, and the same bytes stored again (a replay, at a new revision) are read afresh."""
    model = f"m-{uuid.uuid4().hex[:6]}"
    published = await log.publish(event(model, 0, 0.4))
    nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
    try:
        fresh = session_keys().policy_log(nc)
        remembered = await log.head(model, PolicyKind.SELECTION)
        verified = await fresh.head(model, PolicyKind.SELECTION)
        assert remembered is not None and remembered == verified
        assert remembered.revision == published.revision and remembered.signed_by is not None
        # A replay of the same message (bytes and signature; a new msg id, or JetStream would drop
        # it as a duplicate) becomes the head at a new revision: not the remembered one.
        stored = await log.bus.last(STREAM_POLICY, remembered.subject)
        assert stored is not None
        headers = {k: v for k, v in stored.headers.items() if not k.startswith("Nats-")}
        await nc.jetstream().publish(remembered.subject, stored.data, headers={**headers, "Nats-Msg-Id": "replay"})
        replayed = await log.head(model, PolicyKind.SELECTION)
        assert replayed is not None and replayed.revision > published.revision
        assert replayed == await fresh.head(model, PolicyKind.SELECTION)
    finally:
        await nc.close()
