"""What the holder of a stolen worker credential publishes, for the claims tests
(tests/integration/test_worker_claims.py) and the flood benchmark (bench/flood.py).

Messages are built once and re-stamped, so the publisher's own CPU goes to publishing: a
heartbeat flood re-sends one forged membership record; a KV flood re-sends a few ``stored``
events of thousands of blocks the worker never computed, each with a fresh event id (a repeated
id would be dropped as a duplicate, not indexed). :func:`publishing` runs a publish step in a
loop on a connection already made with the hostile worker's credential, until its block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from controlplane.protocol.events import KvEvent, KvStored, MembershipEvent, MembershipOp, StoredBlock, WorkerRecord
from controlplane.protocol.subjects import kv_subject, membership_subject

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS


def forged_heartbeat(record: WorkerRecord, **update: Any) -> bytes:
    """A heartbeat carrying ``record`` with ``update`` applied (``dp_size=1024``, a zero prior...)."""
    rec = record.model_copy(update=update)
    return MembershipEvent(op=MembershipOp.HEARTBEAT, worker=rec, at=datetime.now(UTC)).to_bytes()


class KvFlood:
    """``stored`` events of ``blocks`` claimed blocks each (``templates`` distinct block sets,
    together more than a small cap), re-sent with fresh event ids."""

    def __init__(self, instance_id: int, *, blocks: int = 2000, templates: int = 3) -> None:
        self.templates = [KvEvent(instance_id=instance_id, event_id=0, data=KvStored(blocks=[
            StoredBlock(block_hash=k * blocks + i + 1, tokens_hash=i) for i in range(blocks)])).to_bytes()
            for k in range(templates)]
        self.blocks = blocks
        self._ids = itertools.count(1_000_000)
        self._turn = itertools.count()

    def next(self) -> bytes:
        data = self.templates[next(self._turn) % len(self.templates)]
        return data.replace(b'"event_id":0,', f'"event_id":{next(self._ids)},'.encode(), 1)


def heartbeat_step(nc: NATS, model: str, instance_id: int, beat: bytes, *,
                   per_step: int = 500) -> Callable[[], Awaitable[None]]:
    """One step of a heartbeat flood: ``per_step`` forged heartbeats (500 per 50 ms: ~10k/s)."""
    subject = membership_subject(model, instance_id)

    async def step() -> None:
        for _ in range(per_step):
            await nc.publish(subject, beat)

    return step


def kv_step(nc: NATS, model: str, instance_id: int, flood: KvFlood, *,
            per_step: int = 20) -> Callable[[], Awaitable[None]]:
    """One step of a KV flood: ``per_step`` events of ``flood.blocks`` claimed blocks each."""
    subject = kv_subject(model, instance_id)

    async def step() -> None:
        for _ in range(per_step):
            await nc.publish(subject, flood.next())

    return step


STOP_WITHIN_S = 10.0


async def close_within(nc: NATS, what: str) -> None:
    """Close a test's own NATS connection, bounded: a close that hangs (its flush behind a flood)
    is reported as a warning, not a test held to its timeout."""
    try:
        await asyncio.wait_for(nc.close(), STOP_WITHIN_S)
    except TimeoutError:
        warnings.warn(f"{what}: its NATS connection did not close within {STOP_WITHIN_S:.0f} s", stacklevel=2)


@contextlib.asynccontextmanager
async def publishing(step: Callable[[], Awaitable[None]], *, pause_s: float = 0.05) -> AsyncIterator[None]:
    """Run ``step()`` then sleep ``pause_s``, again and again, until the block ends."""

    async def loop() -> None:
        while True:
            await step()
            await asyncio.sleep(pause_s)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        # Bounded: a step stuck past its cancellation names itself here rather than holding the
        # test to its timeout.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, STOP_WITHIN_S)
