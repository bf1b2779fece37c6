"""The policy event log on JetStream: the one adapter between the write path and NATS.

The bus adapter (:class:`bus.client.Bus`) does the JetStream work and its error translation:
a stale CAS → RevisionConflict, a bus that did not answer → LogUnavailable, a publish whose
answer was lost and could not be resolved by reading the subject's last message back →
LogAmbiguous.

Every event is signed on the way out (DESIGN §9) and verified on the way back in: a stored
message whose signature does not verify against the keyring reads as an event that is not valid
(``event`` is None, ``signature_error`` names the reason), so nothing the control plane does is
ever based on a document it did not sign.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from bus.client import Bus, Message
from controlplane.protocol.errors import InvalidRequest, RevisionConflict, SignatureInvalid
from controlplane.protocol.events import PolicyEvent, check_policy_subject, decode_policy_event
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.signing import Keyring, SigningKey
from controlplane.protocol.subjects import (
    HDR_KEY_ID,
    HDR_SIGNATURE,
    POLICY_PREFIX,
    STREAM_POLICY,
    parse_policy_subject,
    policy_subject,
)
from controlplane.telemetry import traces

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class StoredEvent:
    revision: int
    subject: str
    msg_id: str | None
    event: PolicyEvent | None  # None when the payload is not a valid, verified PolicyEvent
    error: str | None = None
    signed_by: str | None = None  # key id of a verified signature
    signature_error: str | None = None  # reason code when the signature does not verify


#: What a head's verification and decoding depend on besides its subject and the keys.
_HeadKey = tuple[int, bytes, str | None, str | None, str | None]


def _head_key(seq: int, data: bytes, headers: Mapping[str, str], msg_id: str | None) -> _HeadKey:
    return seq, data, headers.get(HDR_KEY_ID), headers.get(HDR_SIGNATURE), msg_id


def _decoded(revision: int, subject: str, data: bytes, msg_id: str | None, signed_by: str) -> StoredEvent:
    """A verified message's event, or why it is malformed."""
    try:
        event: PolicyEvent | None = decode_policy_event(data)
        assert event is not None
        # An event naming another document than its subject is malformed here too.
        check_policy_subject(subject, event)
        error = None
    except Exception as exc:  # a malformed message on the stream must not break reads
        event, error = None, str(exc)
    return StoredEvent(revision=revision, subject=subject, msg_id=msg_id, event=event, error=error,
                       signed_by=signed_by)


@dataclass(frozen=True, slots=True)
class PublishResult:
    revision: int
    recovered: bool  # the ack was lost; the event was found on the stream by its msg id


