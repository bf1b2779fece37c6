"""The audit store and its migrations against a real PostgreSQL (DESIGN §4)."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

import migrations
from cli.embedded import DatabaseAccess, EmbeddedPostgres
from controlplane.audit.records import GENESIS_HASH, AuditEntry, AuditRow, AuditStage, Decision
from controlplane.audit.store import AuditStore, Chain
from controlplane.audit.tables import metadata
from controlplane.protocol.errors import AuditUnavailable, InvalidRequest
from controlplane.protocol.events import AckStatus, ApplyAck
from controlplane.protocol.policy import PolicyKind
from tests.conftest import fresh_database

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def raw_url(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


@pytest.fixture
def another_database(postgres_server: EmbeddedPostgres | None) -> Callable[[], DatabaseAccess]:
    """Another empty database on the same server (for tests that break the chain on purpose)."""
    return lambda: fresh_database(postgres_server)


@pytest.fixture(scope="module")
async def db(database_url: str, database_owner_url: str) -> str:
    await migrations.upgrade_async(database_owner_url)
    return database_url


@pytest.fixture
async def store(db: str) -> AsyncIterator[AuditStore]:
    s = AuditStore.from_url(db)
    try:
        yield s
    finally:
        await s.close()


def received(event_id: uuid.UUID | None = None, **kw: Any) -> AuditEntry:
    return AuditEntry(event_id=event_id or uuid.uuid4(), stage=AuditStage.RECEIVED,
                      decision=Decision.PENDING, **kw)


def decided(event_id: uuid.UUID | None, decision: Decision = Decision.ACCEPTED,
            **kw: Any) -> AuditEntry:
    return AuditEntry(event_id=event_id, stage=AuditStage.DECISION, decision=decision, **kw)


def model_name() -> str:
    return f"org/model-{uuid.uuid4().hex[:8]}:v1"


# ---- migrations ---------------------------------------------------------------------------


async def test_migrations_apply_and_are_idempotent(db: str, database_owner_url: str) -> None:
    # Again from a coroutine (async and blocking flavours): nothing changes, nothing fails.
    await migrations.upgrade_async(database_owner_url)
    migrations.upgrade(database_owner_url)
    conn = await asyncpg.connect(raw_url(database_owner_url))
    try:
        assert await conn.fetchval("SELECT version_num FROM alembic_version") == \
            migrations.current_head()
        tables = {r["tablename"] for r in await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
        assert {"audit_log", "router_acks", "api_tokens", "alembic_version"} <= tables
        triggers = {r["tgname"] for r in await conn.fetch(
            "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")}
        assert {"audit_log_no_update_delete", "audit_log_no_truncate",
                "router_acks_no_update_delete", "router_acks_no_truncate"} <= triggers
    finally:
        await conn.close()


async def test_replicas_migrating_at_once_do_not_race(
        another_database: Callable[[], DatabaseAccess]) -> None:
    # Control-plane replicas that start together all run `db upgrade`: the advisory lock in the
    # Alembic environment makes them take turns, so none fails on CREATE TABLE.
    for separate_processes in (False, True):
        access = another_database()
        url = access.owner_url
        if separate_processes:
            procs = [
                await asyncio.create_subprocess_exec(
                    sys.executable, "-c", "import sys, migrations; migrations.upgrade(sys.argv[1])",
                    url, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
                    stderr=asyncio.subprocess.PIPE)
                for _ in range(3)
            ]
            for proc in procs:
                _, err = await proc.communicate()
                assert proc.returncode == 0, err.decode()
        else:
            await asyncio.gather(*(migrations.upgrade_async(url) for _ in range(4)))
        s = AuditStore.from_url(access.app_url)
        try:
            assert (await s.append(received())).id == 1
        finally:
            await s.close()


async def test_migrated_schema_matches_the_models(db: str, store: AuditStore) -> None:
    def diff(sync_conn: Any) -> list[Any]:
        ctx = MigrationContext.configure(sync_conn, opts={"compare_type": True})
        return list(compare_metadata(ctx, metadata))

    async with store.engine.connect() as conn:
        differences = await conn.run_sync(diff)
    # alembic_version is not ours to model; anything else is a drift between models and migration.
    assert [d for d in differences if "alembic_version" not in repr(d)] == []


async def test_0002_links_the_acks_stored_before_it_into_a_chain_the_store_verifies(
        another_database: Callable[[], DatabaseAccess]) -> None:
    # Rows written at 0001 (no hashes) are hashed by 0002's frozen copy of the chain hash; the
    # live store must verify them and go on chaining after them.
    access = another_database()
    await migrations.upgrade_async(access.owner_url, "0001")
    conn = await asyncpg.connect(raw_url(access.owner_url))
    try:
        for i, (event_id, effective) in enumerate([
            (uuid.uuid4(), '{"router_temperature": 0.5, "overlap_score_credit": 1.0}'),
            (None, "{}"),
            (uuid.uuid4(), '{"nested": {"b": [1, 2.5, null], "a": 1e20}, "x": "\u00fc"}'),
        ]):
            await conn.execute(
                "INSERT INTO router_acks (router_id, model, kind, revision, status, detail, "
                "event_id, effective, at) VALUES ($1, 'm', 'selection', $2, $3, $4, $5, $6::jsonb, $7)",
                f"r{i}", i + 1, "NACK" if i == 1 else "ACK", "bad" if i == 1 else "", event_id,
                effective, datetime(2026, 11, 30, 1, 2, 3, 456789 + i, tzinfo=UTC))
    finally:
        await conn.close()
    await migrations.upgrade_async(access.owner_url)
    s = AuditStore.from_url(access.app_url)
    try:
        result = await s.verify(chain=Chain.ACKS)
        assert result.ok and result.checked == 3, result
        await s.record_ack(ApplyAck(router_id="r", model="m", kind=PolicyKind.SELECTION,
                                    revision=4, status=AckStatus.ACK, at=datetime.now(UTC)))
        result = await s.verify(chain=Chain.ACKS)
        assert result.ok and result.checked == 4, result
    finally:
        await s.close()


async def test_upgrade_of_an_unreachable_database_is_audit_unavailable() -> None:
    url = "postgresql+asyncpg://postgres@127.0.0.1:1/nothing"
    with pytest.raises(AuditUnavailable) as info:
        await migrations.upgrade_async(url)
    assert info.value.__cause__ is not None


# ---- appends and the chain ----------------------------------------------------------------


async def test_append_links_the_chain(store: AuditStore) -> None:
    event_id = uuid.uuid4()
    first = await store.append(received(event_id, actor="alice", changes={"x": 1.5}))
    second = await store.append(decided(event_id, new_revision=7, after={"x": 1.5}))
    assert second.id == first.id + 1
    assert second.prev_hash == first.row_hash
    assert first.expected_hash() == first.row_hash and second.expected_hash() == second.row_hash
    stored = await store.get(first.id)
    assert stored == first and stored is not None and stored.row_hash == first.row_hash
    assert await store.get(10**12) is None
    result = await store.verify()
    assert result.ok and result.first_broken_id is None and result.checked >= 2


async def test_first_row_starts_from_genesis(another_database: Callable[[], DatabaseAccess]) -> None:
    access = another_database()
    await migrations.upgrade_async(access.owner_url)
    s = AuditStore.from_url(access.app_url)
    try:
        assert (await s.verify()).to_dict() == {
            "ok": True, "checked": 0, "first_broken_id": None, "reason": None}
        row = await s.append(received())
        assert row.id == 1 and row.prev_hash == GENESIS_HASH
    finally:
        await s.close()


async def test_append_many_is_contiguous_and_in_order(store: AuditStore) -> None:
    event_id = uuid.uuid4()
    entries = [received(event_id, actor=f"a{i}") for i in range(5)]
    others = asyncio.gather(*(store.append(received()) for _ in range(20)))
    rows = await store.append_many(entries)
    await others
    assert [r.actor for r in rows] == [f"a{i}" for i in range(5)]
    assert [r.id for r in rows] == list(range(rows[0].id, rows[0].id + 5))
    assert await store.append_many([]) == []


async def test_200_concurrent_appends_from_two_stores_form_one_chain(db: str) -> None:
    # Two engines = two connection pools, like two control-plane processes; one groups its
    # commits, the other inserts one transaction per append. The advisory lock orders both.
    a = AuditStore.from_url(db)
    b = AuditStore.from_url(db, group_commit=False)
    try:
        before = (await a.verify()).checked
        rows = await asyncio.gather(
            *((a if i % 2 else b).append(received(actor=f"c{i}")) for i in range(200))
        )
        ids = sorted(r.id for r in rows)
        assert len(set(ids)) == 200
        result = await b.verify()
        assert result.ok, result
        assert result.checked == before + 200
    finally:
        await a.close()
        await b.close()


APPENDER = """
import asyncio, sys, uuid
from controlplane.audit.records import AuditEntry, AuditStage, Decision
from controlplane.audit.store import AuditStore

