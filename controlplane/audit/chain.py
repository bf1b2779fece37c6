"""What the two hash chains (``audit_log`` and ``router_acks``) share: the append step under the
chain's lock, the walk that verifies a chain, and the listing of its row hashes (DESIGN §4).

Chain
    Each row's ``row_hash`` is ``compute_row_hash(prev_hash, its hashed fields)`` and its
    ``prev_hash`` is the previous row's ``row_hash`` (``GENESIS_HASH`` for the first). Every append
    runs one transaction that takes the chain's ``pg_advisory_xact_lock``, reads the newest row
    (``id``, ``row_hash``), hashes and inserts the new rows with ``id = last + 1`` and commits. The
    lock is held until commit, so appends from any number of control-plane processes form one
    chain; a unique index on ``prev_hash`` makes a fork impossible to store even for a writer that
    skipped the lock. The session must run at READ COMMITTED (the default): the read after the
    lock then sees the previous holder's commit.

Limits
    The chain proves that no stored row was altered, removed or inserted in the middle; it cannot
    by itself notice that the newest rows were removed, or a rewrite by someone who recomputed
    the hashes after it: the signed checkpoints on ``RUDDER_AUDIT_CHECKPOINTS``
    (``controlplane/checkpoints.py``) anchor it for that. The trigger that refuses UPDATE/DELETE
    binds the table owner too, but the owner can disable it: the control plane runs as a role
    with SELECT and INSERT only (``migrations/grants.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Row, Table, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from controlplane.audit.db import MAX_LIMIT, Db
from controlplane.audit.records import GENESIS_HASH


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


class ChainRow(Protocol):
    """A stored row as the chain walk needs it."""

    @property
    def prev_hash(self) -> str: ...

    @property
    def row_hash(self) -> str: ...

    def expected_hash(self) -> str:
        """The row hash recomputed from the row's fields and its stored ``prev_hash``."""
        ...


async def lock_head(conn: AsyncConnection, table: Table, lock_key: int) -> tuple[int, str]:
    """Take the chain's advisory lock (held until the transaction open on ``conn`` ends) and read
    the chain's head: ``(id, row_hash)`` of its newest row, ``(0, GENESIS_HASH)`` when empty.

    The head is read in a statement *after* the lock is granted: under READ COMMITTED each
    statement takes its snapshot when it starts, so a head read in the locking statement
    could predate a commit made while we waited, and fork the chain.
    """
    await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key})
    last = (
        await conn.execute(select(table.c.id, table.c.row_hash).order_by(table.c.id.desc()).limit(1))
    ).first()
    return (int(last[0]), str(last[1])) if last is not None else (0, GENESIS_HASH)


async def verify_chain(
    db: Db, table: Table, parse: Callable[[Row[Any]], ChainRow], *, batch: int
) -> VerifyResult:
    """Walk the chain in ``table`` from the first row: recompute each row hash and check the
    linkage. ``parse`` turns a database row into a ``ChainRow`` (``ValueError``, ``TypeError``
    or ``KeyError`` for a malformed one).

    Reports the first row whose ``prev_hash`` is not its predecessor's ``row_hash`` (a row
    removed or inserted before it) or whose ``row_hash`` does not match its contents (the
    row was altered). Each batch read is bounded by ``timeout_s``.
    """
    batch = max(1, batch)
    checked, last_id, expected_prev = 0, 0, GENESIS_HASH
    prev_id: int | None = None
    while True:
        async with db.read("verify") as conn:
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
                row = parse(raw)
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


async def row_hashes(db: Db, table: Table, *, after_id: int = 0, through_id: int | None = None,
                     limit: int = MAX_LIMIT) -> list[tuple[int, str]]:
    """``(id, row_hash)`` of the rows in ``table`` with ``after_id < id <= through_id``,
    ascending."""
    stmt = select(table.c.id, table.c.row_hash).where(table.c.id > after_id)
    if through_id is not None:
        stmt = stmt.where(table.c.id <= through_id)
    stmt = stmt.order_by(table.c.id).limit(max(1, limit))
    async with db.read("row_hashes") as conn:
        result = (await conn.execute(stmt)).all()
    return [(int(r[0]), str(r[1])) for r in result]
