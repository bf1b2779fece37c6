"""A heterogeneous pool (issue 9): 4 mock workers of one model, two of them twice as slow
(``speedup_ratio`` halved). The same trace through ``kv-time``, ``kv-blocks`` and ``least_loaded``
routers over real NATS: the time cost, which knows each worker's own timing model, gets a better
mean and p90 TTFT than either blind cost. No setting tells it which workers are slow."""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests import buskit
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
MODEL = "mock/hetero"
SPEEDUP = 0.4  # the fast workers; the slow ones run at half of it
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()

worker_agent = pytest.importorskip("worker.agent")
worker_settings = pytest.importorskip("worker.settings")


@pytest.fixture(scope="module")
async def fleet(nats_url: str) -> AsyncIterator[dict[int, tuple[float, str]]]:
    stop = asyncio.Event()
    ready: list[Any] = []
    tasks = []
    for speedup in (SPEEDUP, SPEEDUP, SPEEDUP / 2, SPEEDUP / 2):
        settings = buskit.worker_settings(
            nats_url=nats_url, model=MODEL, heartbeat_s=0.25,
            mock=worker_settings.MockEngineSettings(speedup_ratio=speedup),
        )
        tasks.append(asyncio.create_task(worker_agent.serve(settings, stop=stop, on_ready=ready.append)))
    await wait_for(lambda: len(ready) == 4 or any(t.done() for t in tasks), within=20)
    for t in tasks:
        if t.done():
            t.result()
    yield {w.settings.instance_id: (w.settings.mock.speedup_ratio, w.url) for w in ready}
    stop.set()
    for t in tasks:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(t, 10)


def trace(seed: int = 11, n: int = 70, rate: float = 7.0) -> list[tuple[float, str]]:
    """(send time, prompt): unique prompts of 1500-3500 tokens (bytes), Poisson arrivals."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        words: list[str] = [f"request {i}"]
        size = rng.randrange(1500, 3500)
        while sum(len(w) + 1 for w in words) < size:
            words.append(rng.choice(WORDS))
        out.append((t, " ".join(words)[:size]))
    return out


async def replay(url: str, requests: list[tuple[float, str]]) -> tuple[list[float], Counter[str]]:
    ttfts: list[float] = []
    where: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
        t0 = time.perf_counter()

        async def one(at: float, prompt: str) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            sent = time.perf_counter()
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                where[resp.headers["x-worker-instance-id"]] += len(prompt)
                first = None
                async for line in resp.aiter_lines():
                    if first is None and line.startswith("data: ") and '"text":"' in line and '"text":""' not in line:
                        first = time.perf_counter() - sent
                assert first is not None
                ttfts.append(first)

        await asyncio.gather(*(one(at, prompt) for at, prompt in requests))
    return ttfts, where


async def idle(router: InProcessRouter) -> None:
    """Every worker reports no queued prefill and nothing running (the last run drained)."""
    def quiet(s: Any) -> bool:
        return all(not any(r.running or r.waiting or r.active_prefill_tokens for r in st.load.values())
                   for st in s.discovery.workers.values())
    await wait_for(lambda: router.runtime.scheduler.inspect(quiet), within=30, interval=0.1)


async def reset_caches(urls: list[str]) -> None:
    """Cold caches for each mode (the same prompts would hit what the last mode left)."""
    async with httpx.AsyncClient() as client:
        for url in urls:
            resp = await client.post(url + "/reset_prefix_cache", timeout=5)
            assert resp.status_code == 200, resp.text


async def test_time_cost_beats_blind_costs_on_a_mixed_pool(
    nats_url: str, fleet: dict[int, tuple[float, str]]
) -> None:
    requests = trace()
    results: dict[str, tuple[float, float, Counter[str]]] = {}
    for mode in ("kv-time", "kv-blocks", "least_loaded"):
        router = await InProcessRouter(router_settings(nats_url, MODEL, mode=mode)).start()
        try:
            await wait_for(lambda r=router: r.runtime.scheduler.view.workers.get(MODEL) == 4, within=10)
            await idle(router)
            await reset_caches([url for _, url in fleet.values()])
            ttfts, where = await replay(router.url, requests)
        finally:
            await router.stop()
        assert len(ttfts) == len(requests)
        ttfts.sort()
        results[mode] = (statistics.fmean(ttfts), ttfts[int(0.9 * len(ttfts))], where)
    slow = {str(w) for w, (speedup, _) in fleet.items() if speedup < SPEEDUP}

    def slow_share(where: Counter[str]) -> float:
        return sum(v for k, v in where.items() if k in slow) / sum(where.values())

    summary = {m: (round(r[0] * 1e3), round(r[1] * 1e3), round(slow_share(r[2]), 2)) for m, r in results.items()}
    print("summary (mean ms, p90 ms, slow share):", summary)
    mean, p90, where = results["kv-time"]
    for other in ("kv-blocks", "least_loaded"):
        assert mean < results[other][0] and p90 < results[other][1], summary  # (mean, p90 ms, slow share)
    # It knows which workers are slow: less of the work goes there than with the blind block cost.
    assert slow_share(where) < slow_share(results["kv-blocks"][2]), summary
