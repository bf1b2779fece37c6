"""The policy event log on JetStream: the one adapter between the write path and NATS.

Every nats exception is translated here, once: stale CAS (JetStream 10071) → RevisionConflict,
anything that means "the server did not answer" → LogUnavailable. A publish whose answer was lost
is resolved by reading the subject's last message back and comparing its ``Nats-Msg-Id``.

Every event is signed on the way out (DESIGN §9) and verified on the way back in: a stored
message whose signature does not verify against the keyring reads as an event that is not valid
(``event`` is None, ``signature_error`` names the reason), so nothing the control plane does is
ever based on a document it did not sign.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, NoRespondersError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import (
    APIError,
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)

from controlplane.protocol.errors import InvalidRequest, LogUnavailable, RevisionConflict, SignatureInvalid
from controlplane.protocol.events import PolicyEvent, check_policy_subject, decode_policy_event
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.signing import Keyring, SigningKey
from controlplane.protocol.subjects import (
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_MSG_ID,
    JS_ERR_WRONG_LAST_SEQUENCE,
    POLICY_PREFIX,
    STREAM_POLICY,
    parse_policy_subject,
    policy_subject,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors that mean the bus did not give an answer: the effect of a publish is unknown.
_UNAVAILABLE = (
    NatsTimeoutError, asyncio.TimeoutError, NoRespondersError, ServiceUnavailableError,
    ConnectionClosedError, OutboundBufferLimitError, OSError,
    nats.errors.StaleConnectionError, nats.errors.ConnectionReconnectingError,
    NoStreamResponseError,  # no stream leader (a cluster electing one after a node died)
)
# JetStream API answers that mean "try again later": 503 (no leader / cluster unavailable) and
# err_code 10008 (JetStream temporarily unavailable).
_UNAVAILABLE_API_CODES = frozenset({10008})


def _api_unavailable(exc: APIError) -> bool:
    return exc.code == 503 or exc.err_code in _UNAVAILABLE_API_CODES


@dataclass(frozen=True, slots=True)
class StoredEvent:
    revision: int
    subject: str
    msg_id: str | None
    event: PolicyEvent | None  # None when the payload is not a valid, verified PolicyEvent
    error: str | None = None
    signed_by: str | None = None  # key id of a verified signature
    signature_error: str | None = None  # reason code when the signature does not verify


@dataclass(frozen=True, slots=True)
class PublishResult:
    revision: int
    recovered: bool  # the ack was lost; the event was found on the stream by its msg id


class Ambiguous(LogUnavailable):
    """The publish may or may not have been stored; a reconciler must decide later."""

    code = "log_ambiguous"


class PolicyLog:
    """Policy documents on the ``RUDDER_POLICY`` stream: head, CAS publish, history."""

    def __init__(self, nc: NATS, *, signer: SigningKey, keyring: Keyring, timeout_s: float = 2.0) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=timeout_s)
        self.timeout_s = timeout_s
        self.use_keys(signer, keyring)

    def use_keys(self, signer: SigningKey, keyring: Keyring) -> None:
        """Sign with ``signer`` from now on; accept events signed by ``keyring`` or by it."""
        self.signer = signer
        self.keyring = keyring.union(Keyring.of([signer.public_key]))

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.nc.is_connected:
            raise LogUnavailable(f"NATS is not connected ({what})", retry_after=2)
        try:
            return await asyncio.wait_for(fn(), self.timeout_s + 0.5)
        except _UNAVAILABLE as exc:
            raise LogUnavailable(f"NATS did not answer ({what}): {type(exc).__name__}", retry_after=2) from exc
        except APIError as exc:
            if _api_unavailable(exc):
                raise LogUnavailable(f"JetStream unavailable ({what}): {exc.description}", retry_after=5) from exc
            raise

    def _stored(self, msg: Any) -> StoredEvent:
        headers = msg.headers or {}
        data = msg.data or b""
        try:
            signed_by = self.keyring.verify(msg.subject, data, headers)
        except SignatureInvalid as exc:
            return StoredEvent(revision=int(msg.seq), subject=msg.subject, msg_id=headers.get(HDR_MSG_ID),
                               event=None, error=f"{exc.reason_code}: {exc.message}",
                               signature_error=exc.reason_code)
        try:
            event: PolicyEvent | None = decode_policy_event(data)
            assert event is not None
            # An event naming another document than its subject is malformed here too.
            check_policy_subject(msg.subject, event)
            error = None
        except Exception as exc:  # a malformed message on the stream must not break reads
            event, error = None, str(exc)
        return StoredEvent(revision=int(msg.seq), subject=msg.subject,
                           msg_id=headers.get(HDR_MSG_ID), event=event, error=error, signed_by=signed_by)

    async def head(self, model: str, kind: PolicyKind) -> StoredEvent | None:
        """The newest event of a document, or None (revision 0) if it has none."""
        subject = policy_subject(model, kind)

        async def go() -> StoredEvent | None:
            try:
                msg = await self.js.get_last_msg(STREAM_POLICY, subject, direct=True)
            except NotFoundError:
                return None
            return self._stored(msg)

        return await self._call("head", go)

    async def publish(self, event: PolicyEvent) -> PublishResult:
        """Publish with compare-and-set. Raises RevisionConflict, LogUnavailable, Ambiguous."""
        subject = policy_subject(event.model, event.kind)
        msg_id = str(event.event_id)
        payload = event.to_bytes()
        headers = {
            HDR_EXPECTED_LAST_SUBJECT_SEQ: str(event.expected_revision),
            HDR_MSG_ID: msg_id,
            **self.signer.sign(subject, payload),
        }
        if not self.nc.is_connected:
            raise LogUnavailable("NATS is not connected; nothing was published", retry_after=2)
        try:
            ack = await self.js.publish(subject, payload, timeout=self.timeout_s, headers=headers)
            return PublishResult(revision=int(ack.seq), recovered=False)
        except APIError as exc:
            if _api_unavailable(exc):
                raise Ambiguous(f"JetStream unavailable at publish: {exc.description}", retry_after=5) from exc
            if not isinstance(exc, BadRequestError) or exc.err_code != JS_ERR_WRONG_LAST_SEQUENCE:
                raise
            # CAS is checked before de-duplication: our own earlier attempt may be the head.
            head = await self.head(event.model, event.kind)
            if head is not None and head.msg_id == msg_id:
                return PublishResult(revision=head.revision, recovered=True)
            head_rev = head.revision if head is not None else 0
            raise RevisionConflict(
                f"expected revision {event.expected_revision} but the head is {head_rev}",
                expected_revision=event.expected_revision, head_revision=head_rev,
            ) from exc
        except _UNAVAILABLE as exc:
            # Unknown outcome: read back once; if that fails too, leave it to the reconciler.
            try:
                head = await self.head(event.model, event.kind)
            except LogUnavailable:
                raise Ambiguous(f"publish outcome unknown: {type(exc).__name__}", retry_after=2) from exc
            if head is not None and head.msg_id == msg_id:
                return PublishResult(revision=head.revision, recovered=True)
            raise Ambiguous(f"publish outcome unknown: {type(exc).__name__}", retry_after=2) from exc

    async def find(self, model: str, kind: PolicyKind, event_id: uuid.UUID) -> StoredEvent | None:
        """Look an event up by its id among the retained history of its document."""
        async for stored in self.history(model, kind):
            if stored.msg_id == str(event_id):
                return stored
        return None

    async def get(self, model: str, kind: PolicyKind, revision: int) -> StoredEvent | None:
        async def go() -> StoredEvent | None:
            try:
                msg = await self.js.get_msg(STREAM_POLICY, seq=revision, direct=True)
            except NotFoundError:
                return None
            return self._stored(msg)

        stored = await self._call("get", go)
        if stored is None or stored.subject != policy_subject(model, kind):
            return None
        return stored

    async def history(self, model: str, kind: PolicyKind) -> AsyncIterator[StoredEvent]:
        """Retained events of one document, oldest first."""
        subject = policy_subject(model, kind)
        async for stored in self._iterate(subject):
            yield stored

    async def _iterate(self, subject: str) -> AsyncIterator[StoredEvent]:
        seq = 1
        while True:
            async def go(s: int = seq) -> Any:
                try:
                    return await self.js.get_msg(STREAM_POLICY, seq=s, subject=subject, next=True, direct=True)
                except NotFoundError:
                    return None

            msg = await self._call("history", go)
            if msg is None:
                return
            stored = self._stored(msg)
            yield stored
            seq = stored.revision + 1

    async def all_events(self) -> AsyncIterator[StoredEvent]:
        async for stored in self._iterate(f"{POLICY_PREFIX}.>"):
            yield stored

    async def documents(self) -> list[tuple[str, PolicyKind, int]]:
        """(model, kind, number of retained events) of every document on the stream."""
        async def go() -> dict[str, int]:
            info = await self.js.stream_info(STREAM_POLICY, subjects_filter=f"{POLICY_PREFIX}.>")
            return dict(info.state.subjects or {})

        out: list[tuple[str, PolicyKind, int]] = []
        for subject, count in sorted((await self._call("documents", go)).items()):
            try:
                model, kind = parse_policy_subject(subject)
                out.append((model, PolicyKind(kind), count))
            except (ValueError, InvalidRequest):
                log.warning("ignoring foreign subject %s on %s", subject, STREAM_POLICY)
        return out
