"""The router ACK chain: ACK/NACKs consumed from ``RUDDER_ACKS``, stored in ``router_acks``
(DESIGN §4, issue 8).

``router_acks`` is chained the same way as ``audit_log`` (``controlplane/audit/chain.py``) under
its own lock (``ACK_CHAIN_LOCK_KEY``); its hashed fields are ``records.ACK_HASHED_FIELDS``. Rows
consumed from ``RUDDER_ACKS`` carry their stream sequence, unique, so one ACK is one row however
many control planes consume it or how often it is redelivered.

Every method raises ``AuditUnavailable`` when the database fails or does not answer within
``timeout_s`` (``controlplane/audit/db.py``); ``acks`` also raises ``InvalidRequest`` naming the
bad argument.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, func, insert, select

from controlplane.audit.chain import VerifyResult, lock_head, row_hashes, verify_chain
from controlplane.audit.db import MAX_LIMIT, Db, aware, check_limit
from controlplane.audit.records import ack_hashed_fields, compute_row_hash, format_time
from controlplane.audit.tables import router_acks
from controlplane.protocol.errors import InvalidRequest
from controlplane.protocol.events import AckStatus, ApplyAck

#: Advisory lock that serialises ACK chain appends across processes ("RUDDACKS").
ACK_CHAIN_LOCK_KEY = 0x52554444_41434B53


@dataclass(frozen=True, slots=True)
class AckRecord:
    """An ACK/NACK to store, with the ``RUDDER_ACKS`` sequence it arrived at (None: not from
    the stream, e.g. written by a test or an import)."""

    ack: ApplyAck
    stream_seq: int | None = None


def _ack_values(ack: ApplyAck, *, id: int, stream_seq: int | None) -> dict[str, Any]:
    return {
        "id": id, "stream_seq": stream_seq,
        "router_id": ack.router_id, "model": ack.model, "kind": str(ack.kind),
        "revision": ack.revision, "status": AckStatus(ack.status).value,
        "detail": ack.detail, "event_id": ack.event_id, "effective": dict(ack.effective),
        "at": (ack.at if ack.at.tzinfo is not None else ack.at.replace(tzinfo=UTC)).astimezone(UTC),
    }


def _ack_to_dict(row: Row[Any]) -> dict[str, Any]:
    m = row._mapping
    return {
        "id": m["id"], "router_id": m["router_id"], "model": m["model"], "kind": m["kind"],
        "revision": m["revision"], "status": m["status"], "detail": m["detail"],
        "event_id": None if m["event_id"] is None else str(m["event_id"]),
        "effective": dict(m["effective"] or {}), "at": format_time(m["at"]),
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


class AckChain:
    """The hash-chained ``router_acks`` (see the module docstring).

    ``on_commit`` is called with the number of rows after each commit.
    """

    def __init__(self, db: Db, *, on_commit: Callable[[int], None]) -> None:
        self._db = db
        self._on_commit = on_commit

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
        async with self._db.bounded("record_acks"), self._db.engine.connect() as conn, conn.begin():
            prev_id, prev_hash = await lock_head(conn, router_acks, ACK_CHAIN_LOCK_KEY)
            seqs = {r.stream_seq for r in records if r.stream_seq is not None}
            stored: set[int] = set()
            if seqs:
                stored = {int(s) for s in (await conn.execute(
                    select(router_acks.c.stream_seq).where(router_acks.c.stream_seq.in_(seqs))
                )).scalars()}
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
        self._on_commit(len(rows))
        return len(rows)

    async def acks(
        self,
        *,
        router_id: str | None = None,
        model: str | None = None,
        kind: str | None = None,
        at: datetime | None = None,
        status: AckStatus | str | None = None,
        event_id: uuid.UUID | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Router ACK/NACKs, newest first (with ``event_id``: the reports of that event only).

        With ``at``: the newest report per (router, model, kind) at or before ``at`` — "which
        revision did router X run at T" (pass ``status="ACK"`` to skip NACKs, which leave the
        router on its previous settings). Raises ``InvalidRequest`` for a bad limit or status.
        """
        check_limit(limit)
        c = router_acks.c
        stmt = select(router_acks)
        if router_id is not None:
            stmt = stmt.where(c.router_id == router_id)
        if model is not None:
            stmt = stmt.where(c.model == model)
        if kind is not None:
            stmt = stmt.where(c.kind == kind)
        if event_id is not None:
            stmt = stmt.where(c.event_id == event_id)
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
            ranked = stmt.add_columns(newest.label("rn")).where(c.at <= aware(at, "at")).subquery()
            stmt = (
                select(*(ranked.c[col.name] for col in router_acks.c))
                .where(ranked.c.rn == 1)
                .order_by(ranked.c.router_id, ranked.c.model, ranked.c.kind)
                .limit(limit)
            )
        async with self._db.read("acks") as conn:
            result = (await conn.execute(stmt)).all()
        return [_ack_to_dict(r) for r in result]

    async def replay_nacks(self, *, limit: int = MAX_LIMIT) -> list[dict[str, Any]]:
        """Every revision routers refused as a replay (NACK detail ``replayed: ...``), with the
        routers that did, oldest first: the record of a replay outlives the stream's history."""
        c = router_acks.c
        stmt = (
            select(c.model, c.kind, c.revision, func.array_agg(func.distinct(c.router_id)),
                   func.min(c.detail))
            .where(c.status == AckStatus.NACK.value, c.detail.like("replayed:%"))
            .group_by(c.model, c.kind, c.revision)
            .order_by(c.revision)
            .limit(limit)
        )
        async with self._db.read("replay_nacks") as conn:
            result = (await conn.execute(stmt)).all()
        return [{"model": m, "kind": k, "revision": rev, "routers": sorted(routers), "detail": detail}
                for m, k, rev, routers, detail in result]

    # -- the chain ---------------------------------------------------------------------------

    async def verify(self, *, batch: int = 1000) -> VerifyResult:
        """Walk ``router_acks`` from its first row (``chain.verify_chain``)."""
        return await verify_chain(self._db, router_acks, _AckChainRow.from_db, batch=batch)

    async def row_hashes(self, *, after_id: int = 0, through_id: int | None = None,
                         limit: int = MAX_LIMIT) -> list[tuple[int, str]]:
        """``(id, row_hash)`` of rows with ``after_id < id <= through_id``, ascending."""
        return await row_hashes(self._db, router_acks, after_id=after_id, through_id=through_id,
                                limit=limit)
