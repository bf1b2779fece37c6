"""A burst of KV events reaches the prefix index at the scheduler's pace, not one event a turn of the
event loop (router.consumers.KvEventSubscriber, docs/decisions.md 122). Real NATS, a real mock
worker publishing through its own agent, an in-process router."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from bus.client import Bus
from controlplane.protocol.events import KvEvent, KvStored, StoredBlock
from controlplane.protocol.subjects import kv_subject
from router import consumers
from router.commands import ApplyKvEvents
from tests import buskit
from tests.support_router.workers import routed_workers, wait_for

pytestmark = pytest.mark.timeout(60)


class _Submitting:
    """The KV subscriber's scheduler with its ``submit`` through ``submit`` (the scheduler's own
    methods cannot be replaced: its module is compiled, setup.py)."""

    def __init__(self, scheduler: Any, submit: Any) -> None:
        self._scheduler = scheduler
        self.submit = submit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def _publish_in_a_thread(nats_url: str, model: str, wid: int, payloads: list[bytes]) -> None:
    """Publish ``payloads`` with the worker's credential from a thread with its own event loop, as
    fast as it can: the burst arrives as a busy worker's would, not paced by the router's loop."""
    async def publish() -> None:
        bus = await Bus.connect(buskit.options(nats_url, buskit.worker_creds(model, wid)))
        try:
            for payload in payloads:
                await bus.publish(kv_subject(model, wid), payload)
            await bus.flush(5)
        finally:
            await bus.close()

    asyncio.run(publish())


async def test_a_burst_of_kv_events_reaches_the_scheduler_in_batches(
    nats_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2,000 events of the worker's, numbered after its last, published at once from another
    thread: all reach the index, in order (no gap), in commands of up to ``KV_BATCH`` events.
    Handed over one event a command, each awaited before the next message was read (2,000
    commands here), every event took at least two turns of the event loop (into the actor's queue,
    and its answer back): a loaded loop applied fewer events a second than the workers sent, and
    the rest piled up in nats-py's queue."""
    model = "org/kv-burst"
    n = 2000
    async with routed_workers(nats_url, model, 1, kv_event_bytes_per_s=64 * 2**20,
                              kv_event_burst_bytes=64 * 2**20) as (router, workers):
        worker = workers[0].worker
        sched = router.runtime.scheduler
        wid = worker.instance_id
        before = await sched.inspect(lambda s: s.index.blocks_of((wid, 0)))
        first = worker.last_event_id + 1
        worker.last_event_id += n  # the agent's next event follows the burst
        payloads = [KvEvent(instance_id=wid, event_id=first + i, started_at=worker.started_at,
                            data=KvStored(blocks=[StoredBlock(block_hash=2**40 + i, tokens_hash=i + 1)])).to_bytes()
                    for i in range(n)]
        commands: list[int] = []  # events per ApplyKvEvents command the scheduler was handed

        def counted(cmd: Any) -> Any:
            if isinstance(cmd, ApplyKvEvents):
                commands.append(len(cmd.events))
            return sched.submit(cmd)

        monkeypatch.setattr(router.runtime.kv, "scheduler", _Submitting(sched, counted))
        await asyncio.to_thread(_publish_in_a_thread, nats_url, model, wid, payloads)
        await wait_for(lambda: sched.inspect(lambda s: s.index.blocks_of((wid, 0)) >= before + n), within=30)
        assert sum(commands) == n
        assert len(commands) <= n // 10, f"{len(commands)} commands for {n} events"
        assert max(commands) <= consumers.KV_BATCH
        not_taken = await sched.inspect(lambda s: s.index.not_taken())
        assert not_taken.get("gap", 0) == 0, not_taken
        assert router.runtime.kv_backlog() == 0
        async with httpx.AsyncClient(base_url=router.url) as http:
            metrics = (await http.get("/metrics")).text
        assert "rudder_router_kv_events_backlog 0.0" in metrics


