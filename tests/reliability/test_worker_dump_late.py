"""A worker that does not answer its dump at once (here: stopped with SIGSTOP, as a worker whose
event loop stalls, or whose host is paused, is) when a router discovers it. The router asks for
the worker's full KV state on discovery; before, a dump that timed out was given up, so a router
started then never learnt the blocks the worker already held and predicted no cached tokens
where the worker had them. Now the dump is asked for again (docs/decisions.md 121): once the
worker resumes, the router's prediction is the worker's cache."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support_router.workers import (
    InProcessRouter,
    ask_cached,
    router_settings,
    wait_for,
    worker_process,
)

pytestmark = [pytest.mark.timeout(90)]

MODEL = "dump-late-model"
PROMPT = "a long shared system prompt that every request of this tenant starts with; " * 40


async def test_a_dump_that_does_not_come_at_once_is_asked_for_again(nats_url: str, tmp_path: Path) -> None:
    proc = worker_process(nats_url, MODEL, tmp_path / "worker.log", speedup=50)
    first = await InProcessRouter(router_settings(nats_url, MODEL, worker_ttl_s=30.0, worker_stale_s=10.0)).start()
    late: InProcessRouter | None = None
    try:
        await wait_for(lambda: first.runtime.scheduler.view.workers.get(MODEL) == 1, within=30)
        async with httpx.AsyncClient(base_url=first.url, timeout=10) as http:
            assert await ask_cached(http, MODEL, PROMPT) == (0, 0)  # computed once: the worker holds its blocks now

        os.killpg(proc.pid, signal.SIGSTOP)
        # A router that discovers the worker now: its dump request times out (1 s each). The
        # worker resumes right after the first; the three asks left span ~4.5 s.
        late = await InProcessRouter(router_settings(
            nats_url, MODEL, worker_ttl_s=30.0, worker_stale_s=10.0, kvdump_timeout_s=1.0,
            kvdump_min_interval_s=0.5)).start()
        dumper = late.runtime.kv.dumper
        await wait_for(lambda: dumper.missed >= 1, within=20)
        os.killpg(proc.pid, signal.SIGCONT)
        sched = late.runtime.scheduler

        async def loaded() -> bool:
            return await sched.inspect(lambda s: bool(s.index.workers()) and not s.dumps_pending())

        await wait_for(loaded, within=20)
        async with httpx.AsyncClient(base_url=late.url, timeout=10) as http:
            predicted, cached = await ask_cached(http, MODEL, PROMPT)
            assert predicted == cached > 0
            # Operators see it: the dumps that did not come are counted.
            metrics = (await http.get("/metrics")).text
        missed = [line for line in metrics.splitlines()
                  if line.startswith('rudder_router_kv_index_events_total{reason="dump_missed"}')]
        assert missed and float(missed[0].split()[-1]) >= 1, missed
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        for router in (late, first):
            if router is not None:
                await router.stop()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