async def main(url: str, n: int) -> None:
    store = AuditStore.from_url(url, timeout_s=10.0)
    try:
        await asyncio.gather(*(store.append(AuditEntry(
            event_id=uuid.uuid4(), stage=AuditStage.RECEIVED, decision=Decision.PENDING,
            actor="proc")) for _ in range(n)))
    finally:
        await store.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_appends_from_several_processes_form_one_chain(db: str) -> None:
    root = str(ROOT)
    env = {**os.environ, "PYTHONPATH": root}
    s = AuditStore.from_url(db)
    try:
        before = (await s.verify()).checked
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-c", APPENDER, db, "300", cwd=root, env=env,
                stderr=asyncio.subprocess.PIPE)
            for _ in range(2)
        ]
        ours: list[AuditRow] = []
        while any(p.returncode is None for p in procs):  # keep appending while they do
            ours += await asyncio.gather(*(s.append(received(actor="here")) for _ in range(10)))
            await asyncio.sleep(0.005)
        for proc in procs:
            _, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
        result = await s.verify()
        assert result.ok, result
        assert result.checked == before + 2 * 300 + len(ours)
        # The three writers really did interleave in the one chain.
        rows, _ = await s.query(limit=1000)
        actors = [r.actor for r in reversed(rows) if r.actor in ("here", "proc")]
        switches = sum(1 for x, y in itertools.pairwise(actors) if x != y)
        assert switches >= 2, actors
    finally:
        await s.close()


