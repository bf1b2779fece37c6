"""The audit store: PostgreSQL adapter for the hash-chained audit log and router ACKs (DESIGN §4).

Chain
    Every append runs one transaction that takes ``pg_advisory_xact_lock(CHAIN_LOCK_KEY)``, reads
    the newest row (``id``, ``row_hash``), hashes and inserts the new rows with ``id = last + 1``
    and commits. The lock is held until commit, so appends from any number of control-plane
    processes form one chain; a unique index on ``prev_hash`` makes a fork impossible to store
    even for a writer that skipped the lock. The session must run at READ COMMITTED (the
    default): the read after the lock then sees the previous holder's commit.

Group commit
    With the lock held across a commit (one WAL flush), a plain serialised insert tops out at
    roughly one append per flush. So appends from one process go through one writer task that
    drains whatever is queued and writes it in a single transaction under the lock; each caller's
    future gets its own rows. ``append_many`` entries are never split across transactions.
    A failed batch fails every waiter in it with ``AuditUnavailable``. An entry whose caller
    gave up (timeout or cancellation) before its batch started is not written; one whose batch
    was already in flight may be written although its caller saw ``AuditUnavailable`` — the
    write path treats that like any commit whose answer was lost, and the reconciler resolves it.

Errors
    Every database error or timeout (``OSError``, asyncpg errors, SQLAlchemy errors,
    ``TimeoutError``) is translated here, once, into ``AuditUnavailable`` (``raise … from exc``).
    Each operation is bounded by ``timeout_s`` (``verify`` per batch). Connections are checked with
    a ping on checkout and invalidated on error, so the store recovers by itself after PostgreSQL
    restarts.

Limits
    The chain proves that no stored row was altered, removed or inserted in the middle; it cannot
    by itself notice that the newest rows were removed, or a rewrite by someone who recomputed
    the hashes after it: the signed checkpoints on ``RUDDER_AUDIT_CHECKPOINTS``
    (``controlplane/checkpoints.py``) anchor it for that. The trigger that refuses UPDATE/DELETE
    binds the table owner too, but the owner can disable it: the control plane runs as a role
    with SELECT and INSERT only (``migrations/grants.py``).

ACK chain
    ``router_acks`` is chained the same way under its own lock (``ACK_CHAIN_LOCK_KEY``); rows
    consumed from ``RUDDER_ACKS`` carry their stream sequence, unique, so one ACK is one row
    however many control planes consume it or how often it is redelivered.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

import asyncpg  # type: ignore[import-untyped]
from sqlalchemy import Row, Select, exists, func, insert, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from controlplane.audit.records import (
    GENESIS_HASH,
    AuditEntry,
    AuditRow,
    AuditStage,
    Decision,
    ack_hashed_fields,
    compute_row_hash,
    format_time,
)
from controlplane.audit.tables import audit_log, router_acks
from controlplane.protocol.errors import AuditUnavailable, InvalidRequest
from controlplane.protocol.events import AckStatus, ApplyAck

log = logging.getLogger(__name__)

#: Advisory lock that serialises chain appends across processes ("RUDDAUDT").
CHAIN_LOCK_KEY = 0x52554444_41554454
#: The same for the ACK chain ("RUDDACKS").
ACK_CHAIN_LOCK_KEY = 0x52554444_41434B53

#: Errors that mean "the database did not do it": translated into ``AuditUnavailable``.
DB_ERRORS: tuple[type[BaseException], ...] = (
    OSError,  # includes ConnectionError and TimeoutError (asyncio.TimeoutError is TimeoutError)
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    SQLAlchemyError,  # DBAPIError, OperationalError, InterfaceError, pool TimeoutError, ...
)

MAX_LIMIT = 1000
_ENTRY_FIELDS = tuple(f.name for f in fields(AuditEntry))
_ROW_FIELDS = (*_ENTRY_FIELDS, "id", "prev_hash", "row_hash")


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    ok: bool
    checked: int
    first_broken_id: int | None = None
    reason: str | None = None
    last_id: int | None = None
    last_hash: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "checked": self.checked, "first_broken_id": self.first_broken_id,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class AckRecord:
    """An ACK/NACK to store, with the ``RUDDER_ACKS`` sequence it arrived at (None: not from
    the stream, e.g. written by a test or an import)."""

    ack: ApplyAck
    stream_seq: int | None = None


class Chain(enum.StrEnum):
    """Which hash chain: the audit log or the router ACKs."""

    AUDIT = "audit"
    ACKS = "acks"


_CHAIN_TABLES = {Chain.AUDIT: audit_log, Chain.ACKS: router_acks}


@dataclass(eq=False)
class _Pending:
    entries: list[AuditEntry]
    future: asyncio.Future[list[AuditRow]]


def _unavailable(message: str, cause: BaseException | None) -> AuditUnavailable:
    err = AuditUnavailable(message)
    err.__cause__ = cause
    err.__suppress_context__ = True
    return err


def _describe(exc: BaseException) -> str:
    text_ = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text_}" if text_ else type(exc).__name__


def encode_cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(f"v1:{last_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """Raises ``InvalidRequest`` (field ``cursor``) for anything we did not hand out."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        version, _, value = raw.partition(":")
        if version != "v1":
            raise ValueError(version)
        last_id = int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidRequest("cursor is not one this server handed out", field="cursor") from exc
    if last_id < 1:
        raise InvalidRequest("cursor is not one this server handed out", field="cursor")
    return last_id


