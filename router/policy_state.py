"""Applying policy events to this router's effective parameters (DESIGN §2, §3, §5). Pure.

For each served (model, kind) document the router keeps its startup values, the revision it
applied last, the override document of that revision, and the last NACK. :meth:`PolicyState.apply`
is idempotent (a revision ≤ the last one seen is skipped) and never leaves a document half
applied: an event that does not decode, names another document, fails validation, or turns on a
weight whose cache input this router lacks is refused (NACK) and the last good values stay.

Every event must carry a valid signature (DESIGN §9) by a key of the router's keyring, over the
exact subject and payload bytes: an unsigned event, one signed by an unknown key id, or one whose
signature does not verify is refused first, before its payload is even decoded, and the NACK
detail starts with the reason code (``signature_missing``, ``signature_unknown_key``,
``signature_invalid``). The keyring is replaced as a whole when the verify-keys file changes.

Every event is bound to its place in its document's chain (issue 17): its signed
``expected_revision`` is the revision the control plane wrote it on (the publish is
compare-and-set on it), so it must be the sequence of the message before it on its subject. An
event that names an older place than the one this router saw last, or whose subject has another
message in between (``previous``: what the consumer read from the stream), is a replay of an old
signed event (its bytes and headers published again) and is refused (NACK, detail starting with
``replayed``); the last good values stay.

A gap is reported when an event's ``expected_revision`` is newer than the revision seen last for
its document (messages this router never received; after the first one: a router starts from the
last message per subject on purpose); the consumer then re-reads the document's head.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from controlplane.protocol.errors import InvalidRequest, SignatureInvalid
from controlplane.protocol.events import (
    AppliedDocument,
    decode_policy_event,
    decode_policy_restored,
    decode_signed_restore,
    doc_key,
)
from controlplane.protocol.policy import (
    SELECTION_PARAMETERS,
    CacheInput,
    Document,
    Number,
    PolicyKind,
    effective_values,
    missing_cache_inputs,
    validate_document,
)
from controlplane.protocol.signing import Keyring
from controlplane.protocol.subjects import HDR_KEY_ID, HDR_SIGNATURE, policy_subject, restore_subject


class Outcome(enum.Enum):
    ACK = "ACK"
    NACK = "NACK"
    SKIP = "SKIP"  # already seen (redelivery, or the re-read of a head we applied)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    outcome: Outcome
    model: str
    kind: PolicyKind
    revision: int
    detail: str = ""
    gap: bool = False
    event_id: uuid.UUID | None = None
    effective: dict[str, Number | None] = field(default_factory=dict)


@dataclass(slots=True)
class DocumentState:
    model: str
    kind: PolicyKind
    startup: dict[str, Number | None]
    revision: int = 0  # last applied (0 = no document / startup values)
    seen: int = 0  # last applied or refused
    document: Document = field(default_factory=dict)
    effective: dict[str, Number | None] = field(default_factory=dict)
    last_nack: str | None = None
    last_nack_revision: int | None = None

    def __post_init__(self) -> None:
        self.effective = dict(self.startup)


class PolicyState:
    def __init__(
        self, *, router_id: str, models: Iterable[str],
        startup: dict[PolicyKind, dict[str, Number | None]], cache_inputs: frozenset[CacheInput],
        keyring: Keyring,
    ) -> None:
        self.router_id = router_id
        self.cache_inputs = cache_inputs
        self.keyring = keyring
        self.docs: dict[tuple[str, PolicyKind], DocumentState] = {
            (m, k): DocumentState(m, k, dict(startup[k])) for m in models for k in PolicyKind
        }

    def get(self, model: str, kind: PolicyKind) -> DocumentState:
        return self.docs[(model, kind)]

    def use_keyring(self, keyring: Keyring) -> None:
        self.keyring = keyring

    def apply(
        self, model: str, kind: PolicyKind, revision: int, payload: bytes,
        headers: Mapping[str, str] | None, *, previous: int | None = None,
    ) -> ApplyResult:
        """Apply the event stored at ``revision`` on the (model, kind) subject, with the message
        ``headers`` that carry its signature. ``previous``, when the caller read it from the
        stream, is the sequence of the subject's message before ``revision`` (or of any message
        of the subject between the event's ``expected_revision`` and ``revision``)."""
        doc = self.docs.get((model, kind))
        if doc is None:
            return ApplyResult(Outcome.SKIP, model, kind, revision, "not a document this router serves")
        if revision <= doc.seen:
            return ApplyResult(Outcome.SKIP, model, kind, revision, f"revision {revision} already seen")
        try:
            self.keyring.verify(policy_subject(model, kind.value), payload, headers)
        except SignatureInvalid as exc:
            return self._nack(doc, revision, f"{exc.reason_code}: {exc.message}", None, False)
        try:
            event = decode_policy_event(payload)
        except InvalidRequest as exc:
            return self._nack(doc, revision, f"malformed policy event: {exc.message}", None, False)
        replayed = replay_reason(event.expected_revision, revision, seen=doc.seen, previous=previous)
        if replayed is not None:
            return self._nack(doc, revision, replayed, event.event_id, False)
        gap = doc.seen > 0 and event.expected_revision != doc.seen
        if event.model != model or event.kind is not kind:
            return self._nack(
                doc, revision,
                f"event is for {event.model}|{event.kind.value} but was stored on the subject "
                f"of {model}|{kind.value}",
                event.event_id, gap,
            )
        try:
            document = validate_document(kind, event.document)
        except InvalidRequest as exc:
            return self._nack(doc, revision, f"invalid document: {exc.message}", event.event_id, gap)
        missing = missing_cache_inputs(kind, document, self.cache_inputs)
        if missing:
            needs = ", ".join(
                f"{n} needs the {SELECTION_PARAMETERS[n].cache_input} cache input" for n in missing
            )
            have = ", ".join(sorted(self.cache_inputs)) or "none"
            return self._nack(
                doc, revision,
                f"capability mismatch: {needs}, which router {self.router_id} lacks "
                f"(its cache inputs: {have})",
                event.event_id, gap,
            )
        doc.document = document
        doc.revision = revision
        doc.seen = revision
        doc.effective = effective_values(doc.startup, document)
        return ApplyResult(
            Outcome.ACK, model, kind, revision, "gap: re-read head" if gap else "", gap,
            event.event_id, dict(doc.effective),
        )

    def restore(self, model: str, kind: PolicyKind, answer: bytes, *, nonce: str) -> ApplyResult:
        """Apply the control plane's answer to this router's restore request (``nonce``): the
        last document it wrote, for a document whose stream head is not a valid signed event and
        which has no applied revision (a start after junk evicted every good revision). The
        answer must be signed by a key of the keyring over ``rudder.restore.<router_id>``, name
        this router, the document and the nonce; its document is checked like an event's. The
        revision seen stays (the next event continues the stream's chain). SKIP when the document
        has a revision meanwhile or the control plane wrote none; NACK when the answer is refused
        (the startup values stay)."""
        doc = self.docs.get((model, kind))
        if doc is None or doc.revision:
            return ApplyResult(Outcome.SKIP, model, kind, 0, "nothing to restore")
        try:
            signed = decode_signed_restore(answer)
            payload = signed.payload.encode()
            self.keyring.verify(restore_subject(self.router_id), payload,
                                {HDR_KEY_ID: signed.key_id, HDR_SIGNATURE: signed.signature})
            restored = decode_policy_restored(payload)
        except SignatureInvalid as exc:
            return ApplyResult(Outcome.NACK, model, kind, 0, f"restore refused: {exc.reason_code}: {exc.message}")
        except InvalidRequest as exc:
            return ApplyResult(Outcome.NACK, model, kind, 0, f"restore refused: {exc.message}")
        if (restored.router_id, restored.model, restored.kind, restored.nonce) != (
                self.router_id, model, kind, nonce):
            return ApplyResult(Outcome.NACK, model, kind, 0,
                               "restore refused: the answer is for another question")
        if restored.revision == 0:
            return ApplyResult(Outcome.SKIP, model, kind, 0, "the control plane wrote no document")
        try:
            document = validate_document(kind, restored.document)
        except InvalidRequest as exc:
            return ApplyResult(Outcome.NACK, model, kind, restored.revision,
                               f"restore refused: invalid document: {exc.message}")
        if missing_cache_inputs(kind, document, self.cache_inputs):
            return ApplyResult(Outcome.NACK, model, kind, restored.revision,
                               "restore refused: capability mismatch")
        doc.document = document
        doc.revision = restored.revision
        doc.effective = effective_values(doc.startup, document)
        return ApplyResult(
            Outcome.ACK, model, kind, restored.revision,
            f"restored: revision {restored.revision}, the last the control plane wrote",
            False, restored.event_id, dict(doc.effective),
        )

    def _nack(
        self, doc: DocumentState, revision: int, detail: str, event_id: uuid.UUID | None, gap: bool
    ) -> ApplyResult:
        doc.seen = revision
        doc.last_nack = detail
        doc.last_nack_revision = revision
        return ApplyResult(
            Outcome.NACK, doc.model, doc.kind, revision, detail, gap, event_id, dict(doc.effective)
        )

    def applied(self) -> dict[str, AppliedDocument]:
        """Status per document, as the ``RUDDER_ROUTERS`` bucket shows it."""
        return {
            doc_key(d.model, d.kind): AppliedDocument(
                revision=d.revision, effective=dict(d.effective), last_nack=d.last_nack,
                last_nack_revision=d.last_nack_revision,
            )
            for d in self.docs.values()
        }

    def max_seen(self) -> int:
        """The highest stream sequence this router has applied or refused (0: none)."""
        return max((d.seen for d in self.docs.values()), default=0)

    def resync(self) -> dict[str, int]:
        """Forget applied revisions after the stream went backwards, so that the heads of the new
        stream are applied whatever their sequence. The effective values and the documents stay
        (the last good values) until a new head replaces them. Returns the forgotten revisions
        (``{"<model>|<kind>": revision}`` of the documents that had one)."""
        forgotten: dict[str, int] = {}
        for d in self.docs.values():
            if d.seen:
                forgotten[doc_key(d.model, d.kind)] = d.seen
            d.seen = 0
            d.revision = 0
        return forgotten


