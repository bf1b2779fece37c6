"""The audit store: the one object the control plane holds for the hash-chained audit log and the
router ACKs in PostgreSQL (DESIGN §4).

``AuditStore`` composes the two chains over one engine, each in its own module:

    controlplane/audit/db.py          engine, time bounds, the one translation of database
                                      errors into ``AuditUnavailable``
    controlplane/audit/chain.py       what both chains share: the append under the chain's
                                      advisory lock, the verifying walk, row hashes; the limits
                                      of a chain and what anchors it
    controlplane/audit/audit_chain.py ``audit_log``: appends with group commit, queries
    controlplane/audit/ack_chain.py   ``router_acks``: ACK/NACKs de-duplicated by stream sequence

Every method raises ``AuditUnavailable`` when the database fails or does not answer within
``timeout_s`` (``verify`` per batch); query methods also raise ``InvalidRequest`` for bad
arguments. This module also names what its methods take and return (``AckRecord``, ``Chain``,
``VerifyResult``), so a caller imports the store's vocabulary from one place.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from controlplane.audit.ack_chain import AckChain, AckRecord
from controlplane.audit.audit_chain import AuditChain
from controlplane.audit.chain import VerifyResult
from controlplane.audit.db import MAX_LIMIT, Db, make_engine
from controlplane.audit.records import AuditEntry, AuditRow, Decision
from controlplane.protocol.events import AckStatus, ApplyAck

__all__ = ["AckRecord", "AuditStore", "Chain", "VerifyResult"]


class Chain(enum.StrEnum):
    """Which hash chain: the audit log or the router ACKs."""

    AUDIT = "audit"
    ACKS = "acks"


class AuditStore:
    """Append-only, hash-chained audit log and router ACKs in PostgreSQL (see the module
    docstring): ``audit_log`` (an ``AuditChain``) and ``router_acks`` (an ``AckChain``) over one
    engine, which ``close()`` disposes when the store made it."""

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
        self._db = Db(engine, timeout_s)
        self._owns_engine = owns_engine
        self.audit_log = AuditChain(
            self._db, group_commit=group_commit, max_batch=max_batch, on_commit=self._committed)
        self.router_acks = AckChain(self._db, on_commit=self._committed)
        #: Called with the number of rows after each commit (the checkpointer counts them).
        self.on_rows: Callable[[int], None] | None = None
        #: Called with each append's duration in seconds and whether it was stored (metrics).
        self.on_append: Callable[[float, bool], None] | None = None

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
        return self._db.engine

    @property
    def timeout_s(self) -> float:
        return self._db.timeout_s

    def _chain(self, chain: Chain) -> AuditChain | AckChain:
        chains: dict[Chain, AuditChain | AckChain] = {
            Chain.AUDIT: self.audit_log, Chain.ACKS: self.router_acks}
        return chains[chain]

    # -- the audit log (AuditChain) ------------------------------------------------------------

    async def append(self, entry: AuditEntry) -> AuditRow:
        """Record ``entry``; returns it as stored (id, prev_hash, row_hash)."""
        if self.on_append is None:
            return await self.audit_log.append(entry)
        start = time.perf_counter()
        try:
            row = await self.audit_log.append(entry)
        except Exception:
            self.on_append(time.perf_counter() - start, False)
            raise
        self.on_append(time.perf_counter() - start, True)
        return row

    async def append_many(self, entries: Sequence[AuditEntry]) -> list[AuditRow]:
        """Record ``entries`` in order, in one transaction, as consecutive rows of the chain."""
        return await self.audit_log.append_many(entries)

    async def append_decision_once(self, entry: AuditEntry) -> AuditRow | None:
        """Record a decision unless its event has one already (``AuditChain.append_decision_once``)."""
        return await self.audit_log.append_decision_once(entry)

    async def get(self, id: int) -> AuditRow | None:
        return await self.audit_log.get(id)

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
        """Audit rows newest first, filtered; returns (rows, next cursor or None)
        (``AuditChain.query``)."""
        return await self.audit_log.query(
            model=model, kind=kind, actor=actor, decision=decision, since=since, until=until,
            event_id=event_id, cursor=cursor, limit=limit)

    async def pending_received(self, *, older_than: datetime) -> list[AuditRow]:
        """``received`` rows written before ``older_than`` whose event has no decision row."""
        return await self.audit_log.pending_received(older_than=older_than)

    async def decisions_for_event(self, event_id: uuid.UUID | str) -> list[AuditRow]:
        return await self.audit_log.decisions_for_event(event_id)

    async def rows_for_event(self, event_id: uuid.UUID | str) -> list[AuditRow]:
        return await self.audit_log.rows_for_event(event_id)

    async def last_accepted(self, model: str, kind: str) -> AuditRow | None:
        """The last document the control plane wrote for (model, kind): its accepted decision."""
        return await self.audit_log.last_accepted(model, kind)

    async def accepted_at(self, model: str, kind: str, revision: int) -> AuditRow | None:
        """The accepted decision that wrote ``revision`` of (model, kind), if any."""
        return await self.audit_log.last_accepted(model, kind, revision=revision)

    async def accepted_decisions(self) -> list[AuditRow]:
        """Every accepted, non-dry-run policy decision that names a new revision, oldest first."""
        return await self.audit_log.accepted_decisions()

    # -- router ACK/NACKs (AckChain) ---------------------------------------------------------

    async def record_ack(self, ack: ApplyAck, *, stream_seq: int | None = None) -> None:
        await self.router_acks.record_ack(ack, stream_seq=stream_seq)

    async def replay_nacks(self) -> list[dict[str, Any]]:
        """Revisions routers refused as replays (``AckChain.replay_nacks``)."""
        return await self.router_acks.replay_nacks()

    async def record_acks(self, records: Sequence[AckRecord]) -> int:
        """Store ACK/NACKs as consecutive rows of the ACK chain, skipping stream sequences
        stored already; returns how many rows were written (``AckChain.record_acks``)."""
        return await self.router_acks.record_acks(records)

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
        """Router ACK/NACKs, newest first; with ``at``, the newest per (router, model, kind) at
        or before ``at``; with ``event_id``, the reports of that event (``AckChain.acks``)."""
        return await self.router_acks.acks(
            router_id=router_id, model=model, kind=kind, at=at, status=status, event_id=event_id,
            limit=limit)

    # -- both chains ---------------------------------------------------------------------------

    async def verify(self, *, batch: int = 1000, chain: Chain = Chain.AUDIT) -> VerifyResult:
        """Walk ``chain`` from its first row: recompute each row hash and check the linkage
        (``chain.verify_chain``). ``chain`` is ``Chain.AUDIT`` (``audit_log``) or ``Chain.ACKS``
        (``router_acks``)."""
        return await self._chain(chain).verify(batch=batch)

    async def row_hashes(self, chain: Chain, *, after_id: int = 0, through_id: int | None = None,
                         limit: int = MAX_LIMIT) -> list[tuple[int, str]]:
        """``(id, row_hash)`` of a chain's rows with ``after_id < id <= through_id``, ascending."""
        return await self._chain(chain).row_hashes(
            after_id=after_id, through_id=through_id, limit=limit)

    # -- the database ------------------------------------------------------------------------

    async def privileged_role(self) -> str | None:
        """Why the role we connect as is more than the app role (superuser, or may act as the
        owner of ``audit_log``), or None. The control plane refuses to start as such a role."""
        async with self._db.read("role check") as conn:
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

    async def ping(self) -> None:
        """Raises ``AuditUnavailable`` unless PostgreSQL answers within ``timeout_s``."""
        async with self._db.read("ping") as conn:
            await conn.execute(text("SELECT 1"))

    async def close(self) -> None:
        """Write what is queued (bounded by ``timeout_s``), stop the writer, dispose the engine."""
        await self.audit_log.close()
        if self._owns_engine:
            await self._db.engine.dispose()
