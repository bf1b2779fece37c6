"""Router replicas share their bookings (router.peers, router.peersync): two replicas in front of
two real mock workers, requests alternating between the replicas, each replica counting the other's
in-flight requests within the stated staleness, well before any load report could tell it."""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any

import httpx
import pytest

from bus.identities import Identity, IdentityKind
from controlplane.protocol.subjects import router_load_subject
from router.peers import Figures
from router.peersync import to_message
from router.scheduler import Scheduler
from tests import buskit
from tests.support_router.workers import InProcessRouter, mock_workers, router_settings, wait_for

pytestmark = pytest.mark.timeout(60)
MODEL = "peer-model"
# What docs/router.md states: a peer's booking is counted within one publishing interval
# (peer_sync_interval_s, 25 ms) plus the bus's delivery; asserted with room for a loaded machine,
# and far below the workers' load reports here (every 30 s).
SEEN_WITHIN_S = 0.5


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(("kv", "cache", "rank", "block", "decode", "prefill")) + str(rng.randrange(10**6))
                    for _ in range(40))


async def _peer_requests(router: InProcessRouter, peer_id: str, wid: int) -> int:
    def read(s: Scheduler) -> int:
        return s.peers.of_peer(peer_id).get((wid, 0), Figures(0, 0, 0)).requests

    n: int = await router.runtime.scheduler.inspect(read)
    return n


async def test_alternating_replicas_see_each_others_bookings_within_the_staleness(nats_url: str) -> None:
    rng = random.Random(5)
    # Load reports every 30 s: what a replica knows of the other's requests within the test's
    # half-second bounds comes from the other replica, not from the workers.
    async with mock_workers(nats_url, MODEL, 2, heartbeat_s=30.0, mock={"speedup_ratio": 1.0}) as workers:
        common: dict[str, Any] = {"worker_ttl_s": 120.0, "worker_stale_s": 60.0, "decision_sample": 1.0}
        a = await InProcessRouter(router_settings(nats_url, MODEL, router_id="peer-a", **common)).start()
        b = await InProcessRouter(router_settings(nats_url, MODEL, router_id="peer-b", **common)).start()
        replicas = [(a, b), (b, a)]  # (replica sent to, its peer)
        try:
            for r in (a, b):
                await wait_for(lambda r=r: r.runtime.scheduler.view.live_workers.get(MODEL) == 2, within=15)
            chosen: list[int] = []
            seen_after: list[float] = []
            async with httpx.AsyncClient(timeout=30) as http, contextlib.AsyncExitStack() as streams:
                for i in range(4):
                    to, peer = replicas[i % 2]
                    rid = f"peer-req-{i}"
                    resp = await streams.enter_async_context(http.stream(
                        "POST", f"{to.url}/v1/completions", headers={"x-request-id": rid},
                        json={"model": MODEL, "prompt": _prompt(rng), "max_tokens": 4000, "stream": True}))
                    assert resp.status_code == 200, await resp.aread()
                    booked_at = time.monotonic()  # the replica booked before it answered
                    wid = int(resp.headers["x-worker-instance-id"])
                    chosen.append(wid)
                    if i == 1:
                        # b's selection saw a's booking: the booked worker cost more, the other was chosen
                        record = b.runtime.decisions.get(rid)[0]
                        costs = {c.instance_id: c.cost_ms for c in record.candidates}
                        assert record.instance_id == wid != chosen[0]
                        assert costs[chosen[0]] > costs[wid], costs
                    # the peer counts this request as the replica's booking, within the bound
                    mine = sum(1 for w in chosen[i % 2::2] if w == wid)
                    await wait_for(lambda p=peer, t=to, w=wid, n=mine: _peer_requests_at_least(p, t, w, n),
                                   within=SEEN_WITHIN_S, interval=0.005)
                    seen_after.append(time.monotonic() - booked_at)
                    # and its load figure for that worker rose with it
                    load = await peer.runtime.scheduler.inspect(
                        lambda s, w=wid: s._slots[MODEL][(w, 0)].active_requests)
                    assert load >= mine
            # alternating replicas spread the four long requests over both workers
            assert sorted(chosen.count(w.instance_id) for w in workers) == [2, 2], chosen
            print(f"peer booking seen after {', '.join(f'{s * 1000:.0f}' for s in seen_after)} ms")
            async with httpx.AsyncClient(timeout=10) as http:
                metrics = (await http.get(f"{b.url}/metrics")).text
            assert "rudder_router_peers 1.0" in metrics
            assert 'rudder_router_peer_snapshots_total{direction="received"}' in metrics
            # a replica that stops says so: its peer no longer counts its bookings
            await a.stop()
            await wait_for(lambda: _no_peer(b, "peer-a"), within=SEEN_WITHIN_S, interval=0.005)
        finally:
            await b.stop()
            await a.stop()


async def _peer_requests_at_least(peer: InProcessRouter, of: InProcessRouter, wid: int, n: int) -> bool:
    return await _peer_requests(peer, of.settings.router_id, wid) >= n


async def _no_peer(router: InProcessRouter, peer_id: str) -> bool:
    left: dict[Any, Figures] = await router.runtime.scheduler.inspect(lambda s: s.peers.of_peer(peer_id))
    return not left


async def test_bad_oversized_and_impersonating_snapshots_are_refused_and_counted(nats_url: str) -> None:
    """A peer's credentials let it speak on its own subject only; what it says there is checked:
    a snapshot naming another router, one that does not decode, one past the size bound, and a
    flood past the peer's rate are dropped and counted, and none of them reaches the scheduler."""
    router = await InProcessRouter(router_settings(nats_url, MODEL, router_id="peer-victim",
                                                   peer_sync_rate_per_s=5.0)).start()
    nc = await buskit.connect_as(nats_url, Identity(IdentityKind.ROUTER, router_id="peer-rogue"))
    subject = router_load_subject("peer-rogue")
    totals = router.runtime.drops.totals
    try:
        await nc.publish(subject, to_message("peer-other", "b", 1, {(9, 0): Figures(50, 0, 50)}).to_bytes())
        await nc.publish(subject, b'{"router_id": "peer-rogue", "boot": "b", "seq": 1, "ranks": [[9, 0, -5, 0, 0]]}')
        await nc.publish(subject, b"x" * (600 * 1024))
        for n in range(1, 30):  # 10 make the burst (2 x 5/s), then past the rate
            await nc.publish(subject, to_message("peer-rogue", "b", n, {(9, 0): Figures(1, 0, 1)}).to_bytes())
        await nc.flush()
        await wait_for(lambda: totals.get(("router_load", "rate_limited"), 0) >= 10)
        assert totals.get(("router_load", "subject_mismatch")) == 1
        assert totals.get(("router_load", "malformed")) == 1
        assert totals.get(("router_load", "oversized")) == 1
        applied = await router.runtime.scheduler.inspect(lambda s: (s.peers.peers(), s.peers.total((9, 0))))
        assert applied[0] == ["peer-rogue"] and applied[1] is not None and applied[1].requests == 1
    finally:
        await nc.close()
        await router.stop()