async def test_update_delete_and_truncate_are_refused(store: AuditStore, database_owner_url: str) -> None:
    # The trigger binds the table's owner too (only disabling it, which the owner may, lifts it).
    row = await store.append(received())
    await store.record_ack(ApplyAck(router_id="r", model="m", kind=PolicyKind.SELECTION,
                                    revision=1, status=AckStatus.ACK, at=datetime.now(UTC)))
    conn = await asyncpg.connect(raw_url(database_owner_url))
    try:
        for sql in (
            f"UPDATE audit_log SET actor = 'mallory' WHERE id = {row.id}",
            f"DELETE FROM audit_log WHERE id = {row.id}",
            "TRUNCATE audit_log",
            "UPDATE router_acks SET revision = 99",
            "DELETE FROM router_acks",
            "TRUNCATE router_acks",
        ):
            with pytest.raises(asyncpg.RaiseError) as info:
                await conn.execute(sql)
            err = info.value
            assert err.sqlstate == "P0001", sql
            table = "router_acks" if "router_acks" in sql else "audit_log"
            op = sql.split()[0]
            assert f"{table} is insert-only: {op} refused" in str(err), str(err)
    finally:
        await conn.close()
    assert await store.get(row.id) == row


async def _tampered_store(access: DatabaseAccess) -> tuple[AuditStore, list[int], asyncpg.Connection]:
    """Five rows written by the app role, and a connection as the owner (who can lift triggers)."""
    await migrations.upgrade_async(access.owner_url)
    s = AuditStore.from_url(access.app_url)
    rows = [await s.append(received(actor=f"u{i}", changes={"v": i / 10})) for i in range(5)]
    assert (await s.verify()).ok
    return s, [r.id for r in rows], await asyncpg.connect(raw_url(access.owner_url))


