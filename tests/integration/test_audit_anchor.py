"""The audit log cannot be rewritten by the process that writes it, and what its owner rewrites
is found (issue 8, items 1 and 2), against real PostgreSQL and JetStream.

- The control plane's role cannot UPDATE, DELETE, TRUNCATE, ALTER or disable the triggers of the
  audit and ACK tables (nor switch triggers off for its session); the control plane refuses to
  start as the owner.
- Signed checkpoints reach RUDDER_AUDIT_CHECKPOINTS (deny delete and purge) after N rows and on a
  timer. The owner deleting the newest rows, or rewriting one with the trigger disabled and the
  chain recomputed (the chain alone then verifies!), is found by `rudder audit verify`, which
  names the row; `/audit/verify` returns the head it verified.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats
import nats.js.errors
import pytest

import migrations
from bus.client import Bus
from bus.identities import Identity, IdentityKind
from cli.embedded import DatabaseAccess, EmbeddedNats, EmbeddedPostgres
from controlplane.audit.audit_chain import chain_rows
from controlplane.audit.records import AuditEntry, AuditStage, Decision
from controlplane.audit.store import AuditStore, Chain
from controlplane.checkpoints import CheckpointLog
from controlplane.protocol.checkpoints import AuditCheckpoint, ChainSegment
from controlplane.protocol.events import AckStatus, ApplyAck
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.signing import Purpose, SigningKey
from controlplane.protocol.subjects import (
    AUDIT_CHECKPOINTS_SUBJECT,
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_KEY_ID,
    STREAM_AUDIT_CHECKPOINTS,
)
from controlplane.server import ControlPlane, Running
from tests import buskit
from tests.conftest import fresh_database
from tests.integration.cp_support import AUDIT_SIGNER, Tokens, controlplane, make_tokens, settings_for
from tests.support_router.workers import wait_for

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]


def raw(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


@pytest.fixture
async def access(postgres_server: EmbeddedPostgres | None) -> DatabaseAccess:
    """A migrated database of this test alone (its checkpoints go to this test's NATS)."""
    a = fresh_database(postgres_server)
    await migrations.upgrade_async(a.owner_url)
    return a


@pytest.fixture
async def owner(access: DatabaseAccess) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(raw(access.owner_url))
    yield conn
    await conn.close()


def entry(i: int) -> AuditEntry:
    return AuditEntry(event_id=uuid.uuid4(), stage=AuditStage.RECEIVED, decision=Decision.PENDING,
                      actor=f"alice-{i}", changes={"router_temperature": i / 10})


def ack(router_id: str, revision: int) -> ApplyAck:
    return ApplyAck(router_id=router_id, model="m", kind=PolicyKind.SELECTION, revision=revision,
                    status=AckStatus.ACK, at=datetime.now(UTC))


async def rudder_verify(running: Running, token: str, *args: str) -> tuple[int, dict[str, Any], str]:
    """`rudder --json audit verify` in its own process (the token in its environment)."""
    env = {**os.environ, "RUDDER_SERVER": running.url, "RUDDER_TOKEN": token,
           "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cli.main", "--json", "audit", "verify", *args, cwd=str(ROOT), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, json.loads(out or b"{}"), err.decode()


async def anchored(running: Running, *, audit_id: int, ack_id: int = 0) -> None:
    """Wait until the newest checkpoint covers the audit chain through ``audit_id`` (and ACKs)."""
    log = running.controlplane.checkpoints
    assert log is not None

    async def covered() -> bool:
        newest = await log.newest()
        return (newest is not None and newest.checkpoint is not None
                and newest.checkpoint.audit.last_id >= audit_id
                and newest.checkpoint.acks.last_id >= ack_id)

    await wait_for(covered, within=15)


# ---- the control plane's role ------------------------------------------------------------------

APP_ROLE_REFUSED = [
    "UPDATE {t} SET id = id",
    "DELETE FROM {t}",
    "TRUNCATE {t}",
    "ALTER TABLE {t} DISABLE TRIGGER ALL",
    "ALTER TABLE {t} DISABLE TRIGGER {t}_no_update_delete",
    "ALTER TABLE {t} ADD COLUMN mallory int",
    "ALTER TABLE {t} OWNER TO CURRENT_USER",
    "DROP TRIGGER {t}_no_truncate ON {t}",
    "DROP TABLE {t}",
    "SET session_replication_role = replica",  # would skip every trigger for the session
]


@pytest.mark.parametrize("table", ["audit_log", "router_acks"])
async def test_the_control_plane_role_cannot_alter_the_audit_tables(access: DatabaseAccess, table: str) -> None:
    store = AuditStore.from_url(access.app_url)
    await store.append(entry(0))
    await store.record_ack(ack("r1", 1))
    conn = await asyncpg.connect(raw(access.app_url))
    try:
        assert await conn.fetchval("SELECT current_user") == access.app.name
        for template in APP_ROLE_REFUSED:
            sql = template.format(t=table)
            with pytest.raises(asyncpg.InsufficientPrivilegeError) as info:
                await conn.execute(sql)
            assert info.value.sqlstate == "42501", sql
        # What it may do: read and append (through the store above), and create and revoke
        # tokens only through the audited functions (issue 17: no INSERT or UPDATE of its own).
        assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 1
        token_id = await conn.fetchval("SELECT rudder_token_create('t', 'viewer', $1, NULL)", uuid.uuid4().hex)
        assert await conn.fetchval("SELECT rudder_token_revoke($1)", token_id) is not None
        for sql in ("INSERT INTO api_tokens (name, role, token_hash) VALUES ('t', 'viewer', 'h')",
                    "UPDATE api_tokens SET revoked_at = now()", "UPDATE api_tokens SET role = 'admin'",
                    "DELETE FROM api_tokens"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
    finally:
        await conn.close()
        await store.close()
    assert (await AuditStore.from_url(access.app_url).verify()).ok


async def test_the_control_plane_refuses_to_run_as_the_owner(access: DatabaseAccess, own_nats: EmbeddedNats) -> None:
    cp = ControlPlane(settings_for(own_nats.url, access.owner_url, startup_timeout_s=2))
    try:
        with pytest.raises(RuntimeError, match="'rudder_owner' owns audit_log") as info:
            await cp.start()
        assert access.owner.password not in str(info.value)
    finally:
        await cp.stop()


# ---- checkpoints -------------------------------------------------------------------------------


async def test_checkpoints_after_n_rows_and_on_a_timer_to_a_stream_that_keeps_them(
        access: DatabaseAccess, own_nats: EmbeddedNats) -> None:
    async with controlplane(own_nats.url, access.app_url, audit_checkpoint_every_rows=5,
                            audit_checkpoint_interval_s=3600) as running:
        cp = running.controlplane
        rows = await cp.audit.append_many([entry(i) for i in range(5)])  # N rows: no timer needed
        await anchored(running, audit_id=rows[-1].id)
        assert cp.checkpointer is not None and cp.checkpointer.published == 1
    async with controlplane(own_nats.url, access.app_url, audit_checkpoint_every_rows=1000,
                            audit_checkpoint_interval_s=0.3) as running:
        row = await running.controlplane.audit.append(entry(9))  # one row: the timer takes it
        await anchored(running, audit_id=row.id)
        log = running.controlplane.checkpoints
        assert log is not None
        stored = [s async for s in log.all()]
    assert [s.problem for s in stored] == [None, None]
    assert stored[0].checkpoint is not None and stored[1].checkpoint is not None
    assert [i for i, _ in stored[0].checkpoint.audit.rows] == [r.id for r in rows]
    assert stored[1].checkpoint.audit.rows == [(row.id, row.row_hash)]  # continues, no overlap
    nc = await buskit.admin_connect(own_nats.url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM_AUDIT_CHECKPOINTS)
        assert info.config.deny_delete and info.config.deny_purge
        with pytest.raises(nats.js.errors.APIError):
            await js.delete_msg(STREAM_AUDIT_CHECKPOINTS, 1)
        with pytest.raises(nats.js.errors.APIError):
            await js.purge_stream(STREAM_AUDIT_CHECKPOINTS)
        assert (await js.stream_info(STREAM_AUDIT_CHECKPOINTS)).state.messages == 2
    finally:
        await nc.close()


async def test_owner_deleting_the_newest_rows_is_named_by_rudder_audit_verify(
        access: DatabaseAccess, owner: asyncpg.Connection, own_nats: EmbeddedNats) -> None:
    tokens = await make_tokens(access.app_url)
    async with controlplane(own_nats.url, access.app_url, audit_checkpoint_every_rows=10) as running:
        rows = await running.controlplane.audit.append_many([entry(i) for i in range(12)])
        await anchored(running, audit_id=rows[-1].id)
        code, body, _ = await rudder_verify(running, tokens.auditor)
        assert code == 0 and body["ok"] is True
        assert body["head"]["audit"] == {"last_id": rows[-1].id, "last_hash": rows[-1].row_hash}
        assert body["chains"]["audit"]["unanchored"] == 0

        await owner.execute("ALTER TABLE audit_log DISABLE TRIGGER audit_log_no_update_delete")
        await owner.execute("DELETE FROM audit_log WHERE id > $1", rows[-3].id)
        await owner.execute("ALTER TABLE audit_log ENABLE TRIGGER audit_log_no_update_delete")
        assert (await running.controlplane.audit.verify()).ok  # the chain alone cannot tell

        code, body, err = await rudder_verify(running, tokens.auditor)
    assert code == 1, (body, err)
    assert body["ok"] is False and body["chain"] == "audit"
    assert body["first_broken_id"] == rows[-2].id
    assert f"row {rows[-2].id} is gone" in body["reason"]
    assert f"row {rows[-2].id}" in err


async def test_a_head_kept_elsewhere_is_checked_with_expect(
        access: DatabaseAccess, owner: asyncpg.Connection, own_nats: EmbeddedNats) -> None:
    # Even without any checkpoint (say the bus itself was lost), a head the auditor kept tells.
    tokens = await make_tokens(access.app_url)
    async with controlplane(own_nats.url, access.app_url, audit_checkpoints=False) as running:
        rows = await running.controlplane.audit.append_many([entry(i) for i in range(3)])
        code, body, _ = await rudder_verify(running, tokens.auditor)
        assert code == 0 and body["checkpoint"] is None
        head = body["head"]["audit"]
        kept = f"{head['last_id']}:{head['last_hash']}"
        assert head["last_id"] == rows[-1].id
        code, _, _ = await rudder_verify(running, tokens.auditor, "--expect", kept)
        assert code == 0
        await owner.execute("ALTER TABLE audit_log DISABLE TRIGGER audit_log_no_update_delete")
        await owner.execute("DELETE FROM audit_log WHERE id = $1", rows[-1].id)
        await owner.execute("ALTER TABLE audit_log ENABLE TRIGGER audit_log_no_update_delete")
        code, body, err = await rudder_verify(running, tokens.auditor, "--expect", kept)
        bad_arg, _, usage = await rudder_verify(running, tokens.auditor, "--expect", "12:nothex")
    assert code == 1 and body["first_broken_id"] == rows[-1].id, body
    assert "kept with --expect" in err
    assert bad_arg == 2 and "--expect" in usage


async def _rewrite_and_recompute(owner: asyncpg.Connection, store: AuditStore, row_id: int) -> None:
    """What a careful owner does: change one row, then rehash it and every row after it."""
    head = (await store.query(limit=1))[0][0].id
    prev = await store.get(row_id - 1)
    originals = [r for r in [await store.get(i) for i in range(row_id, head + 1)] if r is not None]
    changed = [dataclasses.replace(originals[0], actor="mallory"), *originals[1:]]
    rechained = chain_rows(changed, last_id=row_id - 1,
                           last_hash=prev.row_hash if prev else "0" * 64)
    await owner.execute("ALTER TABLE audit_log DISABLE TRIGGER audit_log_no_update_delete")
    # prev_hash is unique: shift the old hashes out of the way first.
    await owner.execute("UPDATE audit_log SET prev_hash = 'x' || id WHERE id >= $1", row_id)
    for r in rechained:
        await owner.execute("UPDATE audit_log SET actor = $1, prev_hash = $2, row_hash = $3 WHERE id = $4",
                            r.actor, r.prev_hash, r.row_hash, r.id)
    await owner.execute("ALTER TABLE audit_log ENABLE TRIGGER audit_log_no_update_delete")


async def test_owner_rewriting_a_row_and_recomputing_the_chain_is_named(
        access: DatabaseAccess, owner: asyncpg.Connection, own_nats: EmbeddedNats) -> None:
    tokens: Tokens = await make_tokens(access.app_url)
    async with controlplane(own_nats.url, access.app_url, audit_checkpoint_every_rows=4) as running:
        store = running.controlplane.audit
        rows = await store.append_many([entry(i) for i in range(10)])
        await anchored(running, audit_id=rows[-1].id)
        target = rows[3].id
        await _rewrite_and_recompute(owner, store, target)
        assert (await store.verify()).ok  # recomputed: the chain by itself verifies
        assert (await store.get(target)).actor == "mallory"  # type: ignore[union-attr]
        code, body, err = await rudder_verify(running, tokens.auditor)
    assert code == 1, (body, err)
    assert body["first_broken_id"] == target and body["chain"] == "audit"
    assert "rewritten" in body["reason"] and f"row {target}" in err


async def test_owner_deleting_the_newest_ack_rows_is_named(
        access: DatabaseAccess, owner: asyncpg.Connection, own_nats: EmbeddedNats) -> None:
    tokens = await make_tokens(access.app_url)
    async with controlplane(own_nats.url, access.app_url, audit_checkpoint_every_rows=3) as running:
        store = running.controlplane.audit
        for i in range(4):
            await store.record_ack(ack("r1", i + 1))
        last_ack = (await store.row_hashes(Chain.ACKS))[-1][0]
        audit_head = (await store.query(limit=1))[0]
        await anchored(running, audit_id=audit_head[0].id if audit_head else 0, ack_id=last_ack)
        await owner.execute("ALTER TABLE router_acks DISABLE TRIGGER router_acks_no_update_delete")
        await owner.execute("DELETE FROM router_acks WHERE id = $1", last_ack)
        await owner.execute("ALTER TABLE router_acks ENABLE TRIGGER router_acks_no_update_delete")
        code, body, _ = await rudder_verify(running, tokens.auditor)
    assert code == 1 and body["chain"] == "acks" and body["first_broken_id"] == last_ack, body


async def test_a_checkpoint_not_signed_by_a_trusted_key_fails_verify(
        access: DatabaseAccess, own_nats: EmbeddedNats) -> None:
    tokens = await make_tokens(access.app_url)
    async with controlplane(own_nats.url, access.app_url, audit_checkpoint_interval_s=3600) as running:
        nc = await buskit.admin_connect(own_nats.url)
        try:
            forger = SigningKey.generate(Purpose.CHECKPOINT)
            log = CheckpointLog(Bus(nc), signer=forger)
            empty = ChainSegment(last_id=0, last_hash="0" * 64)
            for claimed in (AUDIT_SIGNER.key_id, forger.key_id):  # the trusted key id, then its own
                newest = await log.newest()
                payload = AuditCheckpoint(at=datetime.now(UTC), writer="forger", audit=empty, acks=empty).to_bytes()
                headers = {**forger.sign(AUDIT_CHECKPOINTS_SUBJECT, payload), HDR_KEY_ID: claimed,
                           HDR_EXPECTED_LAST_SUBJECT_SEQ: str(newest.seq if newest else 0)}
                await nc.jetstream().publish(AUDIT_CHECKPOINTS_SUBJECT, payload, headers=headers)
        finally:
            await nc.close()
        code, body, _ = await rudder_verify(running, tokens.auditor)
    assert code == 1 and body["ok"] is False
    problems = body["bad_checkpoints"]
    assert len(problems) == 2
    assert "does not verify" in problems[0] and "not trusted" in problems[1]
    assert AUDIT_CHECKPOINTS_SUBJECT  # the one subject they were published on


async def test_an_unsigned_checkpoint_is_reported_and_skipped_and_anchoring_goes_on(
        access: DatabaseAccess, own_nats: EmbeddedNats) -> None:
    """Issue 17 item 4: one message on the checkpoint subject (the control plane's NATS
    credential may publish there, its signing key is elsewhere) no longer stops anchoring."""
    tokens = await make_tokens(access.app_url)
    async with controlplane(own_nats.url, access.app_url, audit_checkpoint_every_rows=3,
                            audit_checkpoint_interval_s=3600) as running:
        cp = running.controlplane
        rows = await cp.audit.append_many([entry(i) for i in range(3)])
        await anchored(running, audit_id=rows[-1].id)
        log = cp.checkpoints
        assert log is not None and cp.checkpointer is not None
        thief = await buskit.connect_as(own_nats.url, Identity(IdentityKind.CONTROLPLANE))
        try:
            junk = []
            for payload in (b"not a checkpoint", AuditCheckpoint(
                    at=datetime.now(UTC), writer="thief", audit=ChainSegment(last_id=10**9, last_hash="f" * 64),
                    acks=ChainSegment(last_id=0, last_hash="0" * 64)).to_bytes()):
                newest = await log.newest()
                assert newest is not None
                ack = await thief.jetstream().publish(
                    AUDIT_CHECKPOINTS_SUBJECT, payload,
                    headers={HDR_EXPECTED_LAST_SUBJECT_SEQ: str(newest.seq)})
                junk.append(int(ack.seq))
        finally:
            await thief.close()
        more = await cp.audit.append_many([entry(i) for i in range(3, 6)])

        async def good_and_newest() -> bool:
            newest = await log.newest()
            return newest is not None and newest.problem is None and newest.seq > junk[-1]
        await wait_for(good_and_newest, within=15)
        newest = await log.newest()
        assert newest is not None
        assert newest.checkpoint is not None
        assert [i for i, _ in newest.checkpoint.audit.rows] == [r.id for r in more]  # continues
        assert set(junk) <= cp.checkpointer.skipped
        code, body, _ = await rudder_verify(running, tokens.auditor)
    assert code == 1 and len(body["bad_checkpoints"]) == 2  # the junk stays reported
    assert "is not signed" in body["bad_checkpoints"][0]


# ---- the grants migration ------------------------------------------------------------------------


async def test_grants_go_to_the_configured_role_and_the_owner_is_never_the_app_role(
        access: DatabaseAccess) -> None:
    from controlplane.protocol.errors import AuditUnavailable

    # The owner may not create roles here: a missing app role is a clear refusal, not a surprise.
    with pytest.raises(AuditUnavailable, match="'cp_other' does not exist and 'rudder_owner' may not create roles"):
        await migrations.upgrade_async(access.owner_url, app_role="cp_other")
    with pytest.raises(AuditUnavailable, match="the app role 'rudder_owner' is the role running the migration"):
        await migrations.upgrade_async(access.owner_url, app_role="rudder_owner")
    with pytest.raises(AuditUnavailable, match="must be a lower-case SQL identifier"):
        await migrations.upgrade_async(access.owner_url, app_role='x"; DROP TABLE audit_log; --')
    conn = await asyncpg.connect(raw(access.owner_url))
    try:
        privileges = {(r["table_name"], r["privilege_type"]) for r in await conn.fetch(
            "SELECT table_name, privilege_type FROM information_schema.role_table_grants "
            "WHERE grantee = $1", access.app.name)}
        columns = {(r["table_name"], r["column_name"], r["privilege_type"]) for r in await conn.fetch(
            "SELECT table_name, column_name, privilege_type FROM information_schema.column_privileges "
            "WHERE grantee = $1 AND privilege_type = 'UPDATE'", access.app.name)}
    finally:
        await conn.close()
    # Issue 17: tokens only through the audited functions (migration 0003).
    assert privileges == {(t, p) for t in ("audit_log", "router_acks") for p in ("SELECT", "INSERT")} | {
        ("api_tokens", "SELECT"), ("token_audit", "SELECT")}
    assert columns == set()
