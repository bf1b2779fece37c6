"""A worker that crashes and comes back under its fixed instance id (compose gives each worker
one; a Kubernetes StatefulSet's pod index does) within the routers' TTL. The new process has an
empty cache and numbers its KV events from 1 again. Found by reading the router's membership
path: it took the new process's join as a heartbeat of the old one, so it kept the old process's
blocks in its prefix index and dropped every event of the new one as a duplicate of the old ids.
It routed by blocks the worker no longer held and never learnt the ones it had.

Here a real mock worker process is killed with SIGKILL (no leave) and started again with the same
instance id: the router predicts no cached tokens for what the dead process held, then exactly
what the new process reports once it has computed the prompt."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests import buskit
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = [pytest.mark.timeout(90)]

MODEL = "restart-model"
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "a document every conversation starts with; " * 60


def start_worker(nats_url: str, instance_id: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **buskit.worker_env(MODEL, instance_id),
           "RUDDER_NATS_URL": nats_url, "RUDDER_MODEL": MODEL, "RUDDER_PORT": "0",
           "RUDDER_HEARTBEAT_S": "0.2", "RUDDER_MOCK__SPEEDUP_RATIO": "50", "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "worker"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


async def _ask(http: httpx.AsyncClient, prompt: str = PROMPT) -> tuple[int, int]:
    """(tokens the router predicted cached, tokens the worker reports cached) for ``prompt``."""
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(r.headers["x-rudder-predicted-cached-tokens"]), int(details.get("cached_tokens") or 0)


async def test_a_worker_restarted_under_its_instance_id_is_routed_by_its_own_cache(
        nats_url: str, tmp_path: Path) -> None:
    instance_id = secrets.randbelow(2**63) + 1
    proc = start_worker(nats_url, instance_id, tmp_path / "first.log")
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
            assert await _ask(http) == (0, 0)
            await wait_for(lambda: blocks(), within=10)  # its KV events reached the index
            predicted, cached = await _ask(http)
            assert predicted == cached > 0
            first_url = await url()
            for _ in range(30):  # event ids well past the new process's first ones
                await http.post("/v1/completions", json={"model": MODEL, "prompt": f"{_} {PROMPT}", "max_tokens": 1})

            os.killpg(proc.pid, signal.SIGKILL)  # no leave: the router still lists it
            proc.wait(10)
            proc = start_worker(nats_url, instance_id, tmp_path / "second.log")

            async def restarted() -> bool:
                return (await url()) not in (None, first_url)

            await wait_for(restarted, within=30)
            # The dead process's blocks are not the new one's: nothing predicted, nothing cached.
            predicted, cached = await _ask(http)
            assert (predicted, cached) == (0, 0)
            # The new process's events (ids from 1 again) are taken: the prediction is its cache,
            # for a prompt the dead process never saw.
            await wait_for(lambda: blocks(), within=10)  # (the index was emptied at the restart)
            fresh = "another document, new since the restart; " * 60
            held = await blocks()
            assert await _ask(http, fresh) == (0, 0)

            async def indexed() -> bool:
                return await blocks() > held

            await wait_for(indexed, within=10)
            predicted, cached = await _ask(http, fresh)
            assert predicted == cached > 0
    finally:
        await router.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