async def test_verify_names_a_row_altered_behind_the_trigger(another_database: Callable[[], DatabaseAccess]) -> None:
    s, ids, conn = await _tampered_store(another_database())
    try:
        # The owner can switch the trigger off; the hash chain still tells.
        await conn.execute("ALTER TABLE audit_log DISABLE TRIGGER ALL")
        await conn.execute(f"UPDATE audit_log SET actor = 'mallory' WHERE id = {ids[2]}")
        await conn.execute("ALTER TABLE audit_log ENABLE TRIGGER ALL")
        result = await s.verify(batch=2)
        assert not result.ok
        assert result.first_broken_id == ids[2]
        assert result.reason is not None and "row_hash" in result.reason
    finally:
        await conn.close()
        await s.close()


async def test_verify_names_the_row_after_a_deleted_one(another_database: Callable[[], DatabaseAccess]) -> None:
    s, ids, conn = await _tampered_store(another_database())
    try:
        await conn.execute("ALTER TABLE audit_log DISABLE TRIGGER ALL")
        await conn.execute(f"DELETE FROM audit_log WHERE id = {ids[1]}")
        await conn.execute("ALTER TABLE audit_log ENABLE TRIGGER ALL")
        result = await s.verify()
        assert not result.ok and result.first_broken_id == ids[2]
        assert result.reason is not None and "prev_hash" in result.reason
    finally:
        await conn.close()
        await s.close()


async def test_verify_names_a_row_with_a_rewritten_json_value(another_database: Callable[[], DatabaseAccess]) -> None:
    s, ids, conn = await _tampered_store(another_database())
    try:
        await conn.execute("ALTER TABLE audit_log DISABLE TRIGGER ALL")
        await conn.execute(
            f"""UPDATE audit_log SET changes = '{{"v": 0.31}}'::jsonb WHERE id = {ids[3]}""")
        await conn.execute("ALTER TABLE audit_log ENABLE TRIGGER ALL")
        result = await s.verify()
        assert not result.ok and result.first_broken_id == ids[3]
    finally:
        await conn.close()
        await s.close()


# ---- queries ------------------------------------------------------------------------------


async def test_query_filters_and_cursor_pagination(store: AuditStore) -> None:
    model, other = model_name(), model_name()
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    written = []
    for i in range(25):
        event_id = uuid.uuid4()
        at = t0 + timedelta(minutes=i)
        written.append(await store.append(received(
            event_id, model=model, kind="selection" if i % 2 else "busy_threshold",
            actor="alice" if i % 3 else "bob", at=at)))
        written.append(await store.append(decided(
            event_id, Decision.ACCEPTED if i % 4 else Decision.REJECTED, model=model,
            kind="selection" if i % 2 else "busy_threshold",
            actor="alice" if i % 3 else "bob", new_revision=i if i % 4 else None, at=at)))
    await store.append(received(model=other, actor="alice"))

    # Pages cover every row of the model exactly once, newest first.
    seen: list[int] = []
    cursor = None
    pages = 0
    while True:
        rows, cursor = await store.query(model=model, cursor=cursor, limit=7)
        seen += [r.id for r in rows]
        pages += 1
        if cursor is None:
            break
    assert seen == sorted((r.id for r in written), reverse=True)
    assert pages == 8  # 50 rows / 7 per page

    rows, _ = await store.query(model=model, kind="selection", actor="bob", limit=1000)
    expected = [r.id for r in written if r.kind == "selection" and r.actor == "bob"]
    assert [r.id for r in rows] == sorted(expected, reverse=True) and expected

    rows, _ = await store.query(model=model, decision="rejected", limit=1000)
    assert {r.id for r in rows} == {r.id for r in written if r.decision is Decision.REJECTED}
    assert all(r.stage is AuditStage.DECISION for r in rows)
    rows, _ = await store.query(model=model, decision=Decision.PENDING, limit=1000)
    assert {r.id for r in rows} == {r.id for r in written if r.stage is AuditStage.RECEIVED}

    since, until = t0 + timedelta(minutes=5), t0 + timedelta(minutes=10)
    rows, _ = await store.query(model=model, since=since, until=until, limit=1000)
    assert {r.id for r in rows} == {r.id for r in written if since <= r.at < until}
    assert len(rows) == 10

    target = written[6]
    rows, _ = await store.query(event_id=target.event_id)
    assert [r.id for r in rows] == [written[7].id, target.id]
    rows, _ = await store.query(event_id=str(target.event_id), decision="accepted")
    assert [r.id for r in rows] == [written[7].id]

    with pytest.raises(InvalidRequest) as info:
        await store.query(cursor="garbage!")
    assert info.value.field == "cursor"
    for bad_limit in (0, 1001):
        with pytest.raises(InvalidRequest) as info:
            await store.query(limit=bad_limit)
        assert info.value.field == "limit"
    with pytest.raises(InvalidRequest) as info:
        await store.query(decision="maybe")
    assert info.value.field == "decision"
    with pytest.raises(InvalidRequest) as info:
        await store.query(since=datetime(2026, 1, 1))
    assert info.value.field == "since"


