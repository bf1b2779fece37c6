"""The control plane's write path against real NATS JetStream and real PostgreSQL (issue 2)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from bus.identities import Identity, IdentityKind
from controlplane.audit.store import AuditStore
from controlplane.eventlog import PolicyLog
from controlplane.protocol.policy import PolicyKind
from tests import buskit
from tests.integration.cp_support import Tokens, client, controlplane
from tests.policy_keys import session_keys

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
async def audit(db: str) -> AsyncIterator[AuditStore]:
    store = AuditStore.from_url(db)
    yield store
    await store.close()


@pytest.fixture(scope="module")
async def policy_log(nats_url: str) -> AsyncIterator[PolicyLog]:
    nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
    yield session_keys().policy_log(nc)
    await nc.close()


def model_name() -> str:
    return f"org/model-{uuid.uuid4().hex[:8]}:v1.0"


async def events_of(log: PolicyLog, model: str, kind: PolicyKind = PolicyKind.SELECTION) -> list[int]:
    return [s.revision async for s in log.history(model, kind)]


async def test_patch_then_get_history_and_null_semantics(nats_url: str, db: str, tokens: Tokens,
                                                         policy_log: PolicyLog) -> None:
    model = model_name()
    async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as http:
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                      "parameters": {"router_temperature": 0.5,
                                                                     "overlap_score_credit": 2}})
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["document"] == {"overlap_score_credit": 2.0, "router_temperature": 0.5}
        assert first["previous_revision"] == 0 and first["revision"] > 0
        # null removes the override, omitted fields stay
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": first["revision"],
                                                      "parameters": {"router_temperature": None}})
        assert r.status_code == 200, r.text
        second = r.json()
        assert second["document"] == {"overlap_score_credit": 2.0}
        assert second["diff"] == {"router_temperature": {"before": 0.5, "after": None}}
        r = await http.get("/router_policy", params={"model": model})
        docs = {d["kind"]: d for d in r.json()["documents"]}
        assert docs["selection"]["revision"] == second["revision"]
        assert docs["selection"]["document"] == {"overlap_score_credit": 2.0}
        assert docs["busy_threshold"]["revision"] == 0
        hist = (await http.get("/router_policy/history", params={"model": model})).json()
        assert [h["revision"] for h in hist["revisions"]] == [second["revision"], first["revision"]]
        # dry run publishes nothing
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": second["revision"],
                                                      "reset": True, "dry_run": True})
        assert r.status_code == 200 and r.json()["document"] == {} and r.json()["dry_run"] is True
        assert await events_of(policy_log, model) == [first["revision"], second["revision"]]
        # rollback is a new forward revision equal to the old document
        r = await http.post("/router_policy/rollback", json={
            "model": model, "kind": "selection", "to_revision": first["revision"],
            "expected_revision": second["revision"]})
        assert r.status_code == 200, r.text
        rb = r.json()
        assert rb["op"] == "rollback" and rb["revision"] > second["revision"]
        assert rb["document"] == first["document"]
        # reset empties
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": rb["revision"],
                                                      "reset": True})
        assert r.status_code == 200 and r.json()["document"] == {}


async def test_50_concurrent_patches_two_instances_one_wins(nats_url: str, db: str, tokens: Tokens,
                                                            audit: AuditStore, policy_log: PolicyLog) -> None:
    model = model_name()
    async with controlplane(nats_url, db) as cp1, controlplane(nats_url, db) as cp2:
        async with client(cp1, tokens.operator) as h1, client(cp2, tokens.operator) as h2:
            async def attempt(i: int) -> httpx.Response:
                http = h1 if i % 2 else h2
                return await http.patch("/router_policy", json={
                    "model": model, "expected_revision": 0, "parameters": {"router_temperature": i / 100}})

            responses = await asyncio.gather(*(attempt(i) for i in range(50)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) == 1 and statuses.count(409) == 49, statuses
    winner = next(r.json() for r in responses if r.status_code == 200)
    for r in responses:
        if r.status_code == 409:
            err = r.json()["error"]
            assert err["code"] == "revision_conflict" and err["expected_revision"] == 0
            assert err["head_revision"] in (0, winner["revision"])
    assert await events_of(policy_log, model) == [winner["revision"]]
    rows, _ = await audit.query(model=model, limit=1000)
    decisions = [r for r in rows if r.stage.value == "decision"]
    assert len(decisions) == 50
    assert sum(r.decision.value == "accepted" for r in decisions) == 1
    assert sum(r.decision.value == "rejected" and r.reason_code == "revision_conflict" for r in decisions) == 49


async def test_20_concurrent_partial_threshold_updates_lose_nothing(nats_url: str, db: str, tokens: Tokens,
                                                                    policy_log: PolicyLog) -> None:
    model = model_name()
    fields = ["active_decode_blocks_threshold", "active_prefill_tokens_threshold",
              "active_prefill_tokens_threshold_frac"]
    async with controlplane(nats_url, db) as cp1, controlplane(nats_url, db) as cp2:
        async with client(cp1, tokens.operator) as h1, client(cp2, tokens.operator) as h2:
            r = await h1.post("/busy_threshold", json={"model": model, "active_decode_blocks_threshold": 0.5})
            assert r.status_code == 404 and r.json()["error"]["field"] == "model"
            r = await h1.post("/busy_threshold", json={"model": model, "active_decode_blocks_threshold": 0.5,
                                                       "create": True})
            assert r.status_code == 200, r.text

            def body(i: int) -> dict[str, object]:
                name = fields[i % 3]
                value: float | int = (i + 1) * 100 if name == "active_prefill_tokens_threshold" else (i + 1) / 100
                return {"model": model, name: value}

            responses = await asyncio.gather(*(
                (h1 if i % 2 else h2).post("/router_policy/busy_threshold", json=body(i)) for i in range(20)))
    assert [r.status_code for r in responses] == [200] * 20, [r.text for r in responses if r.status_code != 200]
    history = [s async for s in policy_log.history(model, PolicyKind.BUSY_THRESHOLD)]
    assert len(history) == 21  # the create + all 20 updates, each its own revision
    # No lost update: every event's document is its predecessor's with its own change applied.
    for prev, cur in itertools.pairwise(history):
        assert cur.event is not None and prev.event is not None
        assert cur.event.expected_revision == prev.revision
        expected = dict(prev.event.document)
        expected.update({k: v for k, v in cur.event.changes.items() if v is not None})
        assert cur.event.document == expected
    final = history[-1].event
    assert final is not None
    landed = {json.dumps(body_changes, sort_keys=True) for body_changes in
              ({k: v for k, v in s.event.changes.items()} for s in history[1:] if s.event)}
    assert len(landed) == 20  # each of the 20 distinct updates is an event of its own
    for name in fields:  # the final value of each field is the last write to it
        last = next(s.event.changes[name] for s in reversed(history) if s.event and name in s.event.changes)
        assert final.document[name] == last


async def test_bad_input_is_refused_by_field_and_audited(nats_url: str, db: str, tokens: Tokens,
                                                         audit: AuditStore, policy_log: PolicyLog) -> None:
    model = model_name()
    cases: list[tuple[str, object, int, str]] = [
        ("unknown parameter", {"bogus_weight": 1.0}, 422, "parameters.bogus_weight"),
        ("negative", {"overlap_score_credit": -1}, 422, "parameters.overlap_score_credit"),
        ("fraction above 1", {"host_cache_hit_weight": 1.5}, 422, "parameters.host_cache_hit_weight"),
        ("wrong type", {"router_temperature": "hot"}, 422, "parameters.router_temperature"),
        ("bool is not a number", {"router_temperature": True}, 422, "parameters.router_temperature"),
    ]
    async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as http:
        for name, params, status, field in cases:
            r = await http.patch("/router_policy", json={"model": model, "expected_revision": 0, "parameters": params})
            assert r.status_code == status, (name, r.text)
            assert r.json()["error"]["field"] == field, name
        for literal, field in (("NaN", "parameters.router_temperature"),
                               ("Infinity", "parameters.prefill_load_scale")):
            name = field.split(".")[1]
            raw = f'{{"model": "{model}", "expected_revision": 0, "parameters": {{"{name}": {literal}}}}}'
            r = await http.patch("/router_policy", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
            assert "finite" in r.json()["error"]["message"]
        r = await http.patch("/router_policy", content=b'{"model": "x", "parameters": ',
                             headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "body"
        r = await http.patch("/router_policy", content=b"model=x", headers={"content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["field"] == "content-type"
        big = json.dumps({"model": model, "expected_revision": 0, "parameters": {}, "pad": "x" * 2_000_000})
        r = await http.patch("/router_policy", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["field"] == "body"
        r = await http.patch("/router_policy", json={"model": model, "parameters": {"router_temperature": 1}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "expected_revision"
    assert await events_of(policy_log, model) == []
    assert not math.isnan(0.0)
    rows, _ = await audit.query(model=model, decision="rejected", limit=100)
    assert len(rows) >= len(cases) + 3  # every refusal that named the model was recorded
    everything, _ = await audit.query(limit=1000)
    codes = {r.reason_code for r in everything if r.decision.value == "rejected"}
    assert {"validation_failed", "invalid_request", "unsupported_media_type", "payload_too_large"} <= codes


async def test_auth_missing_token_401_viewer_403_both_audited(nats_url: str, db: str, tokens: Tokens,
                                                              audit: AuditStore, policy_log: PolicyLog) -> None:
    model = model_name()
    body = {"model": model, "expected_revision": 0, "parameters": {"router_temperature": 1.0}}
    async with controlplane(nats_url, db) as cp:
        async with client(cp, None) as anon, client(cp, tokens.viewer) as viewer, \
                client(cp, "rdr_not-a-real-token") as forged:
            r = await anon.patch("/router_policy", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
            r = await forged.patch("/router_policy", json=body)
            assert r.status_code == 401
            r = await viewer.patch("/router_policy", json=body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
            assert (await viewer.get("/router_policy")).status_code == 200
            assert (await viewer.get("/audit")).status_code == 403
            assert (await anon.get("/router_policy")).status_code == 401
        async with client(cp, tokens.auditor) as auditor:
            r = await auditor.get("/audit", params={"model": model})
            assert r.status_code == 200
            items = r.json()["items"]
    codes = sorted(i["reason_code"] for i in items)
    # The source's first failed authentication is a row of its own; the later two (the forged
    # token's write and the anonymous read) are the one row of the window, written at the latest
    # when the control plane stops, with their count (docs/controlplane.md).
    assert codes == ["forbidden", "unauthenticated"]
    viewer_row = next(i for i in items if i["reason_code"] == "forbidden")
    assert viewer_row["actor"] == "test-viewer" and viewer_row["roles"] == ["viewer"]
    rows, _ = await audit.query(decision="rejected", limit=50)
    summary = next(r for r in rows if r.reason_code == "auth_failures")
    assert summary.source_ip == "127.0.0.1" and summary.changes is not None
    assert summary.changes["count"] == 2 and summary.changes["failures"] == 3
    assert await events_of(policy_log, model) == []


async def test_capability_check_refuses_weights_a_live_router_cannot_feed(nats_url: str, db: str,
                                                                          tokens: Tokens, nc: object) -> None:
    from datetime import UTC, datetime

    from controlplane.protocol.events import RouterStatus
    from controlplane.protocol.subjects import BUCKET_ROUTERS

    model = model_name()
    async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as http:
        js = nc.jetstream()  # type: ignore[attr-defined]
        kv = await js.key_value(BUCKET_ROUTERS)
        now = datetime.now(UTC)
        status = RouterStatus(router_id="rr-approx", models=[model], mode="kv", cache_inputs=["device"],
                              started_at=now, heartbeat_at=now)
        await kv.put("rr-approx", status.to_bytes())
        for _ in range(100):
            if cp.controlplane.fleet.live_routers(model):
                break
            await asyncio.sleep(0.02)
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                      "parameters": {"host_cache_hit_weight": 0.5}})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "capability_mismatch"
        assert err["weights"] == ["host_cache_hit_weight"] and err["routers"] == ["rr-approx"]
        # a device-only weight is fine for that router
        r = await http.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                      "parameters": {"overlap_score_credit": 0.5}})
        assert r.status_code == 200, r.text


async def test_calibration_reset_is_an_audited_epoch_patch(nats_url: str, db: str, tokens: Tokens,
                                                           audit: AuditStore, policy_log: PolicyLog) -> None:
    model = model_name()
    async with controlplane(nats_url, db) as cp:
        async with client(cp, tokens.operator) as http:
            r = await http.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                          "parameters": {"router_temperature": 0.5}})
            assert r.status_code == 200, r.text
            first = (await http.post("/router_policy/calibration/reset", json={"model": model})).json()
            assert first["document"] == {"calibration_epoch": 1, "router_temperature": 0.5}, first
            second = await http.post("/router_policy/calibration/reset", json={"model": model})
            assert second.status_code == 200 and second.json()["document"]["calibration_epoch"] == 2
            bad = await http.post("/router_policy/calibration/reset", json={"model": model, "x": 1})
            assert bad.status_code == 422 and bad.json()["error"]["field"] == "x", bad.text
        async with client(cp, tokens.viewer) as http:
            refused = await http.post("/router_policy/calibration/reset", json={"model": model})
            assert refused.status_code == 403
    assert len(await events_of(policy_log, model)) == 3
    rows, _ = await audit.query(model=model, decision="accepted", limit=100)
    assert sum(1 for r in rows if (r.changes or {}).get("calibration_epoch")) == 2