def row_from_db(row: Row[Any] | Mapping[str, Any]) -> AuditRow:
    """An ``AuditRow`` from a database row. Raises ``ValueError`` if the row is malformed."""
    m = row._mapping if isinstance(row, Row) else row
    return AuditRow(**{name: m[name] for name in _ROW_FIELDS})


def _ack_to_dict(row: Row[Any]) -> dict[str, Any]:
    m = row._mapping
    return {
        "id": m["id"], "router_id": m["router_id"], "model": m["model"], "kind": m["kind"],
        "revision": m["revision"], "status": m["status"], "detail": m["detail"],
        "event_id": None if m["event_id"] is None else str(m["event_id"]),
        "effective": dict(m["effective"] or {}), "at": format_time(m["at"]),
    }


def _params(row: AuditRow) -> dict[str, Any]:
    values = {name: getattr(row, name) for name in _ROW_FIELDS}
    values["stage"] = row.stage.value
    values["decision"] = row.decision.value
    values["roles"] = list(row.roles)
    return values


def chain_rows(
    entries: Iterable[AuditEntry], *, last_id: int, last_hash: str
) -> list[AuditRow]:
    """Link ``entries`` after the row (``last_id``, ``last_hash``). Pure."""
    rows: list[AuditRow] = []
    prev_id, prev_hash = last_id, last_hash
    for entry in entries:
        values = AuditEntry.hashed_fields(entry)
        values["id"] = prev_id + 1
        row_hash = compute_row_hash(prev_hash, values)
        rows.append(AuditRow(**values, prev_hash=prev_hash, row_hash=row_hash))
        prev_id, prev_hash = prev_id + 1, row_hash
    return rows