async def test_pending_received_and_decisions(store: AuditStore) -> None:
    now = datetime.now(UTC)
    model = model_name()
    done, stuck, fresh, dry = (uuid.uuid4() for _ in range(4))
    await store.append(received(done, model=model, at=now - timedelta(minutes=2)))
    accepted = await store.append(decided(done, model=model, kind="selection", new_revision=5))
    await store.append(received(stuck, model=model, at=now - timedelta(minutes=2)))
    await store.append(received(fresh, model=model, at=now))
    await store.append(received(dry, model=model, at=now - timedelta(minutes=2)))
    dry_row = await store.append(decided(dry, model=model, new_revision=6, dry_run=True))
    rejected = await store.append(decided(uuid.uuid4(), Decision.REJECTED, model=model))

    pending = await store.pending_received(older_than=now - timedelta(minutes=1))
    ours = [r for r in pending if r.model == model]
    assert [r.event_id for r in ours] == [stuck]
    pending = await store.pending_received(older_than=now + timedelta(seconds=1))
    assert {r.event_id for r in pending if r.model == model} == {stuck, fresh}

    assert await store.decisions_for_event(done) == [accepted]
    assert await store.decisions_for_event(str(stuck)) == []
    # A manifest's decision (a revision of the manifest stream, no document kind) is not a
    # policy decision.
    manifest = await store.append(decided(None, model=model, new_revision=7, reason_code="manifest_issued"))
    ids = {r.id for r in await store.accepted_decisions()}
    assert accepted.id in ids and dry_row.id not in ids and rejected.id not in ids and manifest.id not in ids


async def test_acks_answer_which_revision_a_router_ran_at_a_time(store: AuditStore) -> None:
    model = model_name()
    t0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

    def ack(router: str, revision: int, minute: int, status: AckStatus = AckStatus.ACK,
            kind: PolicyKind = PolicyKind.SELECTION) -> ApplyAck:
        return ApplyAck(router_id=router, model=model, kind=kind, revision=revision,
                        status=status, detail="" if status is AckStatus.ACK else "lacks host",
                        event_id=uuid.uuid4(), effective={"overlap_score_credit": revision / 10},
                        at=t0 + timedelta(minutes=minute))

    for a in (ack("r1", 1, 0), ack("r1", 2, 10), ack("r1", 3, 20, AckStatus.NACK),
              ack("r2", 1, 5), ack("r2", 4, 30, kind=PolicyKind.BUSY_THRESHOLD)):
        await store.record_ack(a)

    at_15 = await store.acks(model=model, at=t0 + timedelta(minutes=15))
    assert [(a["router_id"], a["kind"], a["revision"]) for a in at_15] == \
        [("r1", "selection", 2), ("r2", "selection", 1)]
    assert at_15[0]["effective"] == {"overlap_score_credit": 0.2}
    assert at_15[0]["at"] == "2026-03-01T12:10:00.000000+00:00"

    at_25 = await store.acks(model=model, router_id="r1", at=t0 + timedelta(minutes=25))
    assert [(a["revision"], a["status"]) for a in at_25] == [(3, "NACK")]
    at_25 = await store.acks(model=model, router_id="r1", at=t0 + timedelta(minutes=25),
                             status="ACK")
    assert [(a["revision"], a["status"]) for a in at_25] == [(2, "ACK")]
    assert await store.acks(model=model, at=t0 - timedelta(minutes=1)) == []
    at_end = await store.acks(model=model, at=t0 + timedelta(hours=1), kind="busy_threshold")
    assert [(a["router_id"], a["revision"]) for a in at_end] == [("r2", 4)]

    history = await store.acks(model=model, router_id="r1")
    assert [a["revision"] for a in history] == [3, 2, 1]
    assert isinstance(history[0]["event_id"], str) and history[0]["detail"] == "lacks host"


