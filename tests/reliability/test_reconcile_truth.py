"""B1: the reconciler never records as ``not_published`` an event it cannot rule out, and a
decision that cannot be written after a successful publish answers ``decision_unrecorded``.

The audit failure is real: a PostgreSQL trigger refuses the decision row of one model (as a full
disk would), after its "received" row was stored and its event published."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from bus.identities import Identity, IdentityKind
from controlplane.audit.records import AuditEntry, AuditStage, Decision
from controlplane.audit.store import AuditStore
from controlplane.protocol.events import AckStatus, ApplyAck
from controlplane.protocol.policy import PolicyKind
from controlplane.reconcile import Reconciler
from migrations import upgrade_async
from tests import buskit
from tests.integration.cp_support import client, controlplane, make_tokens
from tests.policy_keys import session_keys

pytestmark = pytest.mark.timeout(120)

HISTORY_DEPTH = 64  # RUDDER_HISTORY_DEPTH of the test streams


def raw_url(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


@dataclass
class RefusedDecisions:
    """A model whose accepted decision rows PostgreSQL refuses until :meth:`lift`."""

    model: str
    conn: asyncpg.Connection
    fn: str

    async def lift(self) -> None:
        await self.conn.execute(f"DROP TRIGGER IF EXISTS {self.fn} ON audit_log; "
                                f"DROP FUNCTION IF EXISTS {self.fn}();")


@pytest.fixture
async def refused(database_owner_url: str) -> AsyncIterator[RefusedDecisions]:
    await upgrade_async(database_owner_url)
    model = f"truth/model-{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(raw_url(database_owner_url))
    fn = f"refuse_{uuid.uuid4().hex[:8]}"
    await conn.execute(f"""
        CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.model = '{model}' AND NEW.stage = 'decision' AND NEW.decision = 'accepted' THEN
                RAISE EXCEPTION 'could not extend file: No space left on device';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER {fn} BEFORE INSERT ON audit_log FOR EACH ROW EXECUTE FUNCTION {fn}();
    """)
    refused = RefusedDecisions(model, conn, fn)
    try:
        yield refused
    finally:
        await refused.lift()
        await conn.close()


async def test_decision_write_failure_after_publish_is_decision_unrecorded_and_never_not_published(
        nats_url: str, database_url: str, refused: RefusedDecisions) -> None:
    model = refused.model
    tokens = await make_tokens(database_url)
    store = AuditStore.from_url(database_url)
    async with controlplane(nats_url, database_url, reconcile_grace_s=0.0) as cp, \
            client(cp, tokens.operator) as http:
        # Two writes published whose decisions PostgreSQL refuses: the change is live.
        lost: list[tuple[str, int]] = []
        head = 0
        for temp in (0.1, 0.2):
            r = await http.patch("/router_policy", json={"model": model, "expected_revision": head,
                                                          "parameters": {"router_temperature": temp}})
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "decision_unrecorded", error
            assert "retry-after" in r.headers
            head = error["new_revision"]
            lost.append((error["event_id"], head))
        await refused.lift()
        # A router ACKed the first one (the ACK table holds its event id); nobody saw the second.
        acked_id, acked_rev = lost[0]
        await store.record_ack(ApplyAck(router_id="router-truth", model=model, kind=PolicyKind.SELECTION,
                                        revision=acked_rev, status=AckStatus.ACK,
                                        event_id=uuid.UUID(acked_id), at=datetime.now(UTC)))
        # More newer revisions than the stream retains: both events drop out of its history.
        for i in range(HISTORY_DEPTH + 1):
            r = await http.patch("/router_policy", json={"model": model, "expected_revision": head,
                                                          "parameters": {"router_temperature": 0.3 + i / 1000}})
            assert r.status_code == 200, r.text
            head = r.json()["revision"]
        recon = cp.controlplane.reconciler
        undeterminable: list[dict[str, object]] = []
        assert await recon.resolve_pending(undeterminable=undeterminable) == 1
        assert [u["event_id"] for u in undeterminable] == [lost[1][0]]
        decided = {eid: await store.decisions_for_event(eid) for eid, _ in lost}
        [acked] = decided[acked_id]
        assert acked.decision == "accepted" and acked.new_revision == acked_rev
        assert acked.reason_code == "reconciled_from_acks"
        assert decided[lost[1][0]] == [], "an event that may be live must never be decided rejected"
        report = await recon.check()
        assert not report.ok
        assert [u["event_id"] for u in report.undeterminable] == [lost[1][0]]
        assert report.problems()["undeterminable"] == 1
        assert report.decisions_without_event == [] and report.retired >= 1
    await store.close()


async def test_an_event_the_stream_rules_out_is_still_not_published(
        nats_url: str, database_url: str, refused: RefusedDecisions) -> None:
    """Within the retained history, an unpublished event is still decided ``not_published``."""
    tokens = await make_tokens(database_url)
    async with controlplane(nats_url, database_url) as cp, client(cp, tokens.operator) as http:
        await refused.lift()
        r = await http.patch("/router_policy", json={"model": refused.model, "expected_revision": 0,
                                                      "parameters": {"router_temperature": 0.1}})
        assert r.status_code == 200, r.text
    store = AuditStore.from_url(database_url)
    try:
        # A "received" row whose publish never happened (a crash before step 6).
        rows, _ = await store.query(model=refused.model)
        [row] = [r for r in rows if r.stage == "decision"]
        ghost = uuid.uuid4()
        await store.append(AuditEntry(event_id=ghost, stage=AuditStage.RECEIVED, decision=Decision.PENDING,
                                      actor="t", roles=["operator"], model=refused.model, kind="selection",
                                      op="patch", expected_revision=row.new_revision,
                                      at=datetime.now(UTC) - timedelta(minutes=1)))
        nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
        try:
            recon = Reconciler(session_keys().policy_log(nc), store, grace_s=0.0)
            assert await recon.resolve_pending() >= 1
        finally:
            await nc.close()
        [decision] = await store.decisions_for_event(ghost)
        assert decision.decision == "rejected" and decision.reason_code == "not_published"
    finally:
        await store.close()


async def test_two_reconcilers_settling_the_same_rows_record_one_decision_each(
        nats_url: str, database_url: str, database_owner_url: str) -> None:
    """Found by the fleet harness: each control-plane replica runs a reconciler, and an operator
    may run ``rudder audit reconcile`` meanwhile; two of them settling the same pending rows
    recorded two (or three) decisions of one event, and reconcile then reported
    ``duplicate_decisions``."""
    await upgrade_async(database_owner_url)
    model = f"recon-race/{uuid.uuid4().hex[:6]}"
    stores = [AuditStore.from_url(database_url) for _ in range(2)]
    ghosts = [uuid.uuid4() for _ in range(20)]
    nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
    try:
        for ghost in ghosts:  # "received" rows whose publish never happened
            await stores[0].append(AuditEntry(
                event_id=ghost, stage=AuditStage.RECEIVED, decision=Decision.PENDING, actor="t",
                roles=["operator"], model=model, kind="selection", op="patch", expected_revision=0,
                at=datetime.now(UTC) - timedelta(minutes=1)))
        reconcilers = [Reconciler(session_keys().policy_log(nc), s, grace_s=0.0) for s in stores]
        resolved = await asyncio.gather(*(r.resolve_pending() for r in reconcilers))
        assert sum(resolved) == len(ghosts), resolved
        for ghost in ghosts:
            [decision] = await stores[0].decisions_for_event(ghost)
            assert decision.reason_code == "not_published"
    finally:
        await nc.close()
        for s in stores:
            await s.close()