class AuditStore:
    """Append-only, hash-chained audit log in PostgreSQL (see the module docstring).

    Every method raises ``AuditUnavailable`` when the database fails or does not answer within
    ``timeout_s``; query methods also raise ``InvalidRequest`` for bad arguments.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        timeout_s: float = 2.0,
        group_commit: bool = True,
        max_batch: int = 256,
        owns_engine: bool = False,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._engine = engine
        self._timeout_s = timeout_s
        self._group_commit = group_commit
        self._max_batch = max(1, max_batch)
        self._owns_engine = owns_engine
        self._queue: asyncio.Queue[_Pending | None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._writer_conn: AsyncConnection | None = None
        self._closed = False
        #: Called with the number of rows after each commit (the checkpointer counts them).
        self.on_rows: Callable[[int], None] | None = None

    def _committed(self, rows: int) -> None:
        if self.on_rows is not None and rows:
            self.on_rows(rows)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        pool_size: int = 10,
        timeout_s: float = 2.0,
        group_commit: bool = True,
    ) -> AuditStore:
        """A store with its own engine (``postgresql+asyncpg://…``); ``close()`` disposes it.

        Nothing connects until the first operation.
        """
        return cls(
            make_engine(url, pool_size=pool_size, timeout_s=timeout_s),
            timeout_s=timeout_s, group_commit=group_commit, owns_engine=True,
        )

    @property
    def engine(self) -> AsyncEngine:
        """The engine, for sharing with ``TokenStore``."""
        return self._engine

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    # -- error translation -----------------------------------------------------------------

    def _db(self, what: str) -> contextlib.AbstractAsyncContextManager[None]:
        return bounded(f"audit store ({what})", self._timeout_s)

    @contextlib.asynccontextmanager
    async def _read(self, what: str) -> AsyncIterator[AsyncConnection]:
        async with self._db(what), self._engine.connect() as conn:
            yield conn

    # -- appends -----------------------------------------------------------------------------

    async def append(self, entry: AuditEntry) -> AuditRow:
        """Record ``entry``; returns it as stored (id, prev_hash, row_hash)."""
        rows = await self.append_many([entry])
        return rows[0]

    async def append_many(self, entries: Sequence[AuditEntry]) -> list[AuditRow]:
        """Record ``entries`` in order, in one transaction, as consecutive rows of the chain."""
        batch = list(entries)
        if not batch:
            return []
        if self._closed:
            raise AuditUnavailable("audit store is closed")
        if not self._group_commit:
            rows = await self._insert_chained(batch)
            self._committed(len(rows))
            return rows
        queue = self._ensure_writer()
        pending = _Pending(batch, asyncio.get_running_loop().create_future())
        queue.put_nowait(pending)
        try:
            async with asyncio.timeout(self._timeout_s):
                return await pending.future
        except TimeoutError as exc:
            raise AuditUnavailable(
                f"audit store unavailable (append): no commit within {self._timeout_s}s"
            ) from exc

    async def _insert_chained(self, entries: list[AuditEntry]) -> list[AuditRow]:
        """One transaction on a pooled connection (the serialised mode)."""
        async with self._db("append"), self._engine.connect() as conn:
            return await self._chain_on(conn, entries)

    async def _chain_on(self, conn: AsyncConnection, entries: list[AuditEntry]) -> list[AuditRow]:
        """Lock the chain, read its head and insert ``entries`` after it, in one transaction.

        The head is read in a statement *after* the lock is granted: under READ COMMITTED each
        statement takes its snapshot when it starts, so a head read in the locking statement
        could predate a commit made while we waited, and fork the chain.
        """
        async with conn.begin():
            await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": CHAIN_LOCK_KEY})
            last = (
                await conn.execute(
                    select(audit_log.c.id, audit_log.c.row_hash).order_by(audit_log.c.id.desc()).limit(1)
                )
            ).first()
            last_id, last_hash = (last[0], last[1]) if last is not None else (0, GENESIS_HASH)
            rows = chain_rows(entries, last_id=last_id, last_hash=last_hash)
            await conn.execute(insert(audit_log), [_params(r) for r in rows])
        return rows

    async def _insert_with_writer_conn(self, entries: list[AuditEntry]) -> list[AuditRow]:
        """The group-commit writer keeps one connection for itself: no pool checkout, pre-ping or
        reset-on-return per batch. After any failure it is dropped, and the next batch opens a
        fresh one (so a PostgreSQL restart costs the batch that meets it, nothing more)."""
        try:
            async with self._db("append"):
                if self._writer_conn is None:
                    self._writer_conn = await self._engine.connect()
                return await self._chain_on(self._writer_conn, entries)
        except BaseException:
            conn, self._writer_conn = self._writer_conn, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.invalidate()
                with contextlib.suppress(Exception):
                    await conn.close()
            raise

    def _ensure_writer(self) -> asyncio.Queue[_Pending | None]:
        if self._writer is not None and not self._writer.done():
            if self._writer.get_loop() is asyncio.get_running_loop():
                assert self._queue is not None
                return self._queue
        queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._queue = queue
        self._writer_conn = None  # a connection of a previous writer belongs to its event loop
        self._writer = asyncio.create_task(self._run_writer(queue), name="audit-group-commit")
        self._writer.add_done_callback(self._writer_done)
        return queue

    def _writer_done(self, task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("audit writer died", exc_info=exc)
        queue = self._queue
        while queue is not None and not queue.empty():
            item = queue.get_nowait()
            if item is not None and not item.future.done():
                item.future.set_exception(_unavailable("audit writer stopped", exc))

    async def _run_writer(self, queue: asyncio.Queue[_Pending | None]) -> None:
        """Drain the queue: each round writes everything queued in one transaction."""
        while True:
            first = await queue.get()
            if first is None:
                return
            batch, size, stop = [first], len(first.entries), False
            while size < self._max_batch and not queue.empty():
                item = queue.get_nowait()
                if item is None:
                    stop = True
                    break
                batch.append(item)
                size += len(item.entries)
            await self._write_batch(batch)
            if stop:
                return

    async def _write_batch(self, batch: list[_Pending]) -> None:
        live = [p for p in batch if not p.future.done()]  # skip callers that gave up
        if not live:
            return
        try:
            rows = await self._insert_with_writer_conn([e for p in live for e in p.entries])
        except AuditUnavailable as exc:
            for p in live:
                if not p.future.done():
                    p.future.set_exception(_unavailable(exc.message, exc.__cause__))
            return
        except Exception as exc:  # a bug: log it and fail the batch, never kill the writer
            log.exception("audit batch of %d entries failed", sum(len(p.entries) for p in live))
            for p in live:
                if not p.future.done():
                    p.future.set_exception(_unavailable(f"audit append failed: {exc!r}", exc))
            return
        self._committed(len(rows))
        offset = 0
        for p in live:
            n = len(p.entries)
            if not p.future.done():
                p.future.set_result(rows[offset:offset + n])
            offset += n

    # -- reads -------------------------------------------------------------------------------

    async def get(self, id: int) -> AuditRow | None:
        async with self._read("get") as conn:
            row = (await conn.execute(select(audit_log).where(audit_log.c.id == id))).first()
        return None if row is None else row_from_db(row)

    async def query(
        self,
        *,
        model: str | None = None,
        kind: str | None = None,
        actor: str | None = None,
        decision: Decision | str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        event_id: uuid.UUID | str | None = None,
        cursor: str | None = None,
        limit: int = 100,
    ) -> tuple[list[AuditRow], str | None]:
        """Rows newest first, filtered; returns (rows, next cursor or None).

        ``since`` is inclusive, ``until`` exclusive. ``decision`` matches the row's decision:
        ``accepted``/``rejected`` select decision rows, ``pending`` selects received rows.
        Raises ``InvalidRequest`` naming the bad argument.
        """
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}", field="limit")
        c = audit_log.c
        stmt = select(audit_log)
        if model is not None:
            stmt = stmt.where(c.model == model)
        if kind is not None:
            stmt = stmt.where(c.kind == kind)
        if actor is not None:
            stmt = stmt.where(c.actor == actor)
        if decision is not None:
            try:
                stmt = stmt.where(c.decision == Decision(decision).value)
            except ValueError as exc:
                raise InvalidRequest(
                    f"decision must be one of {[d.value for d in Decision]}", field="decision"
                ) from exc
        if since is not None:
            stmt = stmt.where(c.at >= _aware(since, "since"))
        if until is not None:
            stmt = stmt.where(c.at < _aware(until, "until"))
        if event_id is not None:
            stmt = stmt.where(c.event_id == _uuid(event_id))
        if cursor:
            stmt = stmt.where(c.id < decode_cursor(cursor))
        stmt = stmt.order_by(c.id.desc()).limit(limit + 1)
        rows = await self._fetch_rows("query", stmt)
        if len(rows) > limit:
            rows = rows[:limit]
            return rows, encode_cursor(rows[-1].id)
        return rows, None

    async def _fetch_rows(self, what: str, stmt: Select[Any]) -> list[AuditRow]:
        async with self._read(what) as conn:
            result = (await conn.execute(stmt)).all()
        return [row_from_db(r) for r in result]

    async def verify(self, *, batch: int = 1000, chain: Chain = Chain.AUDIT) -> VerifyResult:
        """Walk the chain from the first row: recompute each row hash and check the linkage.

        Reports the first row whose ``prev_hash`` is not its predecessor's ``row_hash`` (a row
        removed or inserted before it) or whose ``row_hash`` does not match its contents (the
        row was altered). Each batch read is bounded by ``timeout_s``. ``chain`` is
        ``Chain.AUDIT`` (``audit_log``) or ``Chain.ACKS`` (``router_acks``).
        """
        table = _CHAIN_TABLES[chain]
        batch = max(1, batch)
        checked, last_id, expected_prev = 0, 0, GENESIS_HASH
        prev_id: int | None = None
        while True:
            async with self._read("verify") as conn:
                result = (
                    await conn.execute(
                        select(table).where(table.c.id > last_id)
                        .order_by(table.c.id).limit(batch)
                    )
                ).all()
            if not result:
                break
            for raw in result:
                row_id = int(raw._mapping["id"])
                checked += 1
                try:
                    row: AuditRow | _AckChainRow = (
                        row_from_db(raw) if chain == Chain.AUDIT else _AckChainRow.from_db(raw))
                except (ValueError, TypeError, KeyError) as exc:
                    return VerifyResult(
                        ok=False, checked=checked, first_broken_id=row_id,
                        reason=f"row {row_id} is malformed: {exc}",
                    )
                if row.prev_hash != expected_prev:
                    after = "the genesis hash" if prev_id is None else f"row {prev_id}'s row_hash"
                    return VerifyResult(
                        ok=False, checked=checked, first_broken_id=row_id,
                        reason=f"row {row_id}: prev_hash does not match {after}",
                    )
                try:
                    recomputed = row.expected_hash()
                except (ValueError, TypeError) as exc:
                    recomputed = f"<unhashable: {exc}>"
                if row.row_hash != recomputed:
                    return VerifyResult(
                        ok=False, checked=checked, first_broken_id=row_id,
                        reason=f"row {row_id}: row_hash does not match the row's contents",
                    )
                expected_prev, prev_id = row.row_hash, row_id
            last_id = int(result[-1]._mapping["id"])
        return VerifyResult(
            ok=True, checked=checked, last_id=prev_id,
            last_hash=None if prev_id is None else expected_prev,
        )

    async def pending_received(self, *, older_than: datetime) -> list[AuditRow]:
        """``received`` rows written before ``older_than`` whose event has no decision row."""
        r, d = audit_log.alias("r"), audit_log.alias("d")
        decided = exists().where(
            d.c.stage == AuditStage.DECISION.value, d.c.event_id == r.c.event_id
        )
        stmt = (
            select(r)
            .where(
                r.c.stage == AuditStage.RECEIVED.value,
                r.c.event_id.is_not(None),
                r.c.at < _aware(older_than, "older_than"),
                ~decided,
            )
            .order_by(r.c.id)
        )
        return await self._fetch_rows("pending_received", stmt)

    async def decisions_for_event(self, event_id: uuid.UUID | str) -> list[AuditRow]:
        c = audit_log.c
        stmt = (
            select(audit_log)
            .where(c.stage == AuditStage.DECISION.value, c.event_id == _uuid(event_id))
            .order_by(c.id)
        )
        return await self._fetch_rows("decisions_for_event", stmt)

    async def accepted_decisions(self) -> list[AuditRow]:
        """Every accepted, non-dry-run decision that names a new revision, oldest first."""
        c = audit_log.c
        stmt = (
            select(audit_log)
            .where(
                c.stage == AuditStage.DECISION.value,
                c.decision == Decision.ACCEPTED.value,
                c.new_revision.is_not(None),
                c.dry_run.is_(False),
            )
            .order_by(c.id)
        )
        return await self._fetch_rows("accepted_decisions", stmt)

    async def row_hashes(self, chain: Chain, *, after_id: int = 0, through_id: int | None = None,
                         limit: int = MAX_LIMIT) -> list[tuple[int, str]]:
        """``(id, row_hash)`` of a chain's rows with ``after_id < id <= through_id``, ascending."""
        table = _CHAIN_TABLES[chain]
        stmt = select(table.c.id, table.c.row_hash).where(table.c.id > after_id)
        if through_id is not None:
            stmt = stmt.where(table.c.id <= through_id)
        stmt = stmt.order_by(table.c.id).limit(max(1, limit))
        async with self._read("row_hashes") as conn:
            result = (await conn.execute(stmt)).all()
        return [(int(r[0]), str(r[1])) for r in result]

    # -- router ACK/NACKs ----------------------------------------------------------------------

    async def record_ack(self, ack: ApplyAck, *, stream_seq: int | None = None) -> None:
        await self.record_acks([AckRecord(ack, stream_seq)])

    async def record_acks(self, records: Sequence[AckRecord]) -> int:
        """Store ACK/NACKs as consecutive rows of the ACK chain, in one transaction.

        A record whose ``stream_seq`` is stored already (a redelivery, or another control plane
        consuming the same stream) is skipped: the check runs under the chain's advisory lock,
        so two writers cannot both miss it, and a unique index backs it. Returns how many rows
        were written.
        """
        if not records:
            return 0
        async with self._db("record_acks"), self._engine.connect() as conn, conn.begin():
            await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ACK_CHAIN_LOCK_KEY})
            seqs = {r.stream_seq for r in records if r.stream_seq is not None}
            stored: set[int] = set()
            if seqs:
                stored = {int(s) for s in (await conn.execute(
                    select(router_acks.c.stream_seq).where(router_acks.c.stream_seq.in_(seqs))
                )).scalars()}
            last = (await conn.execute(
                select(router_acks.c.id, router_acks.c.row_hash)
                .order_by(router_acks.c.id.desc()).limit(1))).first()
            prev_id, prev_hash = (int(last[0]), str(last[1])) if last is not None else (0, GENESIS_HASH)
            rows: list[dict[str, Any]] = []
            for record in records:
                if record.stream_seq is not None:
                    if record.stream_seq in stored:
                        continue
                    stored.add(record.stream_seq)
                values = _ack_values(record.ack, id=prev_id + 1, stream_seq=record.stream_seq)
                values["prev_hash"] = prev_hash
                values["row_hash"] = compute_row_hash(prev_hash, ack_hashed_fields(values))
                rows.append(values)
                prev_id, prev_hash = prev_id + 1, values["row_hash"]
            if rows:
                await conn.execute(insert(router_acks), rows)
        self._committed(len(rows))
        return len(rows)

    async def privileged_role(self) -> str | None:
        """Why the role we connect as is more than the app role (superuser, or may act as the
        owner of ``audit_log``), or None. The control plane refuses to start as such a role."""
        async with self._read("role check") as conn:
            row = (await conn.execute(text(
                "SELECT current_user, r.rolsuper, pg_has_role(current_user, c.relowner, 'USAGE') "
                "FROM pg_roles r, pg_class c WHERE r.rolname = current_user "
                "AND c.oid = to_regclass('public.audit_log')"))).first()
        if row is None:
            return None
        user, superuser, owner = str(row[0]), bool(row[1]), bool(row[2])
        if superuser:
            return f"database role {user!r} is a superuser"
        if owner:
            return f"database role {user!r} owns audit_log (it could disable its trigger)"
        return None

    async def acks(
        self,
        *,
        router_id: str | None = None,
        model: str | None = None,
        kind: str | None = None,
        at: datetime | None = None,
        status: AckStatus | str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Router ACK/NACKs, newest first.

        With ``at``: the newest report per (router, model, kind) at or before ``at`` — "which
        revision did router X run at T" (pass ``status="ACK"`` to skip NACKs, which leave the
        router on its previous settings). Raises ``InvalidRequest`` for a bad limit or status.
        """
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}", field="limit")
        c = router_acks.c
        stmt = select(router_acks)
        if router_id is not None:
            stmt = stmt.where(c.router_id == router_id)
        if model is not None:
            stmt = stmt.where(c.model == model)
        if kind is not None:
            stmt = stmt.where(c.kind == kind)
        if status is not None:
            try:
                stmt = stmt.where(c.status == AckStatus(status).value)
            except ValueError as exc:
                raise InvalidRequest("status must be ACK or NACK", field="status") from exc
        if at is None:
            stmt = stmt.order_by(c.at.desc(), c.id.desc()).limit(limit)
        else:
            # The newest report per (router, model, kind) at or before ``at``.
            newest = func.row_number().over(
                partition_by=(c.router_id, c.model, c.kind), order_by=(c.at.desc(), c.id.desc())
            )
            ranked = stmt.add_columns(newest.label("rn")).where(c.at <= _aware(at, "at")).subquery()
            stmt = (
                select(*(ranked.c[col.name] for col in router_acks.c))
                .where(ranked.c.rn == 1)
                .order_by(ranked.c.router_id, ranked.c.model, ranked.c.kind)
                .limit(limit)
            )
        async with self._read("acks") as conn:
            result = (await conn.execute(stmt)).all()
        return [_ack_to_dict(r) for r in result]

    # -- lifecycle ---------------------------------------------------------------------------

    async def ping(self) -> None:
        """Raises ``AuditUnavailable`` unless PostgreSQL answers within ``timeout_s``."""
        async with self._read("ping") as conn:
            await conn.execute(text("SELECT 1"))

    async def close(self) -> None:
        """Write what is queued (bounded by ``timeout_s``), stop the writer, dispose the engine."""
        self._closed = True
        writer, queue = self._writer, self._queue
        if writer is not None and not writer.done() and queue is not None:
            queue.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(writer), self._timeout_s * 2)
            except TimeoutError:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
        self._writer = None
        if self._writer_conn is not None:
            with contextlib.suppress(Exception):
                await self._writer_conn.close()
            self._writer_conn = None
        if self._owns_engine:
            await self._engine.dispose()


def _ack_values(ack: ApplyAck, *, id: int, stream_seq: int | None) -> dict[str, Any]:
    return {
        "id": id, "stream_seq": stream_seq,
        "router_id": ack.router_id, "model": ack.model, "kind": str(ack.kind),
        "revision": ack.revision, "status": AckStatus(ack.status).value,
        "detail": ack.detail, "event_id": ack.event_id, "effective": dict(ack.effective),
        "at": (ack.at if ack.at.tzinfo is not None else ack.at.replace(tzinfo=UTC)).astimezone(UTC),
    }


@dataclass(frozen=True, slots=True)
class _AckChainRow:
    """A stored ACK row as the chain walk needs it."""

    id: int
    prev_hash: str
    row_hash: str
    fields: dict[str, Any]

    @classmethod
    def from_db(cls, raw: Row[Any]) -> _AckChainRow:
        m = raw._mapping
        return cls(id=int(m["id"]), prev_hash=str(m["prev_hash"]), row_hash=str(m["row_hash"]),
                   fields=ack_hashed_fields(dict(m)))

    def expected_hash(self) -> str:
        return compute_row_hash(self.prev_hash, self.fields)


@contextlib.asynccontextmanager
async def bounded(what: str, timeout_s: float) -> AsyncIterator[None]:
    """Bound a database block by ``timeout_s`` and translate every database error, once, here:
    the one place where asyncpg/SQLAlchemy/OS errors become ``AuditUnavailable``."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except DB_ERRORS as exc:
        raise AuditUnavailable(f"{what} unavailable: {_describe(exc)}") from exc


def make_engine(url: str, *, pool_size: int = 10, timeout_s: float = 2.0) -> AsyncEngine:
    """An asyncpg engine whose every wait is bounded by ``timeout_s``.

    ``pool_pre_ping`` replaces connections that died with a PostgreSQL restart; the server-side
    ``statement_timeout`` ends a statement (e.g. a lock wait) whose client already gave up.
    """
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=timeout_s,
        pool_pre_ping=True,
        connect_args={
            "timeout": timeout_s,
            "command_timeout": timeout_s,
            "server_settings": {
                "application_name": "rudder-controlplane",
                "statement_timeout": str(int(timeout_s * 1000)),
            },
        },
    )


def _aware(value: datetime, name: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidRequest(f"{name} must carry a timezone", field=name)
    return value.astimezone(UTC)


def _uuid(value: uuid.UUID | str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(value)
    except ValueError as exc:
        raise InvalidRequest("event_id is not a UUID", field="event_id") from exc
