"""The audit log chain: appends with group commit, queries and verification of ``audit_log``
(DESIGN §4; the chain itself is described in ``controlplane/audit/chain.py``).

Group commit
    With the chain lock held across a commit (one WAL flush), a plain serialised insert tops out
    at roughly one append per flush. So appends from one process go through one writer task
    (owned by a ``bus.tasks.Tasks``) that drains whatever is queued and writes it in a single
    transaction under the lock; each caller's future gets its own rows. ``append_many`` entries
    are never split across transactions. A failed batch fails every waiter in it with
    ``AuditUnavailable``. An entry whose caller gave up (timeout or cancellation) before its batch
    started is not written; one whose batch was already in flight may be written although its
    caller saw ``AuditUnavailable`` — the write path treats that like any commit whose answer was
    lost, and the reconciler resolves it. However the writer ends (stopped, cancelled, a bug), it
    fails the waiters still queued: none is left hanging.

Errors
    Every method raises ``AuditUnavailable`` when the database fails or does not answer within
    ``timeout_s`` (``controlplane/audit/db.py``); queries also raise ``InvalidRequest`` naming
    the bad argument.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import Row, Select, exists, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from bus.tasks import Tasks
from controlplane.audit.chain import VerifyResult, lock_head, row_hashes, verify_chain
from controlplane.audit.db import MAX_LIMIT, Db, aware, check_limit, unavailable
from controlplane.audit.records import (
    AuditEntry,
    AuditRow,
    AuditStage,
    Decision,
    compute_row_hash,
)
from controlplane.audit.tables import audit_log
from controlplane.protocol.errors import AuditUnavailable, InvalidRequest

log = logging.getLogger(__name__)

#: Advisory lock that serialises chain appends across processes ("RUDDAUDT").
CHAIN_LOCK_KEY = 0x52554444_41554454

_ENTRY_FIELDS = tuple(f.name for f in fields(AuditEntry))
_ROW_FIELDS = (*_ENTRY_FIELDS, "id", "prev_hash", "row_hash")


@dataclass(eq=False)
class _Pending:
    entries: list[AuditEntry]
    future: asyncio.Future[list[AuditRow]]


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
    if not 1 <= last_id <= 2**63 - 1:  # ids are BIGINT
        raise InvalidRequest("cursor is not one this server handed out", field="cursor")
    return last_id


def row_from_db(row: Row[Any] | Mapping[str, Any]) -> AuditRow:
    """An ``AuditRow`` from a database row. Raises ``ValueError`` if the row is malformed."""
    m = row._mapping if isinstance(row, Row) else row
    return AuditRow(**{name: m[name] for name in _ROW_FIELDS})


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


def _uuid(value: uuid.UUID | str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(value)
    except ValueError as exc:
        raise InvalidRequest("event_id is not a UUID", field="event_id") from exc


def _fail_queued(queue: asyncio.Queue[_Pending | None], cause: BaseException | None) -> None:
    while not queue.empty():
        item = queue.get_nowait()
        if item is not None and not item.future.done():
            item.future.set_exception(unavailable("audit writer stopped", cause))


class AuditChain:
    """The append-only, hash-chained ``audit_log`` (see the module docstring).

    ``on_commit`` is called with the number of rows after each commit.
    """

    def __init__(
        self, db: Db, *, group_commit: bool, max_batch: int, on_commit: Callable[[int], None]
    ) -> None:
        self._db = db
        self._group_commit = group_commit
        self._max_batch = max(1, max_batch)
        self._on_commit = on_commit
        self._tasks = Tasks("audit store")
        self._queue: asyncio.Queue[_Pending | None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._writer_conn: AsyncConnection | None = None
        self._closed = False

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
            self._on_commit(len(rows))
            return rows
        queue = self._ensure_writer()
        pending = _Pending(batch, asyncio.get_running_loop().create_future())
        queue.put_nowait(pending)
        try:
            async with asyncio.timeout(self._db.timeout_s):
                return await pending.future
        except TimeoutError as exc:
            raise AuditUnavailable(
                f"audit store unavailable (append): no commit within {self._db.timeout_s}s"
            ) from exc

    async def append_decision_once(self, entry: AuditEntry) -> AuditRow | None:
        """Record the decision ``entry`` unless its event has a decision row already; None then.
        The check runs under the chain's lock, in the insert's transaction: two reconcilers (one
        per control-plane replica, or a periodic pass and ``rudder audit reconcile``) settling the
        same pending event cannot both record a decision."""
        if self._closed:
            raise AuditUnavailable("audit store is closed")
        c = audit_log.c
        async with self._db.bounded("append"), self._db.engine.connect() as conn, conn.begin():
            last_id, last_hash = await lock_head(conn, audit_log, CHAIN_LOCK_KEY)
            decided = await conn.execute(select(c.id).where(
                c.stage == AuditStage.DECISION.value, c.event_id == entry.event_id).limit(1))
            if decided.first() is not None:
                return None
            [row] = chain_rows([entry], last_id=last_id, last_hash=last_hash)
            await conn.execute(insert(audit_log), [_params(row)])
        self._on_commit(1)
        return row

    async def _insert_chained(self, entries: list[AuditEntry]) -> list[AuditRow]:
        """One transaction on a pooled connection (the serialised mode)."""
        async with self._db.bounded("append"), self._db.engine.connect() as conn:
            return await self._chain_on(conn, entries)

    async def _chain_on(self, conn: AsyncConnection, entries: list[AuditEntry]) -> list[AuditRow]:
        """Lock the chain, read its head and insert ``entries`` after it, in one transaction."""
        async with conn.begin():
            last_id, last_hash = await lock_head(conn, audit_log, CHAIN_LOCK_KEY)
            rows = chain_rows(entries, last_id=last_id, last_hash=last_hash)
            await conn.execute(insert(audit_log), [_params(r) for r in rows])
        return rows

    async def _insert_with_writer_conn(self, entries: list[AuditEntry]) -> list[AuditRow]:
        """The group-commit writer keeps one connection for itself: no pool checkout, pre-ping or
        reset-on-return per batch. After any failure it is dropped, and the next batch opens a
        fresh one (so a PostgreSQL restart costs the batch that meets it, nothing more)."""
        try:
            async with self._db.bounded("append"):
                if self._writer_conn is None:
                    self._writer_conn = await self._db.engine.connect()
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
        if self._writer is not None and self._writer.get_loop() is not asyncio.get_running_loop():
            # Used from a new event loop: the old writer belongs to the old loop, as does its
            # task group; start afresh.
            self._tasks = Tasks("audit store")
        elif self._writer is not None and not self._writer.done():
            assert self._queue is not None
            return self._queue
        queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._queue = queue
        self._writer_conn = None  # a connection of a previous writer belongs to its event loop
        self._writer = self._tasks.spawn(self._run_writer(queue), name="audit-group-commit")
        return queue

    async def _run_writer(self, queue: asyncio.Queue[_Pending | None]) -> None:
        """Drain the queue: each round writes everything queued in one transaction. However it
        ends, the waiters still queued are failed with ``AuditUnavailable``."""
        cause: BaseException | None = None
        try:
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
        except Exception as exc:  # logged with its traceback by the task group
            cause = exc
            raise
        finally:
            _fail_queued(queue, cause)

    async def _write_batch(self, batch: list[_Pending]) -> None:
        live = [p for p in batch if not p.future.done()]  # skip callers that gave up
        if not live:
            return
        try:
            rows = await self._insert_with_writer_conn([e for p in live for e in p.entries])
        except AuditUnavailable as exc:
            for p in live:
                if not p.future.done():
                    p.future.set_exception(unavailable(exc.message, exc.__cause__))
            return
        except Exception as exc:  # a bug: log it and fail the batch, never kill the writer
            log.exception("audit batch of %d entries failed", sum(len(p.entries) for p in live))
            for p in live:
                if not p.future.done():
                    p.future.set_exception(unavailable(f"audit append failed: {exc!r}", exc))
            return
        self._on_commit(len(rows))
        offset = 0
        for p in live:
            n = len(p.entries)
            if not p.future.done():
                p.future.set_result(rows[offset:offset + n])
            offset += n

    # -- reads -------------------------------------------------------------------------------

    async def get(self, id: int) -> AuditRow | None:
        async with self._db.read("get") as conn:
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
        check_limit(limit)
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
            stmt = stmt.where(c.at >= aware(since, "since"))
        if until is not None:
            stmt = stmt.where(c.at < aware(until, "until"))
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
        async with self._db.read(what) as conn:
            result = (await conn.execute(stmt)).all()
        return [row_from_db(r) for r in result]

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
                r.c.at < aware(older_than, "older_than"),
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

    async def rows_for_event(self, event_id: uuid.UUID | str) -> list[AuditRow]:
        """Every row (received and decision) of one event, oldest first."""
        c = audit_log.c
        stmt = select(audit_log).where(c.event_id == _uuid(event_id)).order_by(c.id)
        return await self._fetch_rows("rows_for_event", stmt)

    async def last_accepted(self, model: str, kind: str, *, revision: int | None = None) -> AuditRow | None:
        """The newest accepted, non-dry-run decision of a document that names a new revision
        (that names ``revision``, if given): the last document the control plane wrote there
        (its ``after``)."""
        c = audit_log.c
        at = c.new_revision == revision if revision is not None else c.new_revision.is_not(None)
        stmt = (
            select(audit_log)
            .where(
                c.model == model, c.kind == kind, at,
                c.stage == AuditStage.DECISION.value,
                c.decision == Decision.ACCEPTED.value,
                c.new_revision.is_not(None),
                c.dry_run.is_(False),
            )
            .order_by(c.id.desc())
            .limit(1)
        )
        rows = await self._fetch_rows("last_accepted", stmt)
        return rows[0] if rows else None

    async def accepted_decisions(self) -> list[AuditRow]:
        """Every accepted, non-dry-run decision of a policy document that names a new revision,
        oldest first. (A worker manifest's decision names the manifest stream's revision and no
        document kind: it is not a policy decision, and reconcile must not look for its event.)"""
        c = audit_log.c
        stmt = (
            select(audit_log)
            .where(
                c.stage == AuditStage.DECISION.value,
                c.decision == Decision.ACCEPTED.value,
                c.new_revision.is_not(None),
                c.kind.is_not(None),
                c.dry_run.is_(False),
            )
            .order_by(c.id)
        )
        return await self._fetch_rows("accepted_decisions", stmt)

    # -- the chain ---------------------------------------------------------------------------

    async def verify(self, *, batch: int = 1000) -> VerifyResult:
        """Walk ``audit_log`` from its first row (``chain.verify_chain``)."""
        return await verify_chain(self._db, audit_log, row_from_db, batch=batch)

    async def row_hashes(self, *, after_id: int = 0, through_id: int | None = None,
                         limit: int = MAX_LIMIT) -> list[tuple[int, str]]:
        """``(id, row_hash)`` of rows with ``after_id < id <= through_id``, ascending."""
        return await row_hashes(self._db, audit_log, after_id=after_id, through_id=through_id,
                                limit=limit)

    # -- lifecycle ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Write what is queued (bounded by ``timeout_s``), then stop the writer; appends are
        refused from now on."""
        self._closed = True
        writer, queue = self._writer, self._queue
        if writer is not None and not writer.done() and queue is not None:
            queue.put_nowait(None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(writer), self._db.timeout_s * 2)
        await self._tasks.close()  # cancels a writer that did not finish in time
        self._writer = None
        if self._writer_conn is not None:
            with contextlib.suppress(Exception):
                await self._writer_conn.close()
            self._writer_conn = None