async def test_kv_events_past_the_backlog_are_dropped_and_counted_and_the_index_comes_back(
    nats_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backlog bound of 50 and a burst of 500: what does not fit is dropped (reason ``backlog``),
    and the gap it leaves asks for the worker's dump, which brings the index back to the
    worker's blocks."""
    monkeypatch.setattr(consumers, "KV_BACKLOG", 50)
    model = "org/kv-backlog"
    async with routed_workers(nats_url, model, 1, kv_event_bytes_per_s=64 * 2**20,
                              kv_event_burst_bytes=64 * 2**20) as (router, workers):
        worker = workers[0].worker
        sched = router.runtime.scheduler
        wid = worker.instance_id
        for i in range(500):
            worker._on_kv(0, KvStored(blocks=[StoredBlock(block_hash=2**41 + i, tokens_hash=i + 1)]))
        await wait_for(lambda: router.runtime.drops.totals.get(("kv", "backlog"), 0) > 0, within=30)
        # The next event reveals the gap; the worker's dump answers it. The mock engine's dump holds
        # its own cache (empty: it served nothing), not the blocks published here by hand, so once
        # the dump is in, the index holds what the worker then publishes, and nothing is pending.
        worker._on_kv(0, KvStored(blocks=[StoredBlock(block_hash=2**42, tokens_hash=1)]))
        await wait_for(lambda: sched.inspect(lambda s: s.index.not_taken().get("gap", 0) > 0), within=30)
        await wait_for(lambda: sched.inspect(lambda s: not s.index.dump_pending(wid)), within=30)
        worker._on_kv(0, KvStored(blocks=[StoredBlock(block_hash=2**43, tokens_hash=1)]))
        await wait_for(lambda: sched.inspect(lambda s: s.index.overlaps([2**43]).get((wid, 0)) is not None), within=30)
        assert router.runtime.kv_backlog() == 0
        assert await sched.inspect(lambda s: s.index.blocks_of((wid, 0))) == 1  # the dump's (none) and the last


async def test_a_batch_that_fails_in_the_scheduler_does_not_stop_the_next(
    nats_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the scheduler's KV handler fails its batch (logged), not the task that hands the
    backlog over: the worker's next events still reach the index (their gap asks for its dump)."""
    model = "org/kv-handler-bug"
    async with routed_workers(nats_url, model, 1) as (router, workers):
        worker = workers[0].worker
        sched = router.runtime.scheduler
        wid = worker.instance_id
        failed: list[int] = []

        def once_broken(cmd: Any) -> Any:
            if isinstance(cmd, ApplyKvEvents) and not failed:  # its handler's bug: the batch fails
                failed.append(len(cmd.events))
                broken: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                broken.set_exception(RuntimeError("a bug"))
                return broken
            return sched.submit(cmd)

        monkeypatch.setattr(router.runtime.kv, "scheduler", _Submitting(sched, once_broken))
        worker._on_kv(0, KvStored(blocks=[StoredBlock(block_hash=2**44, tokens_hash=1)]))
        await wait_for(lambda: bool(failed), within=10)
        # The next event is a gap (the failed one never reached the index): the worker's dump is
        # asked for and loaded. (The mock engine's dump holds its own cache, not the blocks
        # published here by hand: the event after the dump is the one to look for.)
        worker._on_kv(0, KvStored(blocks=[StoredBlock(block_hash=2**44 + 1, tokens_hash=2)]))
        await wait_for(lambda: sched.inspect(lambda s: s.index.not_taken().get("gap", 0) > 0), within=30)
        await wait_for(lambda: sched.inspect(lambda s: not s.index.dump_pending(wid)), within=30)
        worker._on_kv(0, KvStored(blocks=[StoredBlock(block_hash=2**45, tokens_hash=3)]))
        await wait_for(lambda: sched.inspect(lambda s: s.index.overlaps([2**45]).get((wid, 0)) is not None), within=30)
        assert failed == [1]
