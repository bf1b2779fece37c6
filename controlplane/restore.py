"""The last good document, for a router that has no valid signed head (issue 17 item 3).

Junk on a policy subject (anyone with the control plane's NATS credential can publish it) can
evict every good revision from the stream's per-document history; a router that (re)starts then
finds no signed event to apply. Rather than serve its startup values it asks, on
``rudder.restore.<router_id>`` (core request/reply), and the control plane answers with the
document of the newest revision its audit log says it wrote, signed with the policy key over
``rudder.restore.<router_id>`` and the answer's bytes, which name the router and the question's
nonce: an answer cannot be replayed to another question or another router, and without the
signing key nobody else can answer (a thief holding the control plane's NATS credential can only
answer junk, which the router refuses: it is no worse off than before asking).

A question whose ``router_id`` is not its subject's, or that does not decode, is dropped and
counted (``drops``); it gets no answer.
"""

from __future__ import annotations

import logging

from bus.client import Bus, Message, Subscription
from controlplane.audit.store import AuditStore
from controlplane.eventlog import PolicyLog
from controlplane.protocol.errors import InvalidRequest, RudderError, SubjectMismatch
from controlplane.protocol.events import (
    PolicyRestored,
    SignedRestore,
    check_restore_subject,
    decode_restore_request,
)
from controlplane.protocol.guard import Drops
from controlplane.protocol.subjects import HDR_KEY_ID, HDR_SIGNATURE, RESTORE_PREFIX, restore_subject

log = logging.getLogger(__name__)


class RestoreResponder:
    def __init__(self, bus: Bus, audit: AuditStore, policy: PolicyLog, *, drops: Drops) -> None:
        self.bus = bus
        self.audit = audit
        self.policy = policy  # its signer is the current policy key (rotation swaps it)
        self.drops = drops
        self._sub: Subscription | None = None
        self.answered = 0

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(f"{RESTORE_PREFIX}.*", self._on_msg)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.stop()

    async def _on_msg(self, msg: Message) -> None:
        try:
            question = decode_restore_request(msg.data)
            check_restore_subject(msg.subject, question)
        except InvalidRequest as exc:
            reason = "subject_mismatch" if isinstance(exc, SubjectMismatch) else "malformed"
            self.drops.drop("restore", reason, msg.subject, exc.message)
            return
        try:
            row = await self.audit.last_accepted(question.model, question.kind.value)
            answer = PolicyRestored(
                router_id=question.router_id, model=question.model, kind=question.kind,
                nonce=question.nonce, revision=(row.new_revision or 0) if row is not None else 0,
                event_id=row.event_id if row is not None else None,
                document=dict(row.after or {}) if row is not None else {},
            ).to_bytes()
            headers = self.policy.signer.sign(restore_subject(question.router_id), answer)
            await msg.respond(SignedRestore(
                payload=answer.decode(), key_id=headers[HDR_KEY_ID], signature=headers[HDR_SIGNATURE],
            ).to_bytes())
        except RudderError as exc:
            log.warning("no restore answer for router %s (%s|%s): %s", question.router_id,
                        question.model, question.kind.value, exc.message)
            return
        self.answered += 1
        log.warning("router %s has no valid signed head of %s|%s: sent the last document written "
                    "(revision %s)", question.router_id, question.model, question.kind.value,
                    row.new_revision if row is not None else 0)
