"""Signed checkpoints of the audit and ACK chains on ``RUDDER_AUDIT_CHECKPOINTS``, and the
verification that uses them (issue 8; payload in ``controlplane/protocol/checkpoints.py``).

Taking
    ``Checkpointer`` takes a checkpoint every ``interval_s`` when a chain grew, and soon after
    ``every_rows`` rows were written by this process. It reads the newest checkpoint (direct get),
    lists the rows of each chain after that checkpoint's heads (at most ``MAX_SEGMENT_ROWS`` per
    chain and message; a backlog takes several) and publishes with
    ``Nats-Expected-Last-Subject-Sequence``: replicas never publish overlapping checkpoints, the
    one that loses the race just skips its turn. A newest message that is not a good checkpoint
    (unsigned, an untrusted key, malformed) is reported once and skipped: the next checkpoint
    continues from the newest good one (issue 17), so one message cannot stop anchoring.

Signing
    With the one signature scheme (:mod:`controlplane.protocol.signing`, purpose
    ``checkpoint``: its own key and domain prefix, so no checkpoint signature passes for a policy
    one), headers ``Rudder-Key-Id`` and ``Rudder-Signature``. A message on the subject that is
    not a well-formed checkpoint signed by a trusted key is reported (``problem``).

Verifying
    ``verify_chains`` walks each chain (linkage and row hashes, ``AuditStore.verify``) and then
    compares every row hash a checkpoint lists with the database: a listed row that is gone
    (deleted, truncated) or whose hash differs (rewritten, even with the chain recomputed after
    it) is named; the earliest problem of either kind is reported. A checkpoint whose signature
    does not verify with a trusted key is itself a failure. Rows after the newest checkpoint are
    covered by the chain alone (``unanchored`` says how many): the window an owner could still
    rewrite unseen is ``interval_s`` / ``every_rows``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bus.client import Bus, Message
from controlplane.audit.records import GENESIS_HASH
from controlplane.audit.store import AuditStore, Chain, VerifyResult
from controlplane.protocol.checkpoints import (
    MAX_SEGMENT_ROWS,
    AuditCheckpoint,
    ChainSegment,
    decode_checkpoint,
)
from controlplane.protocol.errors import InvalidRequest, RevisionConflict, RudderError, SignatureInvalid
from controlplane.protocol.signing import (
    SIGNATURE_MISSING,
    SIGNATURE_UNKNOWN_KEY,
    Keyring,
    Purpose,
    SigningKey,
)
from controlplane.protocol.subjects import (
    AUDIT_CHECKPOINTS_SUBJECT,
    HDR_KEY_ID,
    STREAM_AUDIT_CHECKPOINTS,
)

log = logging.getLogger(__name__)


def signature_problem(subject: str, payload: bytes, headers: Any, keyring: Keyring) -> str | None:
    """None when the message is signed by a key of ``keyring``, else what is wrong with it (in
    the words of ``rudder audit verify``)."""
    try:
        keyring.verify(subject, payload, headers)
    except SignatureInvalid as exc:
        if exc.reason_code == SIGNATURE_MISSING:
            return "is not signed"
        if exc.reason_code == SIGNATURE_UNKNOWN_KEY:
            return f"is signed by key {exc.key_id!r}, which is not trusted"
        return f"has a signature that does not verify with key {exc.key_id!r}"
    return None


# ---- the stream --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredCheckpoint:
    seq: int
    checkpoint: AuditCheckpoint | None
    key_id: str | None
    problem: str | None  # None: well-formed and signed by a trusted key


class CheckpointLog:
    """``RUDDER_AUDIT_CHECKPOINTS``: newest, CAS publish, every checkpoint in order.

    Trusted keys are ``keyring`` and the signer's own; :meth:`use_keys` swaps them (rotation).
    """

    def __init__(self, bus: Bus, *, keyring: Keyring | None = None, signer: SigningKey | None = None) -> None:
        self.bus = bus
        self.use_keys(signer, keyring or Keyring({}, Purpose.CHECKPOINT))

    def use_keys(self, signer: SigningKey | None, keyring: Keyring) -> None:
        self.signer = signer
        own = Keyring.of([signer.public_key] if signer is not None else [], Purpose.CHECKPOINT)
        self.keyring = Keyring(dict(keyring.keys), Purpose.CHECKPOINT).union(own)

    def _stored(self, msg: Message) -> StoredCheckpoint:
        problem = signature_problem(msg.subject, msg.data, msg.headers, self.keyring)
        checkpoint = None
        try:
            checkpoint = decode_checkpoint(msg.data)
        except InvalidRequest as exc:
            problem = problem or f"is malformed: {exc.message}"
        return StoredCheckpoint(seq=msg.seq or 0, checkpoint=checkpoint,
                                key_id=msg.headers.get(HDR_KEY_ID), problem=problem)

    async def newest(self) -> StoredCheckpoint | None:
        msg = await self.bus.last(STREAM_AUDIT_CHECKPOINTS, AUDIT_CHECKPOINTS_SUBJECT)
        return self._stored(msg) if msg is not None else None

    async def at(self, seq: int) -> StoredCheckpoint | None:
        """The message at ``seq`` of the checkpoint stream, or None."""
        msg = await self.bus.get(STREAM_AUDIT_CHECKPOINTS, seq)
        return self._stored(msg) if msg is not None and msg.subject == AUDIT_CHECKPOINTS_SUBJECT else None

    async def publish(self, checkpoint: AuditCheckpoint, *, expected_seq: int) -> int | None:
        """Publish signed, if the newest checkpoint is still ``expected_seq``; its sequence, or
        None when another replica published first. Raises LogUnavailable."""
        if self.signer is None:
            raise RuntimeError("a checkpoint log without a signer cannot publish")
        payload = checkpoint.to_bytes()
        try:
            result = await self.bus.publish_cas(
                STREAM_AUDIT_CHECKPOINTS, AUDIT_CHECKPOINTS_SUBJECT, payload, expected_seq=expected_seq,
                msg_id=f"checkpoint-{checkpoint.writer}-{checkpoint.audit.last_id}-{checkpoint.acks.last_id}"
                       f"-{checkpoint.at.timestamp():.6f}",
                headers=self.signer.sign(AUDIT_CHECKPOINTS_SUBJECT, payload))
        except RevisionConflict:
            return None
        return result.seq

    async def all(self) -> AsyncIterator[StoredCheckpoint]:
        """Every checkpoint, oldest first (one direct get each)."""
        async for msg in self.bus.messages(STREAM_AUDIT_CHECKPOINTS, AUDIT_CHECKPOINTS_SUBJECT):
            yield self._stored(msg)


# ---- taking checkpoints ------------------------------------------------------------------------


def _segment(rows: list[tuple[int, str]], base: ChainSegment | None) -> ChainSegment:
    if rows:
        return ChainSegment(last_id=rows[-1][0], last_hash=rows[-1][1], rows=rows)
    if base is not None:
        return ChainSegment(last_id=base.last_id, last_hash=base.last_hash)
    return ChainSegment(last_id=0, last_hash=GENESIS_HASH)


class Checkpointer:
    """Publishes checkpoints on a timer and after every ``every_rows`` rows (see module doc)."""

    def __init__(self, log_: CheckpointLog, store: AuditStore, *, interval_s: float,
                 every_rows: int, writer: str) -> None:
        self.log = log_
        self.store = store
        self.interval_s = interval_s
        self.every_rows = every_rows
        self.writer = writer
        self._rows_since = 0
        self._wake = asyncio.Event()
        self.published = 0
        # The checkpoint we published last: while our CAS publishes succeed it is the newest,
        # so the stream is read (and the checkpoint decoded) only after another replica's turn.
        self._last: StoredCheckpoint | None = None
        self.skipped: set[int] = set()  # sequences of bad checkpoints reported and skipped

    def notify(self, rows: int) -> None:
        """Called by the store after it committed ``rows`` rows (no I/O, any task)."""
        self._rows_since += rows
        if self._rows_since >= self.every_rows:
            self._wake.set()

    async def run(self) -> None:
        """Until cancelled (a task of the control plane's lifespan)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            self._wake.clear()
            self._rows_since = 0
            try:
                await self.take()
            except asyncio.CancelledError:
                raise
            except RudderError as exc:
                log.warning("audit checkpoint not taken: %s", exc.message)
            except Exception:
                log.exception("audit checkpoint failed")

    async def _newest_good(self, newest: StoredCheckpoint) -> StoredCheckpoint | None:
        """The newest checkpoint without a problem before ``newest`` (which has one), or None.
        A message on the subject that is not a checkpoint signed by a trusted key (anyone with
        the control plane's NATS credential can publish one) is reported once and skipped: the
        next checkpoint continues from the newest good one, published with compare-and-set on
        the stream's real last sequence, so one message cannot stop anchoring."""
        bad = newest
        while True:
            if bad.seq not in self.skipped:
                self.skipped.add(bad.seq)
                log.error("audit checkpoint seq %d %s: skipped; continuing from the newest good one",
                          bad.seq, bad.problem)
            seq = bad.seq - 1
            found: StoredCheckpoint | None = None
            while seq > 0 and found is None:
                found = await self.log.at(seq)
                seq -= 1
            if found is None or found.problem is None:
                return found
            bad = found

    async def take(self) -> int:
        """Publish checkpoints until both chains are covered; returns how many were published."""
        published = 0
        while True:
            newest = self._last or await self.log.newest()
            good = newest
            if newest is not None and newest.problem is not None:
                good = await self._newest_good(newest)
            base = good.checkpoint if good is not None else None
            audit_rows = await self.store.row_hashes(
                Chain.AUDIT, after_id=base.audit.last_id if base else 0, limit=MAX_SEGMENT_ROWS)
            ack_rows = await self.store.row_hashes(
                Chain.ACKS, after_id=base.acks.last_id if base else 0, limit=MAX_SEGMENT_ROWS)
            if not audit_rows and not ack_rows:
                return published
            checkpoint = AuditCheckpoint(
                at=datetime.now(UTC), writer=self.writer,
                audit=_segment(audit_rows, base.audit if base else None),
                acks=_segment(ack_rows, base.acks if base else None),
            )
            try:
                seq = await self.log.publish(checkpoint, expected_seq=newest.seq if newest else 0)
            except BaseException:
                self._last = None  # outcome unknown: read the stream next time
                raise
            if seq is None:
                if self._last is not None:  # the stream moved past ours: read it, then go on
                    self._last = None
                    continue
                return published  # another replica took it; its checkpoint covers these rows
            self._last = StoredCheckpoint(seq=seq, checkpoint=checkpoint,
                                          key_id=self.log.signer.key_id if self.log.signer else None,
                                          problem=None)
            published += 1
            self.published += 1
            log.info("audit checkpoint %d: audit row %d, ack row %d", seq,
                     checkpoint.audit.last_id, checkpoint.acks.last_id)
            if len(audit_rows) < MAX_SEGMENT_ROWS and len(ack_rows) < MAX_SEGMENT_ROWS:
                return published


# ---- verifying ---------------------------------------------------------------------------------


@dataclass
class ChainReport:
    chain: Chain
    walk: VerifyResult
    first_broken_id: int | None = None
    reason: str | None = None
    anchored_through: int = 0  # the newest checkpoint's head of this chain

    @property
    def ok(self) -> bool:
        return self.first_broken_id is None

    def note(self, row_id: int, reason: str) -> None:
        if self.first_broken_id is None or row_id < self.first_broken_id:
            self.first_broken_id, self.reason = row_id, reason

    def to_dict(self) -> dict[str, Any]:
        head_id = self.walk.last_id or 0
        return {
            "ok": self.ok, "checked": self.walk.checked, "first_broken_id": self.first_broken_id,
            "reason": self.reason,
            "head": {"last_id": head_id, "last_hash": self.walk.last_hash or GENESIS_HASH},
            "anchored_through": self.anchored_through,
            "unanchored": max(head_id - self.anchored_through, 0),
        }


async def verify_chains(store: AuditStore, checkpoints: CheckpointLog | None) -> dict[str, Any]:
    """The database against its chains and every checkpoint; see the module docstring.

    Raises ``AuditUnavailable`` / ``LogUnavailable`` when a store cannot be read.
    """
    reports = {c: ChainReport(chain=c, walk=await store.verify(chain=c)) for c in Chain}
    for report in reports.values():
        if not report.walk.ok and report.walk.first_broken_id is not None:
            report.note(report.walk.first_broken_id, report.walk.reason or "chain broken")
    newest: StoredCheckpoint | None = None
    bad_checkpoints: list[str] = []
    if checkpoints is not None:
        settled: set[Chain] = set()
        async for stored in checkpoints.all():
            if stored.problem is not None or stored.checkpoint is None:
                bad_checkpoints.append(f"checkpoint {stored.seq} {stored.problem}")
                continue
            newest = stored
            for chain in Chain:
                if chain in settled:
                    continue
                segment = stored.checkpoint.audit if chain is Chain.AUDIT else stored.checkpoint.acks
                found = await _compare(store, chain, segment, stored)
                if found is not None:
                    reports[chain].note(*found)
                    settled.add(chain)
        if newest is not None and newest.checkpoint is not None:
            reports[Chain.AUDIT].anchored_through = newest.checkpoint.audit.last_id
            reports[Chain.ACKS].anchored_through = newest.checkpoint.acks.last_id
    audit, acks = reports[Chain.AUDIT], reports[Chain.ACKS]
    broken = audit if not audit.ok else acks if not acks.ok else None
    out: dict[str, Any] = {
        "ok": broken is None and not bad_checkpoints,
        "checked": audit.walk.checked,
        "chain": None if broken is None else broken.chain.value,
        "first_broken_id": None if broken is None else broken.first_broken_id,
        "reason": None if broken is None else broken.reason,
        "head": {c.value: r.to_dict()["head"] for c, r in reports.items()},
        "chains": {c.value: r.to_dict() for c, r in reports.items()},
        "checkpoint": None if newest is None or newest.checkpoint is None else {
            "seq": newest.seq, "key_id": newest.key_id, **newest.checkpoint.head()},
        "bad_checkpoints": bad_checkpoints,
    }
    if broken is None and bad_checkpoints:
        out["reason"] = bad_checkpoints[0]
    return out


async def _compare(store: AuditStore, chain: Chain, segment: ChainSegment,
                   stored: StoredCheckpoint) -> tuple[int, str] | None:
    """The first row a checkpoint lists that is gone or differs in the database, if any."""
    if not segment.rows:
        return None
    first, last = segment.rows[0][0], segment.rows[-1][0]
    in_db = dict(await store.row_hashes(chain, after_id=first - 1, through_id=last,
                                        limit=last - first + 1))
    assert stored.checkpoint is not None
    at = stored.checkpoint.at.isoformat()
    for row_id, row_hash in segment.rows:
        got = in_db.get(row_id)
        if got is None:
            return row_id, (f"{chain.value} row {row_id} is gone: checkpoint {stored.seq} "
                            f"(signed {at}) anchors it")
        if got != row_hash:
            return row_id, (f"{chain.value} row {row_id}: row_hash differs from the one checkpoint "
                            f"{stored.seq} (signed {at}) anchors: the row was rewritten")
    return None
