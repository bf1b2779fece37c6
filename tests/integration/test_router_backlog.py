"""A router whose scheduler actor is far behind: its workers' heartbeats still count.

Found by an open-loop load test at twice a fleet's capacity (docs/decisions.md 107): thousands of
requests' commands queued in the actor, every heartbeat waited behind them, the router read its
workers' silence into its own backlog and answered "no worker available" to a fleet that was
serving. Here the backlog is made directly (commands that take 10 ms each, longer in all than a
worker's staleness bound) in front of two mock workers at their real heartbeat pace."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from router.commands import Inspect
from router.discovery import Health
from router.scheduler import Scheduler
from tests.support_router.workers import routed_workers

pytestmark = pytest.mark.timeout(60)
MODEL = "backlog/model:1b"


async def test_a_backlog_longer_than_the_staleness_bound_leaves_every_worker_live(nats_url: str) -> None:
    """For three staleness bounds the actor is kept 1.5 bounds behind (commands of 10 ms, topped
    up as they are handled): every heartbeat meanwhile arrives on time and would be applied that
    late. The workers stay live throughout, and requests sent meanwhile, each queued behind the
    backlog, are served."""
    async with routed_workers(nats_url, MODEL, 2) as (router, _workers):
        scheduler = router.runtime.scheduler
        stale_s = router.settings.worker_stale_s
        behind = int(stale_s * 1.5 / 0.01)

        def slow_look(s: Scheduler) -> list[Health]:
            time.sleep(0.01)
            now = s.clock()
            return [s.discovery.health(state, now) for state in s.discovery.workers.values()]

        looks: list[asyncio.Future[list[Health]]] = []
        loop = asyncio.get_running_loop()
        until = loop.time() + 3 * stale_s

        async def keep_behind() -> None:
            while loop.time() < until:
                while sum(not f.done() for f in looks[-behind:]) < behind:
                    looks.append(scheduler.submit(Inspect(slow_look)))
                await asyncio.sleep(0.01)

        async def requests() -> list[httpx.Response]:
            answers = []
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.settings.port}", timeout=30) as client:
                while loop.time() < until:
                    answers.append(await client.post(
                        "/v1/completions", json={"model": MODEL, "prompt": "behind", "max_tokens": 2}))
            return answers

        _, answers = await asyncio.gather(keep_behind(), requests())
        seen = await asyncio.gather(*looks)
        assert len(answers) >= 2 and all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert all(health == [Health.LIVE, Health.LIVE] for health in seen), (
            f"{sum(h != [Health.LIVE, Health.LIVE] for h in seen)} of {len(seen)} looks saw a worker not live")
