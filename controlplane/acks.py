"""Router ACK/NACKs from the ``RUDDER_ACKS`` stream into the audit database (DESIGN §2, §9).

One durable pull consumer per fleet (``acks_consumer``, default ``rudder-controlplane``) is shared
by every control-plane replica: JetStream hands each message to one fetcher at a time, and one
that is not acknowledged within ``ack_wait`` is handed out again. A message is acknowledged only
after its row is committed, so a control plane that dies between the two costs a redelivery, not
a lost ACK; the redelivered (or concurrently fetched) message is recognised by its stream sequence
(``router_acks.stream_seq``, checked under the ACK chain's lock) and stored once.

Routers publish whether or not a control plane runs; the stream keeps ACKs for at least 7 days,
so a control plane that starts later records every one of them, oldest first.

A payload that is not an ``ApplyAck``, or whose ``router_id`` is not its subject's, is terminated
(never redelivered), logged once per source and counted (``drops``, shared with the fleet view);
it cannot stall the consumer.

A router is believed about what it applied, not about when or what exists (issue 17): an ACK's
``at`` is the time the ``RUDDER_ACKS`` stream stored it, never the payload's, and an ACK for a
revision the control plane never wrote (:class:`RevisionCheck`: an ACK names a signed event on
that document's subject, a NACK any message of it) is terminated and counted
(``unknown_revision``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from bus.client import Bus, Message, PullConsumer
from controlplane.audit.store import AckRecord, AuditStore
from controlplane.eventlog import PolicyLog
from controlplane.protocol.errors import InvalidRequest, RudderError, SubjectMismatch
from controlplane.protocol.events import AckStatus, ApplyAck, check_ack_subject, decode_apply_ack
from controlplane.protocol.guard import Drops
from controlplane.protocol.subjects import ACKS_SUBJECTS, STREAM_ACKS, STREAM_POLICY, policy_subject

log = logging.getLogger(__name__)


class RevisionCheck:
    """Whether a policy revision an ACK names was ever written on its document's subject.

    An ACK (applied) must name a revision that holds a policy event signed by a valid key (what
    the control plane wrote; :class:`~controlplane.eventlog.PolicyLog` verifies), with the same
    ``event_id`` when the ACK names one; a NACK, any message of that subject (routers NACK junk).
    A revision past the stream's last sequence, or holding another document's message, was never
    written. One the stream no longer holds (history limit) cannot be told: it is believed.
    Verdicts are cached (a revision is ACKed by every router). Raises LogUnavailable."""

    def __init__(self, log_: PolicyLog, *, cache_size: int = 10_000) -> None:
        self.log = log_
        self.cache_size = cache_size
        self._ok: set[tuple[str, str, int, AckStatus, str | None]] = set()

    async def refusal(self, ack: ApplyAck) -> str | None:
        """Why ``ack`` names a revision that was never written, or None."""
        key = (ack.model, ack.kind.value, ack.revision, ack.status,
               str(ack.event_id) if ack.event_id else None)
        if key in self._ok:
            return None
        reason = await self._check(ack)
        if reason is None:
            if len(self._ok) >= self.cache_size:
                self._ok.clear()
            self._ok.add(key)
        return reason

    async def _check(self, ack: ApplyAck) -> str | None:
        what = f"revision {ack.revision} of {ack.model}|{ack.kind.value}"
        msg = await self.log.bus.get(STREAM_POLICY, ack.revision)
        if msg is None:
            last = (await self.log.bus.stream_state(STREAM_POLICY)).last_seq
            return f"{what} was never written (the stream's last is {last})" if ack.revision > last else None
        if msg.subject != policy_subject(ack.model, ack.kind.value):
            return f"{what} is not on its subject (it holds {msg.subject})"
        if ack.status is AckStatus.NACK:
            return None
        stored = await self.log.get(ack.model, ack.kind, ack.revision)
        if stored is None or stored.event is None:
            return f"{what} is not an event the control plane signed ({stored.error if stored else 'gone'})"
        if ack.event_id is not None and stored.event.event_id != ack.event_id:
            return f"{what} is event {stored.event.event_id}, not {ack.event_id}"
        return None


class AckConsumer:
    """Fetch ACKs in batches, write each batch in one transaction, then acknowledge it."""

    def __init__(self, bus: Bus, store: AuditStore, *, durable: str,
                 batch: int = 128, ack_wait_s: float = 30.0, fetch_timeout_s: float = 1.0,
                 drops: Drops | None = None, revisions: RevisionCheck | None = None) -> None:
        self.bus = bus
        self.revisions = revisions
        self.drops = drops or Drops(log)
        self.store = store
        self.durable = durable
        self.batch = batch
        self.ack_wait_s = ack_wait_s
        self.fetch_timeout_s = fetch_timeout_s
        self._sub: PullConsumer | None = None
        self.recorded = 0  # rows this replica wrote (tests, metrics)

    async def stop(self) -> None:
        """Leave the durable consumer (it stays on the server for the other replicas)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.stop()

    async def run(self) -> None:
        """Until cancelled (a task of the control plane's lifespan); a lost bus or database is
        waited out, never fatal."""
        try:
            while True:
                try:
                    await self.stop()
                    sub = self._sub = await self.bus.durable(
                        STREAM_ACKS, ACKS_SUBJECTS, name=self.durable, ack_wait_s=self.ack_wait_s,
                        max_ack_pending=10_000)
                    while True:
                        msgs = await sub.fetch(self.batch, wait_s=self.fetch_timeout_s)
                        if msgs:
                            await self.handle(msgs)
                except asyncio.CancelledError:
                    raise
                except RudderError as exc:
                    log.warning("ACK consumer %s: %r; retrying", self.durable, exc)
                    await asyncio.sleep(1.0)
                except Exception:
                    log.exception("ACK consumer %s failed; retrying", self.durable)
                    await asyncio.sleep(1.0)
        finally:
            await self.stop()

    async def handle(self, msgs: list[Message]) -> None:
        """Record a fetched batch, then acknowledge it (terminate what can never be recorded)."""
        good: list[tuple[Message, AckRecord]] = []
        for msg in msgs:
            try:
                ack = decode_apply_ack(msg.data)
                check_ack_subject(msg.subject, ack)  # a router speaks for itself only
            except InvalidRequest as exc:
                reason = "subject_mismatch" if isinstance(exc, SubjectMismatch) else "malformed"
                self.drops.drop("ack", reason, msg.subject, f"{exc.message} (stream seq {msg.seq})")
                await msg.term()
                continue
            if self.revisions is not None:
                try:
                    refused = await self.revisions.refusal(ack)
                except RudderError as exc:  # the policy stream did not answer: ask again later
                    log.warning("ACK at stream seq %s not checked (%s); redelivered later", msg.seq,
                                exc.message)
                    with contextlib.suppress(RudderError):
                        await msg.nak(delay=1.0)
                    continue
                if refused is not None:
                    self.drops.drop("ack", "unknown_revision", msg.subject,
                                    f"{ack.status.value} from {ack.router_id}: {refused} (stream seq {msg.seq})")
                    await msg.term()
                    continue
            if msg.stored_at is not None:  # when the bus stored it, not what the router says
                ack = ack.model_copy(update={"at": msg.stored_at})
            good.append((msg, AckRecord(ack, msg.seq or 0)))
        if not good:
            return
        try:
            written = await self.store.record_acks([r for _, r in good])
        except RudderError as exc:
            # Not acknowledged: redelivered after a short delay (or ack_wait if the nak is lost).
            log.warning("%d ACKs not recorded (%s); they will be redelivered", len(good), exc.message)
            for msg, _ in good:
                with contextlib.suppress(RudderError):
                    await msg.nak(delay=1.0)
            return
        self.recorded += written
        for msg, _ in good:
            await msg.ack()