# ---- failure and recovery -----------------------------------------------------------------


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "serialised"])
async def test_postgres_down_is_audit_unavailable_then_recovers(
    own_postgres: EmbeddedPostgres, group_commit: bool,
) -> None:
    url = own_postgres.url
    await migrations.upgrade_async(url)
    timeout_s = 1.0
    s = AuditStore.from_url(url, timeout_s=timeout_s, group_commit=group_commit)
    try:
        await s.append(received())
        await asyncio.to_thread(own_postgres.stop)
        for attempt in (
            lambda: s.append(received()),
            lambda: s.append_many([received(), received()]),
            s.ping,
            lambda: s.get(1),
            lambda: s.query(),
            s.verify,
            lambda: s.pending_received(older_than=datetime.now(UTC)),
            lambda: s.acks(),
        ):
            started = time.monotonic()
            with pytest.raises(AuditUnavailable) as info:
                await attempt()
            assert time.monotonic() - started < timeout_s + 0.5
            assert info.value.status_code == 503 and info.value.code == "audit_unavailable"
            assert info.value.__cause__ is not None  # translated once, with its cause
        # Every waiter of a failed (group) batch gets its own AuditUnavailable.
        results = await asyncio.gather(*(s.append(received()) for _ in range(10)),
                                       return_exceptions=True)
        assert all(isinstance(r, AuditUnavailable) for r in results), results
        await asyncio.to_thread(own_postgres.start)
        row = await s.append(received())  # same store, no restart of ours
        assert row.id == 2
        await s.ping()
        assert (await s.verify()).ok
    finally:
        await s.close()


async def test_a_hung_postgres_is_bounded_by_the_timeout(own_postgres: EmbeddedPostgres) -> None:
    """A server that accepts nothing (SIGSTOP) must not hang an append past ``timeout_s``."""
    import signal

    url = own_postgres.url
    await migrations.upgrade_async(url)
    s = AuditStore.from_url(url, timeout_s=0.5)
    pid_file = own_postgres.data_dir / "postmaster.pid"
    try:
        await s.append(received())
        postmaster = int(pid_file.read_text().splitlines()[0])
        # The postmaster and every backend it forked (ours included), so nothing answers.
        pids = [postmaster, *_children(postmaster)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(AuditUnavailable):
                await s.append(received())
            assert time.monotonic() - started < 1.5
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        row = await s.append(received())
        assert (await s.verify()).ok and row.id >= 2
    finally:
        await s.close()


def _children(parent: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            out.append(int(stat.parent.name))
    return out


async def test_closed_store_refuses_appends(db: str) -> None:
    s = AuditStore.from_url(db)
    await s.append(received())
    await s.close()
    with pytest.raises(AuditUnavailable):
        await s.append(received())


async def test_queued_appends_are_written_before_close(db: str) -> None:
    s = AuditStore.from_url(db)
    tasks = [asyncio.create_task(s.append(received(actor="late"))) for _ in range(20)]
    await asyncio.sleep(0)
    await s.close()
    rows = await asyncio.gather(*tasks)
    assert len({r.id for r in rows}) == 20
    check = AuditStore.from_url(db)
    try:
        assert (await check.verify()).ok
    finally:
        await check.close()


async def test_sql_level_session_is_read_committed(store: AuditStore) -> None:
    # The chain relies on the read after the advisory lock seeing the previous holder's commit.
    async with store.engine.connect() as conn:
        level = (await conn.execute(text("SHOW transaction_isolation"))).scalar_one()
    assert level == "read committed"
