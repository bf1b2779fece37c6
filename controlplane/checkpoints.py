"""Signed checkpoints of the audit and ACK chains on ``RUDDER_AUDIT_CHECKPOINTS``, and the
verification that uses them (issue 8; payload in ``controlplane/protocol/checkpoints.py``).

Taking
    ``Checkpointer`` takes a checkpoint every ``interval_s`` when a chain grew, and soon after
    ``every_rows`` rows were written by this process. It reads the newest checkpoint (direct get),
    lists the rows of each chain after that checkpoint's heads (at most ``MAX_SEGMENT_ROWS`` per
    chain and message; a backlog takes several) and publishes with
    ``Nats-Expected-Last-Subject-Sequence``: replicas never publish overlapping checkpoints, the
    one that loses the race just skips its turn.

Signing
    Ed25519 (PyNaCl) over ``CHECKPOINT_DOMAIN || subject || 0x00 || payload`` (a prefix of their
    own, so no checkpoint signature passes for a policy one), headers ``Rudder-Key-Id`` and
    ``Rudder-Signature`` (base64). This is a minimal helper of our own until the policy-signing
    module (``controlplane/protocol/signing.py``) is merged; the key files have the same shape:
    a signing key file holds ``<key id> <base64 32-byte seed>`` (or the seed alone: its id is then
    derived from the public key), a verify-keys file one ``<key id> <base64 public key>`` a line.

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
import base64
import binascii
import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.signing
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError

from controlplane.audit.records import GENESIS_HASH
from controlplane.audit.store import AuditStore, Chain, VerifyResult
from controlplane.protocol.checkpoints import (
    MAX_SEGMENT_ROWS,
    AuditCheckpoint,
    ChainSegment,
    decode_checkpoint,
)
from controlplane.protocol.errors import InvalidRequest, LogUnavailable, RudderError
from controlplane.protocol.subjects import (
    AUDIT_CHECKPOINTS_SUBJECT,
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_KEY_ID,
    HDR_SIGNATURE,
    JS_ERR_WRONG_LAST_SEQUENCE,
    STREAM_AUDIT_CHECKPOINTS,
)
from controlplane.tasks import cancel_all

log = logging.getLogger(__name__)

# ---- keys and signatures ---------------------------------------------------------------------


class KeyFileError(RudderError):
    """A key file is missing or malformed; ``field`` names the setting that points at it."""

    code = "bad_key_file"


def key_id_of(verify_key: nacl.signing.VerifyKey) -> str:
    return "ed25519-" + hashlib.sha256(bytes(verify_key)).hexdigest()[:16]


@dataclass(frozen=True)
class Signer:
    key_id: str
    key: nacl.signing.SigningKey = field(repr=False)

    @property
    def verify_key(self) -> nacl.signing.VerifyKey:
        return self.key.verify_key

    def headers(self, subject: str, payload: bytes) -> dict[str, str]:
        signature = self.key.sign(_signed_bytes(subject, payload)).signature
        return {HDR_KEY_ID: self.key_id, HDR_SIGNATURE: base64.b64encode(signature).decode()}


#: Domain prefix: a checkpoint signature never verifies as any other Rudder signature.
CHECKPOINT_DOMAIN = b"rudder-audit-checkpoint-v1\0"


def _signed_bytes(subject: str, payload: bytes) -> bytes:
    return CHECKPOINT_DOMAIN + subject.encode() + b"\0" + payload


def _b64(value: str, what: str, setting: str, size: int) -> bytes:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KeyFileError(f"{what} is not base64", field=setting) from exc
    if len(raw) != size:
        raise KeyFileError(f"{what} must be {size} bytes", field=setting)
    return raw


def load_signer(path: Path, *, setting: str = "RUDDER_AUDIT_SIGNING_KEY") -> Signer:
    """Read a signing key file. Raises ``KeyFileError`` naming ``setting``."""
    try:
        parts = path.read_text(encoding="utf-8").split()
    except OSError as exc:
        raise KeyFileError(f"cannot read the signing key {path}: {exc.strerror}", field=setting) from exc
    if len(parts) not in (1, 2):
        raise KeyFileError("a signing key file holds '<key id> <base64 seed>'", field=setting)
    key = nacl.signing.SigningKey(_b64(parts[-1], "the signing key seed", setting, 32))
    return Signer(key_id=parts[0] if len(parts) == 2 else key_id_of(key.verify_key), key=key)


def load_verify_keys(path: Path, *, setting: str = "RUDDER_AUDIT_VERIFY_KEYS") -> dict[str, nacl.signing.VerifyKey]:
    """Read a verify-keys file (``<key id> <base64 public key>`` a line, ``#`` comments)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyFileError(f"cannot read the verify keys {path}: {exc.strerror}", field=setting) from exc
    keys: dict[str, nacl.signing.VerifyKey] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(f"line {n}: expected '<key id> <base64 public key>'", field=setting)
        keys[parts[0]] = nacl.signing.VerifyKey(_b64(parts[1], f"line {n}", setting, 32))
    if not keys:
        raise KeyFileError(f"{path} holds no key", field=setting)
    return keys


def generate_key_file(path: Path) -> Signer:
    """Write a new signing key (mode 0600) and return it; an existing file is kept and read."""
    if path.exists():
        return load_signer(path)
    key = nacl.signing.SigningKey.generate()
    signer = Signer(key_id=key_id_of(key.verify_key), key=key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(f"{signer.key_id} {base64.b64encode(bytes(key)).decode()}\n")
    return signer


def public_line(signer: Signer) -> str:
    """The signer's line for a verify-keys file."""
    return f"{signer.key_id} {base64.b64encode(bytes(signer.verify_key)).decode()}"


def signature_problem(subject: str, payload: bytes, headers: Mapping[str, str] | None,
                      keys: Mapping[str, nacl.signing.VerifyKey]) -> str | None:
    """None when the message is signed by a trusted key, else what is wrong with it."""
    headers = headers or {}
    key_id, signature = headers.get(HDR_KEY_ID), headers.get(HDR_SIGNATURE)
    if not key_id or not signature:
        return "is not signed"
    key = keys.get(key_id)
    if key is None:
        return f"is signed by key {key_id!r}, which is not trusted"
    try:
        key.verify(_signed_bytes(subject, payload), base64.b64decode(signature, validate=True))
    except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError):
        return f"has a signature that does not verify with key {key_id!r}"
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

    nats errors become ``LogUnavailable`` here; a stale CAS is reported as ``False``.
    """

    def __init__(self, js: JetStreamContext, *, keys: Mapping[str, nacl.signing.VerifyKey],
                 signer: Signer | None = None, timeout_s: float = 2.0) -> None:
        self.js = js
        self.keys = dict(keys)
        self.signer = signer
        self.timeout_s = timeout_s

    def _stored(self, msg: Any) -> StoredCheckpoint:
        headers = dict(msg.headers or {})
        payload = bytes(msg.data or b"")
        problem = signature_problem(msg.subject, payload, headers, self.keys)
        checkpoint = None
        try:
            checkpoint = decode_checkpoint(payload)
        except InvalidRequest as exc:
            problem = problem or f"is malformed: {exc.message}"
        return StoredCheckpoint(seq=int(msg.seq), checkpoint=checkpoint,
                                key_id=headers.get(HDR_KEY_ID), problem=problem)

    @contextlib.asynccontextmanager
    async def _bus(self, what: str) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.timeout_s + 0.5):
                yield
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            if isinstance(exc, BadRequestError) and exc.err_code == JS_ERR_WRONG_LAST_SEQUENCE:
                raise
            raise LogUnavailable(f"checkpoint stream ({what}): {type(exc).__name__}", retry_after=2) from exc

    async def newest(self) -> StoredCheckpoint | None:
        async with self._bus("newest"):
            try:
                msg = await self.js.get_last_msg(STREAM_AUDIT_CHECKPOINTS, AUDIT_CHECKPOINTS_SUBJECT, direct=True)
            except NotFoundError:
                return None
        return self._stored(msg)

    async def publish(self, checkpoint: AuditCheckpoint, *, expected_seq: int) -> int | None:
        """Publish signed, if the newest checkpoint is still ``expected_seq``; its sequence, or
        None when another replica published first."""
        if self.signer is None:
            raise RuntimeError("a checkpoint log without a signer cannot publish")
        payload = checkpoint.to_bytes()
        headers = self.signer.headers(AUDIT_CHECKPOINTS_SUBJECT, payload)
        headers[HDR_EXPECTED_LAST_SUBJECT_SEQ] = str(expected_seq)
        try:
            async with self._bus("publish"):
                ack = await self.js.publish(AUDIT_CHECKPOINTS_SUBJECT, payload, headers=headers,
                                            timeout=self.timeout_s)
        except BadRequestError as exc:
            if exc.err_code == JS_ERR_WRONG_LAST_SEQUENCE:
                return None
            raise LogUnavailable(f"checkpoint refused: {exc.description}") from exc
        return int(ack.seq)

    async def all(self) -> AsyncIterator[StoredCheckpoint]:
        """Every checkpoint, oldest first (one direct get each)."""
        seq = 1
        while True:
            async with self._bus("read"):
                try:
                    msg = await self.js.get_msg(STREAM_AUDIT_CHECKPOINTS, seq=seq,
                                                subject=AUDIT_CHECKPOINTS_SUBJECT, next=True, direct=True)
                except NotFoundError:
                    return
            stored = self._stored(msg)
            yield stored
            seq = stored.seq + 1


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
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        # The checkpoint we published last: while our CAS publishes succeed it is the newest,
        # so the stream is read (and the checkpoint decoded) only after another replica's turn.
        self._last: StoredCheckpoint | None = None

    def notify(self, rows: int) -> None:
        """Called by the store after it committed ``rows`` rows (no I/O, any task)."""
        self._rows_since += rows
        if self._rows_since >= self.every_rows:
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="audit-checkpointer")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])
            self._task = None

    async def run(self) -> None:
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

    async def take(self) -> int:
        """Publish checkpoints until both chains are covered; returns how many were published."""
        published = 0
        while True:
            newest = self._last or await self.log.newest()
            base = newest.checkpoint if newest is not None else None
            if newest is not None and newest.problem is not None:
                log.error("newest audit checkpoint (seq %d) %s: not continuing from it",
                          newest.seq, newest.problem)
                return published
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
            if seq is None:  # another replica took it; its checkpoint covers these rows
                self._last = None
                return published
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