REPLAYED = "replayed"


def replay_reason(expected: int, revision: int, *, seen: int, previous: int | None) -> str | None:
    """Why an event stored at ``revision`` that was written on ``expected`` cannot be in its place
    in the chain (a replay), or None. ``seen`` is the revision this router saw last for the
    document (0: none yet), ``previous`` what the stream says precedes ``revision``. A replay
    always names a revision older than the one it is stored at (its original's), so an event
    naming a newer one is a gap (missed events), never a replay."""
    if seen > 0 and expected < seen:
        return (f"{REPLAYED}: event written on revision {expected} arrived after revision {seen} "
                "(a replay of an old event)")
    if previous is not None and previous != expected:
        return (f"{REPLAYED}: event written on revision {expected}, but revision {previous} "
                f"precedes revision {revision} on its subject (a replay of an old event)")
    return None


def stream_went_backwards(
    *, known_created: datetime | None, created: datetime | None, last_seq: int, max_seen: int,
) -> str | None:
    """Why the policy stream is not the one this router's revisions come from, or None.

    A stream created again (an operator deleted it, a disaster recovery) restarts its sequence:
    its creation time differs from the one seen at start, or its last sequence is below a revision
    already seen. Either way every revision the router knows is meaningless for the new stream."""
    if known_created is not None and created is not None and created != known_created:
        return (f"stream created again at {created.isoformat()} "
                f"(was {known_created.isoformat()}); last sequence {last_seq}")
    if last_seq < max_seen:
        return f"last sequence {last_seq} is below the applied revision {max_seen}"
    return None
