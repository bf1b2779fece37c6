"""Policy events through real JetStream into the router's scheduler (DESIGN §2, §3, §5)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS

from controlplane.protocol.events import decode_apply_ack, decode_router_status
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import BUCKET_ROUTERS, HDR_MSG_ID, acks_subject
from router.commands import RoutingRequest, SelectWorker
from tests import buskit
from tests.support_router.policy import publish_policy, publish_raw
from tests.support_router.workers import InProcessRouter, router_settings, start_worker, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[NATS]:
    nc = await buskit.admin_connect(nats_url)
    yield nc
    await nc.close()


async def _acks(nc: NATS, router_id: str) -> asyncio.Queue[Any]:
    """The router's ACKs as a core subscriber sees them, each once: a publish the router retries
    (same Nats-Msg-Id; the stream stores it once) reaches a core subscriber once per attempt."""
    q: asyncio.Queue[Any] = asyncio.Queue()
    seen: set[str] = set()

    async def cb(msg: Any) -> None:
        msg_id = (msg.headers or {}).get(HDR_MSG_ID)
        if msg_id is not None:
            if msg_id in seen:
                return
            seen.add(msg_id)
        q.put_nowait(decode_apply_ack(msg.data))

    await nc.subscribe(acks_subject(router_id), cb=cb)
    return q


async def test_patch_applied_while_200_selections_are_queued(nats_url: str, client: NATS) -> None:
    model = "queued-model"
    workers = [await start_worker(nats_url, model) for _ in range(3)]
    # Heartbeats queue behind thousands of selections here: a long stale window keeps this test
    # about policy ordering, not worker liveness.
    # More selections than the default queue bound (RUDDER_MAX_QUEUED_SELECTIONS) are queued at once.
    router = await InProcessRouter(router_settings(nats_url, model, worker_stale_s=30.0, worker_ttl_s=60.0,
                                                   max_queued_selections=100_000)).start()
    sched = router.runtime.scheduler
    js = client.jetstream()
    try:
        await wait_for(lambda: sched.view.workers.get(model) == 3)

        def req(i: int) -> RoutingRequest:
            return RoutingRequest(request_id=f"q{i}", model=model, prompt_tokens=64, hashes={})

        # Far more than 200 are queued before the publish, so that at least 200 are still waiting
        # when the patch is accepted even on a loaded machine (the publish's await lets the actor run).
        ids = itertools.count()
        before = [sched.submit(SelectWorker(req(next(ids)))) for _ in range(3000)]
        revision = await publish_policy(js, model, {"router_temperature": 0.5}, expected_revision=0)
        queued_at_accept = sum(not f.done() for f in before)
        after: list[asyncio.Future[Any]] = []
        # Keep queueing until the apply has happened, then 200 more.
        while sched.view.applied[f"{model}|selection"].revision != revision:
            after += [sched.submit(SelectWorker(req(next(ids)))) for _ in range(5)]
            await asyncio.sleep(0.002)  # paced: the actor must be able to reach the policy event
        after += [sched.submit(SelectWorker(req(next(ids)))) for _ in range(200)]
        results = await asyncio.gather(*before, *after)
    finally:
        await router.stop()
        for w in workers:
            await w.stop()
    assert queued_at_accept >= 200, queued_at_accept
    assert len(results) == len(before) + len(after)
    seen = [(r.seq, r.revisions["selection"]) for r in results]
    assert all(rev in (0, revision) for _, rev in seen)  # exactly one revision each
    seen.sort()
    revs = [rev for _, rev in seen]
    switch = revs.index(revision)
    assert all(r == 0 for r in revs[:switch]) and all(r == revision for r in revs[switch:])
    assert switch >= len(before) - queued_at_accept  # those done before the accept ran on revision 0
    assert all(r.revisions["selection"] == revision for r in results[-200:])


async def test_cache_free_router_nacks_and_keeps_last_good_values(nats_url: str, client: NATS) -> None:
    model = "rr-model"
    router = await InProcessRouter(router_settings(nats_url, model, mode="round_robin")).start()
    rid = router.settings.router_id
    acks = await _acks(client, rid)
    js = client.jetstream()
    try:
        good = await publish_policy(js, model, {"router_temperature": 0.25}, expected_revision=0)
        ack = await asyncio.wait_for(acks.get(), 5)
        assert (ack.status.value, ack.revision) == ("ACK", good)
        bad = await publish_policy(
            js, model, {"router_temperature": 0.25, "host_cache_hit_weight": 0.5},
            expected_revision=good,
        )
        nack = await asyncio.wait_for(acks.get(), 5)
        assert (nack.status.value, nack.revision, nack.router_id) == ("NACK", bad, rid)
        assert "host_cache_hit_weight" in nack.detail and "host" in nack.detail
        assert nack.effective["host_cache_hit_weight"] == 0.0
        assert nack.effective["router_temperature"] == 0.25

        kv = await js.key_value(BUCKET_ROUTERS)

        async def status_shows_nack() -> bool:
            st = decode_router_status((await kv.get(rid)).value or b"")
            doc = st.applied[f"{model}|selection"]
            return doc.last_nack_revision == bad

        await wait_for(status_shows_nack)
        st = decode_router_status((await kv.get(rid)).value or b"")
        doc = st.applied[f"{model}|selection"]
        assert doc.revision == good
        assert doc.effective["router_temperature"] == 0.25
        assert doc.effective["host_cache_hit_weight"] == 0.0
        assert doc.last_nack is not None and "host_cache_hit_weight" in doc.last_nack
        assert st.cache_inputs == [] and st.mode == "round_robin"
    finally:
        await router.stop()


async def test_malformed_policy_message_is_nacked_and_router_keeps_serving(
    nats_url: str, client: NATS
) -> None:
    model = "malformed-model"
    worker = await start_worker(nats_url, model)
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    rid = router.settings.router_id
    acks = await _acks(client, rid)
    js = client.jetstream()
    try:
        rev = await publish_raw(js, model, b"{this is not a policy event", expected_revision=0)
        nack = await asyncio.wait_for(acks.get(), 5)
        assert (nack.status.value, nack.revision) == ("NACK", rev)
        assert "malformed" in nack.detail
        rev2 = await publish_raw(js, model, json.dumps({"document": {"x": 1}}).encode(), expected_revision=rev)
        nack2 = await asyncio.wait_for(acks.get(), 5)
        assert (nack2.status.value, nack2.revision) == ("NACK", rev2)
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 1)
        async with httpx.AsyncClient(base_url=router.url) as http:
            r = await http.post("/v1/completions", json={"model": model, "prompt": "still here"})
            assert r.status_code == 200
            assert (await http.get("/health")).status_code == 200
        # and a good event afterwards is applied
        rev3 = await publish_policy(js, model, {"router_temperature": 0.1}, expected_revision=rev2)
        ack = await asyncio.wait_for(acks.get(), 5)
        assert (ack.status.value, ack.revision) == ("ACK", rev3)
    finally:
        await router.stop()
        await worker.stop()


async def test_missed_event_is_reported_and_head_reread(nats_url: str, client: NATS) -> None:
    model = "gap-model"
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    acks = await _acks(client, router.settings.router_id)
    js = client.jetstream()
    try:
        r1 = await publish_policy(js, model, {"router_temperature": 0.1}, expected_revision=0)
        assert (await asyncio.wait_for(acks.get(), 5)).revision == r1
        r2 = await publish_policy(js, model, {"router_temperature": 0.2}, expected_revision=r1)
        assert (await asyncio.wait_for(acks.get(), 5)).revision == r2
        raw = json.loads((await js.get_last_msg("RUDDER_POLICY", f"rudder.policy.{model}.selection")).data)
        # An event whose expected_revision is not what the router applied last: a missed event.
        raw["expected_revision"] = r2 + 100
        raw["document"] = {"router_temperature": 0.3}
        r3 = await publish_raw(js, model, json.dumps(raw).encode(), expected_revision=r2)
        ack = await asyncio.wait_for(acks.get(), 5)
        assert (ack.status.value, ack.revision) == ("ACK", r3)
        assert "gap" in ack.detail
        assert router.runtime.scheduler.view.applied[f"{model}|selection"].effective["router_temperature"] == 0.3
    finally:
        await router.stop()


async def test_router_status_in_bucket_and_startup_overrides(nats_url: str, client: NATS) -> None:
    model = "status-model"
    router = await InProcessRouter(router_settings(
        nats_url, model, kv_events=False, selection={"router_temperature": 0.4},
        busy_thresholds={"active_prefill_tokens_threshold": 100},
    )).start()
    try:
        kv = await client.jetstream().key_value(BUCKET_ROUTERS)
        st = decode_router_status((await kv.get(router.settings.router_id)).value or b"")
        assert st.models == [model]
        assert st.cache_inputs == ["device"]  # approximate mode
        assert st.startup["selection"]["router_temperature"] == 0.4
        assert st.startup["selection"]["host_cache_hit_weight"] == 0.0
        assert st.startup["busy_threshold"]["active_prefill_tokens_threshold"] == 100
        assert st.applied[f"{model}|selection"].revision == 0
        info = await client.jetstream().stream_info("RUDDER_POLICY")
        assert info.config.allow_direct and info.config.deny_delete and info.config.deny_purge
        assert info.config.duplicate_window == 120
        assert info.config.max_msgs_per_subject == 64
    finally:
        await router.stop()
    # A stopped router removes its status.
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(router.settings.router_id)


async def test_policy_kind_busy_threshold_applied(nats_url: str, client: NATS) -> None:
    model = "thr-model"
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    try:
        rev = await publish_policy(client.jetstream(), model, {"active_decode_blocks_threshold": 0.5},
                                   expected_revision=0, kind=PolicyKind.BUSY_THRESHOLD)
        await wait_for(lambda: router.runtime.scheduler.view.applied[f"{model}|busy_threshold"].revision == rev)
        doc = router.runtime.scheduler.view.applied[f"{model}|busy_threshold"]
        assert doc.effective["active_decode_blocks_threshold"] == 0.5
        assert doc.effective["active_prefill_tokens_threshold"] is None
    finally:
        await router.stop()