class PolicyLog:
    """Policy documents on the ``RUDDER_POLICY`` stream: head, CAS publish, history."""

    def __init__(self, bus: Bus, *, signer: SigningKey, keyring: Keyring) -> None:
        self.bus = bus
        self.use_keys(signer, keyring)

    def use_keys(self, signer: SigningKey, keyring: Keyring) -> None:
        """Sign with ``signer`` from now on; accept events signed by ``keyring`` or by it."""
        self.signer = signer
        self.keyring = keyring.union(Keyring.of([signer.public_key]))
        # Per subject, the head last read or published here, verified and decoded. Every write
        # reads its head, which is most often the event the previous write published: the same
        # message (sequence, bytes, signature, id) under the same keys needs no second check.
        self._heads: dict[str, tuple[_HeadKey, StoredEvent]] = {}
        # Per subject, the newest revision this process has seen exist (published, read, or named
        # by a conflict): a head read older than it came from a replica behind the stream, and is
        # read again from the leader (docs/decisions.md 89).
        self._seen: dict[str, int] = {}

    def _stored(self, msg: Message) -> StoredEvent:
        revision = msg.seq or 0
        try:
            signed_by = self.keyring.verify(msg.subject, msg.data, msg.headers)
        except SignatureInvalid as exc:
            return StoredEvent(revision=revision, subject=msg.subject, msg_id=msg.msg_id,
                               event=None, error=f"{exc.reason_code}: {exc.message}",
                               signature_error=exc.reason_code)
        return _decoded(revision, msg.subject, msg.data, msg.msg_id, signed_by)

    async def head(self, model: str, kind: PolicyKind, *, at_least: int = 0) -> StoredEvent | None:
        """The newest event of a document, or None (revision 0) if it has none. A head older
        than ``at_least`` (the revision a write expects) or than a revision this process has seen
        is read again from the stream's leader: a write must not be refused as a conflict on a
        replica's stale view (a compare-and-set never succeeds on one: the publish checks)."""
        subject = policy_subject(model, kind)
        msg = await self.bus.last(STREAM_POLICY, subject, at_least=max(at_least, self._seen.get(subject, 0)))
        if msg is None:
            return None
        self._saw(subject, msg.seq or 0)
        key = _head_key(msg.seq or 0, msg.data, msg.headers, msg.msg_id)
        cached = self._heads.get(msg.subject)
        if cached is not None and cached[0] == key:
            return cached[1]
        stored = self._stored(msg)
        self._heads[msg.subject] = (key, stored)
        return stored

    async def publish(self, event: PolicyEvent) -> PublishResult:
        """Publish signed, with compare-and-set. Raises RevisionConflict, LogUnavailable,
        LogAmbiguous (:meth:`bus.client.Bus.publish_cas`)."""
        subject = policy_subject(event.model, event.kind)
        payload, msg_id = event.to_bytes(), str(event.event_id)
        signature = self.signer.sign(subject, payload)
        try:
            result = await self.bus.publish_cas(
                STREAM_POLICY, subject, payload, expected_seq=event.expected_revision,
                msg_id=msg_id, headers=_traced(signature))
        except RevisionConflict as exc:
            self._saw(subject, exc.head_revision)  # the leader's head: the retry reads no older one
            raise
        self._saw(subject, result.seq)
        # The new head is this message, signed here: the next write's head read needs no check.
        self._heads[subject] = (_head_key(result.seq, payload, signature, msg_id),
                                _decoded(result.seq, subject, payload, msg_id, self.signer.key_id))
        return PublishResult(revision=result.seq, recovered=result.recovered)

    def _saw(self, subject: str, revision: int) -> None:
        if revision > self._seen.get(subject, 0):
            self._seen[subject] = revision

    async def find(self, model: str, kind: PolicyKind, event_id: uuid.UUID) -> StoredEvent | None:
        """Look an event up by its id among the retained history of its document."""
        async for stored in self.history(model, kind):
            if stored.msg_id == str(event_id):
                return stored
        return None

    async def get(self, model: str, kind: PolicyKind, revision: int) -> StoredEvent | None:
        msg = await self.bus.get(STREAM_POLICY, revision)
        if msg is None or msg.subject != policy_subject(model, kind):
            return None
        return self._stored(msg)

    async def history(self, model: str, kind: PolicyKind) -> AsyncIterator[StoredEvent]:
        """Retained events of one document, oldest first."""
        async for msg in self.bus.messages(STREAM_POLICY, policy_subject(model, kind)):
            yield self._stored(msg)

    async def all_events(self) -> AsyncIterator[StoredEvent]:
        async for msg in self.bus.messages(STREAM_POLICY, f"{POLICY_PREFIX}.>"):
            yield self._stored(msg)

    async def documents(self) -> list[tuple[str, PolicyKind, int]]:
        """(model, kind, number of retained events) of every document on the stream."""
        state = await self.bus.stream_state(STREAM_POLICY, subjects=f"{POLICY_PREFIX}.>")
        out: list[tuple[str, PolicyKind, int]] = []
        for subject, count in sorted(state.subjects.items()):
            try:
                model, kind = parse_policy_subject(subject)
                out.append((model, PolicyKind(kind), count))
            except (ValueError, InvalidRequest):
                log.warning("ignoring foreign subject %s on %s", subject, STREAM_POLICY)
        return out


def _traced(headers: dict[str, str]) -> dict[str, str]:
    """A policy message's headers, with the current span's ``traceparent`` when tracing is on
    (a header beside the signature, outside the signed payload: controlplane.telemetry.traces)."""
    if traces.enabled():
        traces.inject(headers)
    return headers
