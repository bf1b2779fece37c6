"""A worker that crashes and comes back under its fixed instance id (compose gives each worker
one; a Kubernetes StatefulSet's pod index does) within the routers' TTL. The new process has an
empty cache and numbers its KV events from 1 again. Found by reading the router's membership
path: it took the new process's join as a heartbeat of the old one, so it kept the old process's
blocks in its prefix index and dropped every event of the new one as a duplicate of the old ids.
It routed by blocks the worker no longer held and never learnt the ones it had.

Here a real mock worker process is killed with SIGKILL (no leave) and started again with the same
instance id: the router predicts no cached tokens for what the dead process held, then exactly
what the new process reports once it has computed the prompt, and a late KV event of the dead
process (stamped with its start, KV schema 2) is not taken for the new one's."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from bus.identities import Identity, IdentityKind
from controlplane.protocol.events import KvEvent, KvStored, StoredBlock
from controlplane.protocol.subjects import kv_subject
from router.scheduler import Scheduler
from tests import buskit
from tests.support_router.workers import (
    InProcessRouter,
    ask_cached,
    router_settings,
    wait_for,
    worker_process,
)

pytestmark = [pytest.mark.timeout(90)]

MODEL = "restart-model"
PROMPT = "a document every conversation starts with; " * 60


GHOST = 0xD0D0


async def _late_event(nats_url: str, instance_id: int, started_at: datetime) -> None:
    """A KV event the process started at ``started_at`` sent before it died, arriving now."""
    event = KvEvent(instance_id=instance_id, event_id=10_000, started_at=started_at,
                    data=KvStored(blocks=[StoredBlock(block_hash=GHOST, tokens_hash=GHOST)]))
    nc = await buskit.connect_as(nats_url, Identity(IdentityKind.WORKER, model=MODEL, instance_id=instance_id))
    try:
        await nc.publish(kv_subject(MODEL, instance_id), event.to_bytes())
        await nc.flush()
    finally:
        await nc.close()


async def test_a_worker_restarted_under_its_instance_id_is_routed_by_its_own_cache(
        nats_url: str, tmp_path: Path) -> None:
    instance_id = secrets.randbelow(2**63) + 1
    proc = worker_process(nats_url, MODEL, tmp_path / "first.log", instance_id=instance_id, speedup=50)
    # The TTL is long enough that the restart comes well within it (as a pod restart does).
    router = await InProcessRouter(router_settings(nats_url, MODEL, worker_ttl_s=30.0, worker_stale_s=5.0)).start()
    sched = router.runtime.scheduler
    key = (instance_id, 0)

    async def url() -> str | None:
        return await sched.inspect(lambda s: s.discovery.workers[instance_id].record.url
                                   if instance_id in s.discovery.workers else None)

    async def blocks() -> int:
        return await sched.inspect(lambda s: s.index.blocks_of(key))

    try:
        await wait_for(lambda: sched.view.workers.get(MODEL) == 1, within=30)
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as http:
            assert await ask_cached(http, MODEL, PROMPT) == (0, 0)
            await wait_for(lambda: blocks(), within=10)  # its KV events reached the index
            predicted, cached = await ask_cached(http, MODEL, PROMPT)
            assert predicted == cached > 0
            first_url = await url()
            first_started_at = await sched.inspect(lambda s: s.discovery.workers[instance_id].record.started_at)
            for _ in range(30):  # event ids well past the new process's first ones
                await http.post("/v1/completions", json={"model": MODEL, "prompt": f"{_} {PROMPT}", "max_tokens": 1})

            os.killpg(proc.pid, signal.SIGKILL)  # no leave: the router still lists it
            proc.wait(10)
            proc = worker_process(nats_url, MODEL, tmp_path / "second.log", instance_id=instance_id, speedup=50)

            async def restarted() -> bool:
                return (await url()) not in (None, first_url)

            await wait_for(restarted, within=30)
            # The dead process's blocks are not the new one's: nothing predicted, nothing cached.
            predicted, cached = await ask_cached(http, MODEL, PROMPT)
            assert (predicted, cached) == (0, 0)
            await wait_for(lambda: blocks(), within=10)  # (the index was emptied at the restart)
            await wait_for(lambda: sched.inspect(lambda s: not s.index.dump_pending(instance_id)), within=10)
            # A KV event of the dead process that reaches the router only now (its KV
            # subscription lagged), with an id far above the new process's: not applied.
            refused = await sched.inspect(lambda s: s.index.other_process)
            await _late_event(nats_url, instance_id, first_started_at)

            def ghost(s: Scheduler) -> bool:
                return (instance_id, 0) in s.index.overlaps([GHOST])

            async def handled() -> bool:  # refused, or (the bug) applied
                return await sched.inspect(lambda s: s.index.other_process > refused or ghost(s))

            await wait_for(handled, within=10)
            assert not await sched.inspect(ghost)
            metrics = (await http.get("/metrics")).text
            assert 'rudder_router_kv_index_events_total{reason="other_process"}' in metrics
            # The new process's events (ids from 1 again) are taken: the prediction is its cache,
            # for a prompt the dead process never saw.
            fresh = "another document, new since the restart; " * 60
            held = await blocks()
            assert await ask_cached(http, MODEL, fresh) == (0, 0)

            async def indexed() -> bool:
                return await blocks() > held

            await wait_for(indexed, within=10)
            predicted, cached = await ask_cached(http, MODEL, fresh)
            assert predicted == cached > 0
    finally:
        await router.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
