"""What a worker may claim is issued, not asserted, and checked against what it delivers (issue 17
items 1-3), against real NATS and PostgreSQL: an admin issues a worker's manifest through the
control plane's API (signed, on ``rudder.manifests.<id>``); a router caps the worker's membership
record by it. A manifest published with the control plane's NATS credential but not its signing
key is ignored. A worker slower than the timing prior it claims loses it, and ``GET /workers``
shows which routers quarantine which of its claims."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from bus.identities import Identity, IdentityKind
from controlplane.protocol.events import MembershipEvent, MembershipOp, WorkerRecord
from controlplane.protocol.manifests import ManifestSpec, WorkerManifest
from controlplane.protocol.signing import Purpose, SigningKey
from controlplane.protocol.subjects import manifest_subject, membership_subject
from controlplane.server import Running
from router.cost.time import DEFAULT_TIMING
from tests import buskit
from tests.integration.cp_support import Tokens, client, controlplane
from tests.support_router.workers import InProcessRouter, router_settings, wait_for
from worker import agent
from worker.settings import MockEngineSettings

pytestmark = pytest.mark.timeout(90)


@dataclass
class Fleet:
    cp: Running
    router: InProcessRouter
    model: str
    worker: agent.Worker

    @property
    def wid(self) -> int:
        return self.worker.instance_id

    @property
    def record(self) -> WorkerRecord:
        assert self.worker.record is not None
        return self.worker.record

    def drops(self, kind: str, reason: str) -> int:
        totals: dict[tuple[str, str], int] = self.router.runtime.drops.totals
        return totals.get((kind, reason), 0)

    async def ranks(self) -> int:
        rank: int = await self.router.runtime.scheduler.inspect(lambda s: s.discovery.get(self.wid).record.dp_size)
        return rank


@contextlib.asynccontextmanager
async def fleet(nats_url: str, db: str) -> AsyncIterator[Fleet]:
    model = f"manifests/{uuid.uuid4().hex[:6]}"
    stop = asyncio.Event()
    ready: list[agent.Worker] = []
    settings = buskit.worker_settings(nats_url=nats_url, model=model, heartbeat_s=0.2, dp_size=2,
                                      mock=MockEngineSettings(speedup_ratio=50.0, block_size=16))
    task = asyncio.create_task(agent.serve(settings, stop=stop, on_ready=ready.append))  # type: ignore[arg-type]
    try:
        async with controlplane(nats_url, db) as cp:
            await wait_for(lambda: ready or task.done(), within=30)
            if task.done():
                task.result()
            router = await InProcessRouter(router_settings(nats_url, model)).start()
            try:
                await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 1, within=15)
                yield Fleet(cp, router, model, ready[0])
            finally:
                await router.stop()
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


async def _publish_until(nc: Any, subject: str, payload: bytes, seen: Callable[[], bool], *,
                         within: float = 20.0) -> None:
    """Publish ``payload`` on a membership subject until ``seen()``. The stream keeps one message a
    subject (a worker's last state): the worker's own heartbeat, every 0.2 s here, replaces a
    forged one the router's consumer has not been sent yet, which on a busy machine it may never
    be (the consumer's flow control holds its deliveries back). So a forged heartbeat lost that way
    is published again, each with a second to arrive."""
    deadline = time.monotonic() + within
    while True:
        await nc.publish(subject, payload)
        await nc.flush()
        try:
            await wait_for(seen, within=1.0)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise


def _spec(f: Fleet, **update: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": f.model, "max_dp_size": 2, "block_size": f.record.block_size,
                            "max_kv_blocks": f.record.kv_total_blocks, "engine": f.record.engine,
                            "url_allow": "127.0.0.1"}
    body.update(update)
    return body


async def test_an_issued_manifest_caps_a_worker_claiming_1024_ranks_and_a_forged_one_is_ignored(
        nats_url: str, db: str, tokens: Tokens) -> None:
    async with fleet(nats_url, db) as f:
        async with client(f.cp, tokens.admin) as api:
            r = await api.put(f"/workers/{f.wid}/manifest", json=_spec(f))
            assert r.status_code == 200, r.text
            assert r.json()["manifest"]["spec"]["max_dp_size"] == 2
        await wait_for(lambda: f.router.runtime.manifest_book.get(f.wid) is not None)

        # The worker's own credential claims 1024 ranks (the router's default cap would give 8).
        forged = MembershipEvent(op=MembershipOp.HEARTBEAT, worker=f.record.model_copy(update={"dp_size": 1024}),
                                 at=datetime.now(UTC)).to_bytes()
        nc = await buskit.connect_as(nats_url, Identity(IdentityKind.WORKER, model=f.model, instance_id=f.wid))
        try:
            await _publish_until(nc, membership_subject(f.model, f.wid), forged,
                                 lambda: f.drops("membership", "manifest_capped") >= 1)
            assert await f.ranks() == 2
        finally:
            await nc.close()

        # The control plane's NATS credential without its signing key: unsigned, and signed by
        # another key. Neither is believed; the worker keeps its issued manifest.
        loose = WorkerManifest(instance_id=f.wid, spec=ManifestSpec.model_validate(_spec(f, max_dp_size=1024)),
                               issued_by="intruder", issued_at=datetime.now(UTC))
        subject, payload = manifest_subject(f.wid), loose.to_bytes()
        nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
        try:
            js = nc.jetstream()
            await js.publish(subject, payload)
            other = SigningKey.generate(Purpose.MANIFEST)
            await js.publish(subject, payload, headers=other.sign(subject, payload))
            await wait_for(lambda: f.drops("manifest", "signature_missing") >= 1
                           and f.drops("manifest", "signature_unknown_key") >= 1)
        finally:
            await nc.close()
        held = f.router.runtime.manifest_book.get(f.wid)
        assert held is not None and held.spec.max_dp_size == 2
        heartbeats = f.drops("membership", "manifest_capped")
        nc = await buskit.connect_as(nats_url, Identity(IdentityKind.WORKER, model=f.model, instance_id=f.wid))
        try:
            await _publish_until(nc, membership_subject(f.model, f.wid), forged,
                                 lambda: f.drops("membership", "manifest_capped") > heartbeats)
            assert await f.ranks() == 2
        finally:
            await nc.close()

        async with client(f.cp, tokens.viewer) as api:
            listed = (await api.get("/workers/manifests")).json()["manifests"]
        mine = [m for m in listed if m.get("subject") == subject]
        assert mine and mine[0]["verified"] is False and "not among the valid keys" in mine[0]["problem"]
        async with httpx.AsyncClient(base_url=f.router.url, timeout=10) as http:
            metrics = (await http.get("/metrics")).text
        assert 'rudder_router_bus_dropped_total{kind="manifest",reason="signature_missing"}' in metrics
        assert 'rudder_router_bus_dropped_total{kind="membership",reason="manifest_capped"}' in metrics


async def test_a_manifest_refuses_a_record_outside_it(nats_url: str, db: str, tokens: Tokens) -> None:
    async with fleet(nats_url, db) as f:
        async with client(f.cp, tokens.admin) as api:
            r = await api.put(f"/workers/{f.wid}/manifest", json=_spec(f, url_allow="10.9.9.9"))
            assert r.status_code == 200, r.text
        await wait_for(lambda: f.drops("membership", "manifest_refused") >= 1)
        # Its heartbeats are refused from now on: it expires (worker TTL 5 s here) and draws nothing.
        await wait_for(lambda: not f.router.runtime.scheduler.view.workers.get(f.model), within=15)


async def test_a_bad_manifest_body_names_the_field(nats_url: str, db: str, tokens: Tokens) -> None:
    async with controlplane(nats_url, db) as cp:
        good = {"model": "m", "block_size": 16, "max_kv_blocks": 1024, "url_allow": "127.0.0.1"}
        async with client(cp, tokens.admin) as api:
            for body, status, field in (
                ({**good, "max_dp_size": 0}, 422, "max_dp_size"),
                ({**good, "max_dp_size": "2"}, 422, "max_dp_size"),
                ({**good, "dp": 2}, 422, "dp"),
                ({**good, "url_allow": "not a host!"}, 422, "url_allow"),
                ({k: v for k, v in good.items() if k != "block_size"}, 422, "block_size"),
                ([1], 400, "body"),
            ):
                r = await api.put("/workers/7/manifest", json=body)
                assert r.status_code == status, (body, r.text)
                assert r.json()["error"]["field"] == field, r.text
            r = await api.put("/workers/0/manifest", json=good)
            assert r.status_code == 400 and r.json()["error"]["field"] == "instance_id"
            audit = (await api.get("/audit", params={"limit": 20, "actor": "test-admin"})).json()
        rows = [row for row in audit["items"] if row.get("op") == "manifest_issue"
                and (row.get("changes") or {}).get("instance_id") in (0, 7)]
        assert len(rows) == 7 and all(row["decision"] == "rejected" for row in rows), rows
        async with client(cp, tokens.operator) as api:
            r = await api.put("/workers/7/manifest", json=good)
            assert r.status_code == 403, r.text


async def test_manifests_lists_the_last_of_every_worker(nats_url: str, db: str, tokens: Tokens) -> None:
    async with controlplane(nats_url, db) as cp:
        good = {"model": "m", "block_size": 16, "max_kv_blocks": 1024, "url_allow": "127.0.0.1"}
        ids = [uuid.uuid4().int >> 65 for _ in range(3)]
        async with client(cp, tokens.admin) as api:
            for wid in ids:
                r = await api.put(f"/workers/{wid}/manifest", json=good)
                assert r.status_code == 200, r.text
            r = await api.put(f"/workers/{ids[0]}/manifest", json={**good, "max_dp_size": 4})
            assert r.status_code == 200, r.text
            listed = {m["instance_id"]: m for m in (await api.get("/workers/manifests")).json()["manifests"]}
        async with client(cp, tokens.operator) as op:  # policy revisions past the manifests' own
            model, revision = f"manifests/{uuid.uuid4().hex[:6]}", 0
            for i in range(6):
                r = await op.patch("/router_policy", json={"model": model, "expected_revision": revision,
                                                           "parameters": {"router_temperature": i / 10}})
                assert r.status_code == 200, r.text
                revision = r.json()["revision"]
        async with client(cp, tokens.admin) as api:
            report = (await api.post("/audit/reconcile", json={})).json()
        assert set(ids) <= set(listed), listed
        assert listed[ids[0]]["spec"]["max_dp_size"] == 4 and all(listed[w]["verified"] for w in ids)
        # A manifest's accepted decision names the manifest stream's revision: it is not a policy
        # decision whose event is missing (every `rudder up` reconciled "not clean" before).
        assert not [d for d in report["decisions_without_event"] if d["kind"] is None], report


async def test_a_worker_slower_than_its_claimed_prior_loses_it_and_workers_list_shows_it(
        nats_url: str, db: str, tokens: Tokens) -> None:
    """Issue 17 items 2-3: a real mock worker advertising a prior 100x faster than it is (and an
    honest one at the same real speed); the router's time cost first believes the claim, then the
    measured TTFTs take it away: its own prior is used, reported on /metrics and, through the
    router's status, in ``GET /workers`` (``rudder workers list``)."""
    model = f"timing/{uuid.uuid4().hex[:6]}"
    stop = asyncio.Event()
    ready: list[agent.Worker] = []
    tasks = []
    try:
        for advertised in (100.0, None):
            settings = buskit.worker_settings(nats_url=nats_url, model=model, heartbeat_s=0.2, mock=MockEngineSettings(
                speedup_ratio=1.0, advertise_speedup_ratio=advertised, block_size=16))
            tasks.append(asyncio.create_task(agent.serve(settings, stop=stop, on_ready=ready.append)))  # type: ignore[arg-type]
            await wait_for(lambda n=len(tasks): len(ready) == n or any(t.done() for t in tasks), within=30)
        for t in tasks:
            if t.done():
                t.result()
        liar, honest = ready[0].instance_id, ready[1].instance_id
        async with controlplane(nats_url, db) as cp:
            router = await InProcessRouter(router_settings(nats_url, model, mode="kv-time")).start()
            try:
                await _slower_than_claimed(router, cp, tokens, model, liar, honest)
            finally:
                await router.stop()
    finally:
        stop.set()
        for t in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)


async def _slower_than_claimed(router: InProcessRouter, cp: Running, tokens: Tokens, model: str, liar: int,
                               honest: int) -> None:
    sched = router.runtime.scheduler
    await wait_for(lambda: sched.view.workers.get(model) == 2, within=15)
    claimed = await sched.inspect(lambda s: s.timings.workers[liar].prior)
    assert claimed.p1 == pytest.approx(DEFAULT_TIMING.p1 / 100, rel=0.01)  # believed at first
    # 3,000-token prompts: a real prefill of about 65 ms (the liar claims 0.65), well past the
    # 20 ms a request of slack that keeps honest fast workers (HTTP overhead) from being judged.
    # Judged once its answers have read slower than its claim for persist_s (3 s) without a break:
    # about 50 of these requests.
    async with httpx.AsyncClient(base_url=router.url, timeout=20) as http:
        for i in range(150):
            r = await http.post("/v1/chat/completions", json={  # streamed: its TTFT is measured
                "model": model, "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} question {i} " + "x" * 3000}]})
            assert r.status_code == 200, r.text
            if await sched.inspect(lambda s: liar in s.timing_outcomes.quarantined):
                break
        metrics = (await http.get("/metrics")).text
    quarantined, prior = await sched.inspect(
        lambda s: (set(s.timing_outcomes.quarantined), s.timings.workers[liar].prior))
    assert quarantined == {liar}, quarantined  # the honest worker keeps its prior
    assert (prior.p0, prior.p1, prior.p2) == (DEFAULT_TIMING.p0, DEFAULT_TIMING.p1, DEFAULT_TIMING.p2)
    gauge = metrics.split("rudder_router_worker_timing_quarantined", 1)[1].split("# HELP", 1)[0]
    assert f'{{instance_id="{liar}",model="{model}"}} 1.0' in gauge
    assert f'instance_id="{honest}"' not in gauge

    async def listed() -> dict[int, Any]:
        async with client(cp, tokens.viewer) as api:
            body = (await api.get("/workers", params={"model": model})).json()
        return {w["instance_id"]: w["quarantined"] for w in body["workers"]}

    want = [{"router_id": router.runtime.settings.router_id, "claims": ["timing"]}]

    async def shown() -> bool:
        return (await listed()).get(liar) == want

    await wait_for(shown)
    assert (await listed())[honest] == []
