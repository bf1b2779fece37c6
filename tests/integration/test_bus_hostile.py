"""Well-formed but hostile bus input is harmless (issue 7 item 3), against real NATS and PostgreSQL
with real routers, a real control plane and real workers (agent and mock engine, in process).

- a membership record that speaks for another worker's id, or names a URL outside the router's
  allow-list, never receives traffic;
- a join with ``dp_size`` 10^6 is refused and selections stay as they were;
- a naive timestamp (or a foreign key) in ``RUDDER_ROUTERS`` breaks nothing: PATCH and
  ``/router_policy`` still answer, the entry is flagged; a future stamp keeps no router alive;
- a malformed head on ``RUDDER_POLICY`` is NACKed by routers and replaced by an audited CAS write;
- a recreated ``RUDDER_POLICY`` stream makes a router re-sync and apply the later revisions.

Each forgery is published with the narrowest identity NATS lets publish it (a worker on its own
subject, a router on its own key and ACK subject): permissions pass it, these rules must not. What
no service may publish at all (a policy message, a stream deletion) uses the bus admin (``nc``).
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS

from bus.identities import Identity, IdentityKind
from bus.streams import BusLayout, ensure_all
from controlplane.protocol.events import (
    AckStatus,
    ApplyAck,
    MembershipEvent,
    MembershipOp,
    RouterStatus,
    doc_key,
)
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import (
    BUCKET_ROUTERS,
    STREAM_POLICY,
    acks_subject,
    membership_subject,
)
from tests import buskit
from tests.integration.cp_support import Tokens, client, controlplane
from tests.support_router.policy import publish_raw
from tests.support_router.workers import (
    InProcessRouter,
    MockWorker,
    router_settings,
    start_worker,
    wait_for,
    worker_settings,
)
from worker.settings import random_instance_id

pytestmark = pytest.mark.timeout(120)


def _drops(router: InProcessRouter, kind: str, reason: str) -> int:
    totals: dict[tuple[str, str], int] = router.runtime.drops.totals
    return totals.get((kind, reason), 0)


async def test_forged_membership_and_disallowed_url_never_receive_traffic(nats_url: str) -> None:
    model = f"forge/{uuid.uuid4().hex[:6]}"
    victim = await start_worker(nats_url, model)
    # Serves HTTP, never announces itself honestly.
    attacker = await MockWorker(worker_settings(nats_url, model)).serve_only()
    # Announces itself as http://localhost:<port>: reachable, but outside the allow-list below.
    outside = await start_worker(nats_url, model, advertise_host="localhost")
    assert outside.url.startswith("http://localhost:")
    router = await InProcessRouter(router_settings(
        nats_url, model, mode="round_robin", worker_url_allow="127.0.0.1/32",
    )).start()
    sched = router.runtime.scheduler
    try:
        await wait_for(lambda: sched.view.workers.get(model) == 1)
        await wait_for(lambda: _drops(router, "membership", "url_not_allowed") >= 1)
        # On its own subject (all its credentials allow), the attacker speaks for the victim's id
        # with its own URL.
        forged = victim.record.model_copy(update={"url": attacker.url})
        attacker_nc = await buskit.connect_as(nats_url, Identity(
            IdentityKind.WORKER, model=model, instance_id=attacker.instance_id))
        try:
            js = attacker_nc.jetstream()
            for op in (MembershipOp.JOIN, MembershipOp.HEARTBEAT):
                event = MembershipEvent(op=op, worker=forged, load=victim.load(), at=datetime.now(UTC))
                await js.publish(membership_subject(model, attacker.instance_id), event.to_bytes())
        finally:
            await attacker_nc.close()
        await wait_for(lambda: _drops(router, "membership", "subject_mismatch") >= 2)

        async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
            for i in range(12):
                body: dict[str, Any] = {"model": model, "prompt": f"hello {i}"}
                if i % 3 == 0:
                    body["nvext"] = {"backend_instance_id": victim.instance_id}
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert int(r.headers["x-worker-instance-id"]) == victim.instance_id
            # The worker outside the allow-list is not in the snapshot at all: a pin names no worker.
            r = await http.post("/v1/completions", json={
                "model": model, "prompt": "x", "nvext": {"backend_instance_id": outside.instance_id}})
            assert r.status_code == 400, r.text
            assert f"{outside.instance_id} does not identify a known worker" in r.json()["error"]["message"]
            metrics = (await http.get("/metrics")).text
        assert len(victim.requests) == 12
        assert attacker.requests == [] and outside.requests == []
        urls = await sched.inspect(lambda s: {slot.url for slot in s._slots[model].values()})
        assert urls == {victim.url}
        assert await sched.inspect(lambda s: s.discovery.get(outside.instance_id)) is None
        assert 'rudder_router_bus_dropped_total{kind="membership",reason="subject_mismatch"}' in metrics
        assert 'rudder_router_bus_dropped_total{kind="membership",reason="url_not_allowed"}' in metrics
    finally:
        await router.stop()
        await outside.stop()
        await attacker.stop()
        await victim.stop()


async def test_join_with_a_million_ranks_is_refused_without_slowing_selections(nats_url: str) -> None:
    model = f"wide/{uuid.uuid4().hex[:6]}"
    worker = await start_worker(nats_url, model)
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    sched = router.runtime.scheduler
    try:
        await wait_for(lambda: sched.view.workers.get(model) == 1)
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:

            async def timed_selections(n: int) -> float:
                start = time.perf_counter()
                for i in range(n):
                    r = await http.post("/v1/completions", json={"model": model, "prompt": f"p{i}"})
                    assert r.status_code == 200, r.text
                return time.perf_counter() - start

            before = await timed_selections(20)
            # A join on its own subject, ids consistent, URL allowed: only dp_size is hostile.
            hostile = worker.record.model_copy(update={"instance_id": random_instance_id()})
            payload = json.loads(MembershipEvent(op=MembershipOp.JOIN, worker=hostile,
                                                 at=datetime.now(UTC)).to_bytes())
            payload["worker"]["dp_size"] = 10**6
            hostile_nc = await buskit.connect_as(nats_url, Identity(
                IdentityKind.WORKER, model=model, instance_id=hostile.instance_id))
            try:
                await hostile_nc.jetstream().publish(membership_subject(model, hostile.instance_id),
                                                     json.dumps(payload).encode())
            finally:
                await hostile_nc.close()
            await wait_for(lambda: _drops(router, "membership", "malformed") >= 1)
            after = await timed_selections(20)
        # Refused: no slot was made for it, a selection still scans one rank.
        assert await sched.inspect(lambda s: len(s._slots[model])) == 1
        assert await sched.inspect(lambda s: s.discovery.get(hostile.instance_id)) is None
        assert sched.view.workers[model] == 1
        # (A million slots would cost each selection far more than the whole 20 took before.)
        assert after < max(5 * before, 2.0), (before, after)
    finally:
        await router.stop()
        await worker.stop()


async def test_naive_timestamp_in_router_status_breaks_nothing(nats_url: str, db: str, tokens: Tokens,
                                                               nc: NATS) -> None:
    model = f"naive/{uuid.uuid4().hex[:6]}"
    heartbeat_s = 0.2
    async with controlplane(nats_url, db, router_heartbeat_s=heartbeat_s) as cp, \
            client(cp, tokens.operator) as op, client(cp, tokens.auditor) as auditor:
        fleet = cp.controlplane.fleet
        now = datetime.now(UTC)
        good = json.loads(RouterStatus(router_id="r-naive", models=[model], started_at=now,
                                       heartbeat_at=now).to_bytes())
        naive = dict(good, heartbeat_at=now.replace(tzinfo=None).isoformat())
        # Each router writes only its own key: a naive stamp, another router's id under its own
        # key, and a stamp a year ahead.
        await _put_own_status("r-naive", json.dumps(naive).encode(), nats_url)
        await _put_own_status("r-other", RouterStatus(router_id="r-victim", models=[model], started_at=now,
                                                      heartbeat_at=now).to_bytes(), nats_url)
        await _put_own_status("r-future", RouterStatus(
            router_id="r-future", models=[model], started_at=now,
            heartbeat_at=now + timedelta(days=365)).to_bytes(), nats_url)
        await wait_for(lambda: {"r-naive", "r-other"} <= set(fleet.bad_routers))
        assert "heartbeat_at" in fleet.bad_routers["r-naive"]

        r = await op.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                    "parameters": {"router_temperature": 0.3}})
        assert r.status_code == 200, r.text
        rev = r.json()["revision"]
        r = await op.get("/router_policy", params={"model": model})
        assert r.status_code == 200, r.text
        assert (await op.get("/router_policy")).status_code == 200
        listing = (await op.get("/routers")).json()
        rejected = {x["key"]: x["reason"] for x in listing["rejected"]}
        assert {"r-naive", "r-other"} <= set(rejected) and "r-victim" in rejected["r-other"]
        assert "r-victim" not in {x["router_id"] for x in listing["routers"]}
        # The future stamp is not trusted: the router is live only as long as the bus says.
        assert [x.router_id for x in fleet.live_routers(model)] == ["r-future"]
        await wait_for(lambda: not fleet.live_routers(model), within=5 * 3 * heartbeat_s + 2)
        metrics = (await op.get("/metrics")).text
        assert 'rudder_controlplane_bus_dropped_total{kind="router_status",reason="malformed"}' in metrics
        assert 'rudder_controlplane_bus_dropped_total{kind="router_status",reason="subject_mismatch"}' in metrics

        # An ACK published on one router's subject naming another router is not recorded.
        forged = ApplyAck(router_id="r-victim", model=model, kind=PolicyKind.SELECTION, revision=rev,
                          status=AckStatus.NACK, detail="forged", at=datetime.now(UTC))
        honest = forged.model_copy(update={"router_id": "r-honest", "detail": "honest"})
        router_nc = await buskit.connect_as(nats_url, Identity(IdentityKind.ROUTER, router_id="r-honest"))
        try:
            for ack in (forged, honest):  # as a router publishes them (the ACK stream keeps them)
                await router_nc.publish(acks_subject("r-honest"), ack.to_bytes())
            await router_nc.flush()
        finally:
            await router_nc.close()

        async def recorded() -> list[dict[str, Any]]:
            acks: list[dict[str, Any]] = (await auditor.get("/routers/acks", params={"model": model})).json()["acks"]
            return acks

        await wait_for(lambda: _has(recorded(), "r-honest"))
        assert {a["router_id"] for a in await recorded()} == {"r-honest"}
        assert fleet.drops.totals[("ack", "subject_mismatch")] == 1
        kv = await nc.jetstream().key_value(BUCKET_ROUTERS)
        for key in ("r-naive", "r-other", "r-future"):
            await kv.delete(key)


async def _put_own_status(router_id: str, value: bytes, nats_url: str) -> None:
    router_nc = await buskit.connect_as(nats_url, Identity(IdentityKind.ROUTER, router_id=router_id))
    try:
        kv = await router_nc.jetstream().key_value(BUCKET_ROUTERS)
        await kv.put(router_id, value)
    finally:
        await router_nc.close()


async def _has(acks: Any, router_id: str) -> bool:
    return any(a["router_id"] == router_id for a in await acks)


async def test_malformed_head_is_nacked_and_replaced_by_an_audited_cas_write(
        nats_url: str, db: str, tokens: Tokens, nc: NATS) -> None:
    model = f"jam/{uuid.uuid4().hex[:6]}"
    router = await InProcessRouter(router_settings(nats_url, model, mode="round_robin")).start()
    sched = router.runtime.scheduler
    key = doc_key(model, PolicyKind.SELECTION)
    try:
        async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as op, \
                client(cp, tokens.auditor) as auditor:
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                        "parameters": {"router_temperature": 0.25}})
            assert r.status_code == 200, r.text
            good = r.json()["revision"]
            await wait_for(lambda: sched.view.applied[key].revision == good)
            # A well-placed (CAS-correct, even validly signed: a control-plane bug) message that is
            # no event.
            bad = await publish_raw(nc.jetstream(), model, b'{"schema_version": 1, "document": "oops"}',
                                    expected_revision=good)
            await wait_for(lambda: sched.view.applied[key].last_nack_revision == bad)
            applied = sched.view.applied[key]
            assert "malformed" in str(applied.last_nack)
            assert applied.revision == good and applied.effective["router_temperature"] == 0.25

            # Building on it is refused (409, saying how to replace it); so is a stale revision.
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": good,
                                                        "parameters": {"router_temperature": 0.5}})
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["head_revision"] == bad and err["malformed_head"] is True
            assert f"expected_revision is {bad}" in err["message"]
            # Naming the malformed head's revision replaces it: CAS-checked, audited.
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": bad,
                                                        "parameters": {"router_temperature": 0.5}})
            assert r.status_code == 200, r.text
            fixed = r.json()
            assert fixed["previous_revision"] == bad and fixed["document"] == {"router_temperature": 0.5}
            await wait_for(lambda: sched.view.applied[key].revision == fixed["revision"])
            assert sched.view.applied[key].effective["router_temperature"] == 0.5
            items = (await auditor.get("/audit", params={"model": model})).json()["items"]
            decision = next(i for i in items if i["event_id"] == fixed["event_id"] and i["stage"] == "decision")
            assert decision["decision"] == "accepted"
            assert decision["reason_code"] == "replaced_malformed_head"
            assert decision["head_revision"] == bad and decision["expected_revision"] == bad
            assert decision["new_revision"] == fixed["revision"]
            assert any(i["reason_code"] == "revision_conflict" and i["head_revision"] == bad for i in items)
            # The document is unjammed: the next ordinary write builds on the replacement.
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": fixed["revision"],
                                                        "parameters": {"router_temperature": 0.6}})
            assert r.status_code == 200 and r.json()["document"] == {"router_temperature": 0.6}, r.text

            # The compatible threshold API: without expected_revision it never builds on a
            # malformed head (409 at once, no retry loop); naming the revision replaces it.
            bad_threshold = await publish_raw(nc.jetstream(), model, b"not json", expected_revision=0,
                                              kind="busy_threshold")
            r = await op.post("/busy_threshold", json={"model": model, "active_decode_blocks_threshold": 0.9})
            assert r.status_code == 409 and r.json()["error"]["malformed_head"] is True, r.text
            r = await op.post("/busy_threshold", json={"model": model, "active_decode_blocks_threshold": 0.9,
                                                        "expected_revision": bad_threshold})
            assert r.status_code == 200, r.text
            assert r.json()["thresholds"] == {"active_decode_blocks_threshold": 0.9}
            refusals = [i for i in (await auditor.get("/audit", params={"model": model, "kind": "busy_threshold"}))
                        .json()["items"] if i["reason_code"] == "revision_conflict"]
            assert len(refusals) == 1  # one refusal recorded, not one per retry
    finally:
        await router.stop()


async def test_recreated_policy_stream_makes_a_router_resync_and_apply_later_revisions(
        nats_url: str, db: str, tokens: Tokens, nc: NATS) -> None:
    model = f"recreate/{uuid.uuid4().hex[:6]}"
    router = await InProcessRouter(router_settings(nats_url, model, mode="round_robin")).start()
    sched = router.runtime.scheduler
    key = doc_key(model, PolicyKind.SELECTION)
    try:
        async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as op:
            rev = 0
            for t in (0.1, 0.2, 0.3, 0.4):
                r = await op.patch("/router_policy", json={"model": model, "expected_revision": rev,
                                                            "parameters": {"router_temperature": t}})
                assert r.status_code == 200, r.text
                rev = r.json()["revision"]
            await wait_for(lambda: sched.view.applied[key].revision == rev)
            assert rev >= 4
            # An operator deletes and re-creates the stream: its sequence starts again at 1.
            js = nc.jetstream()
            await js.delete_stream(STREAM_POLICY)
            await ensure_all(js, BusLayout())  # as `rudder bus init` does
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                        "parameters": {"router_temperature": 0.9}})
            assert r.status_code == 200, r.text
            first = r.json()["revision"]
            assert first < rev  # the sequence went backwards
            await wait_for(lambda: sched.view.applied[key].revision == first, within=15)
            assert sched.view.applied[key].effective["router_temperature"] == 0.9
            assert router.runtime.policy.resyncs == 1
            status = router.runtime.status.status()
            assert status.policy_resync is not None and status.policy_resync.count == 1
            assert "created again" in status.policy_resync.reason
            # Later revisions are applied too (not skipped as "already seen").
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": first,
                                                        "parameters": {"router_temperature": 0.8}})
            assert r.status_code == 200, r.text
            second = r.json()["revision"]
            await wait_for(lambda: sched.view.applied[key].revision == second)
            assert sched.view.applied[key].effective["router_temperature"] == 0.8
            assert router.runtime.policy.resyncs == 1  # once, not on every check
            async with httpx.AsyncClient(base_url=router.url) as http:
                metrics = (await http.get("/metrics")).text
            assert "rudder_router_policy_resyncs_total 1.0" in metrics
            # The control plane sees the router in sync with the new stream.
            await wait_for(lambda: _in_sync(op, model, second), within=10)
    finally:
        await router.stop()


async def _in_sync(op: httpx.AsyncClient, model: str, revision: int) -> bool:
    docs = (await op.get("/router_policy", params={"model": model})).json()["documents"]
    selection = next(d for d in docs if d["kind"] == "selection")
    return bool(selection["routers"]) and all(
        x["applied_revision"] == revision and x["in_sync"] for x in selection["routers"])
