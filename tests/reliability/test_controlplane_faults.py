"""Faults on the write path: PostgreSQL down, NATS down, a crash between publish and decision.
Servers are really stopped and restarted."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from bus.identities import Identity, IdentityKind
from cli.embedded import EmbeddedNats, EmbeddedPostgres
from controlplane.audit.store import AuditStore
from controlplane.failpoints import Failpoints
from controlplane.protocol.policy import PolicyKind
from migrations import upgrade_async
from tests import buskit
from tests.conftest import TEST_APP, TEST_OWNER
from tests.integration.cp_support import client, controlplane, make_tokens
from tests.policy_keys import session_keys

pytestmark = pytest.mark.timeout(180)


def model_name() -> str:
    return f"fault/model-{uuid.uuid4().hex[:8]}"


async def revisions(nats_url: str, model: str) -> list[int]:
    nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
    try:
        return [s.revision async for s in session_keys().policy_log(nc).history(model, PolicyKind.SELECTION)]
    finally:
        await nc.close()


async def test_postgres_down_means_503_and_nothing_published(nats_url: str, own_postgres: EmbeddedPostgres) -> None:
    access = own_postgres.provision("rudder", owner=TEST_OWNER, app=TEST_APP)
    db = access.app_url
    await upgrade_async(access.owner_url)
    tokens = await make_tokens(db)
    model = model_name()
    async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as http:
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                      "parameters": {"router_temperature": 0.1}})
        assert r.status_code == 200, r.text
        head = r.json()["revision"]
        await asyncio.to_thread(own_postgres.stop, mode="immediate")
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": head,
                                                      "parameters": {"router_temperature": 0.2}})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "audit_unavailable"
        assert "retry-after" in r.headers
        assert await revisions(nats_url, model) == [head]
        ready = await http.get("/readyz")
        assert ready.status_code == 503
        # An unauthenticated endpoint names the failed check, not the database's error text.
        assert ready.json()["checks"]["postgres"] == "unavailable"
        await asyncio.to_thread(own_postgres.start)
        for _ in range(50):
            r = await http.patch("/router_policy", json={"model": model, "expected_revision": head,
                                                          "parameters": {"router_temperature": 0.3}})
            if r.status_code != 503:
                break
            await asyncio.sleep(0.2)
        assert r.status_code == 200, r.text
        assert await revisions(nats_url, model) == [head, r.json()["revision"]]
        report = (await http.post("/audit/reconcile", headers={"Authorization": f"Bearer {tokens.admin}"})).json()
        assert report["ok"], report


async def test_nats_down_means_503_and_no_accepted_decision_without_event(
        own_nats: EmbeddedNats, database_url: str, database_owner_url: str) -> None:
    await upgrade_async(database_owner_url)
    tokens = await make_tokens(database_url)
    model = model_name()
    async with controlplane(own_nats.url, database_url) as cp, client(cp, tokens.operator) as http:
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                      "parameters": {"router_temperature": 0.1}})
        assert r.status_code == 200, r.text
        head = r.json()["revision"]
        own_nats.stop()
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": head,
                                                      "parameters": {"router_temperature": 0.2}})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] in ("log_unavailable", "log_ambiguous")
        own_nats.start()
        for _ in range(100):
            r = await http.patch("/router_policy", json={"model": model, "expected_revision": head,
                                                          "parameters": {"router_temperature": 0.3}})
            if r.status_code != 503:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 200, r.text
        new_head = r.json()["revision"]
        assert await revisions(own_nats.url, model) == [head, new_head]
        await cp.controlplane.reconciler.resolve_pending(grace=__import__("datetime").timedelta(0))
        report = await cp.controlplane.reconciler.check()
        assert report.ok, report
    store = AuditStore.from_url(database_url)
    try:
        accepted = [r for r in await store.accepted_decisions() if r.model == model]
        assert sorted(r.new_revision for r in accepted) == [head, new_head]
    finally:
        await store.close()


async def test_crash_between_publish_and_decision_is_reconciled(own_nats: EmbeddedNats,
                                                                own_postgres: EmbeddedPostgres) -> None:
    from datetime import timedelta

    nats_url = own_nats.url
    access = own_postgres.provision("rudder", owner=TEST_OWNER, app=TEST_APP)
    database_url = access.app_url
    await upgrade_async(access.owner_url)
    tokens = await make_tokens(database_url)
    model = model_name()
    failpoints = Failpoints()
    async with controlplane(nats_url, database_url, failpoints=failpoints) as cp, \
            client(cp, tokens.operator) as http:
        failpoints.arm("after_publish", times=1)
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                      "parameters": {"router_temperature": 0.4}})
        assert r.status_code == 500  # the simulated crash
        [revision] = await revisions(nats_url, model)
        recon = cp.controlplane.reconciler
        before = await recon.check(resolve=False)
        assert not before.ok
        assert [e["revision"] for e in before.events_without_decision] == [revision]
        assert await recon.resolve_pending(grace=timedelta(0)) == 1
        after = await recon.check()
        assert after.ok, after
        async with client(cp, tokens.auditor) as auditor:
            items = (await auditor.get("/audit", params={"model": model})).json()["items"]
        decision = next(i for i in items if i["stage"] == "decision")
        assert decision["decision"] == "accepted" and decision["new_revision"] == revision
        assert decision["reason_code"] == "reconciled" and decision["actor"] == "test-operator"
