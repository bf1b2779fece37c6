"""The one task helper (bus/tasks.py): a death is reported, a stop ends every task, even one whose
callee swallowed the cancel (Python 3.11's asyncio.wait_for can, under nats-py's requests)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bus.tasks import Tasks, every

pytestmark = pytest.mark.timeout(20)


async def test_a_task_that_dies_is_reported_to_the_owner() -> None:
    deaths: list[str] = []
    tasks = Tasks("t", on_death=lambda task, exc: deaths.append(f"{task.get_name()}: {exc}"))

    async def boom() -> None:
        raise RuntimeError("no")

    tasks.spawn(boom(), name="boom")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert deaths == ["boom: no"]
    await tasks.close()


async def _swallows_one_cancel() -> None:
    """A callee that, like wait_for racing its answer, eats the cancel and returns normally."""
    try:
        await asyncio.sleep(0.05)
    except asyncio.CancelledError:
        return


async def test_close_ends_a_periodic_loop_whose_callee_swallowed_the_cancel() -> None:
    tasks = Tasks("t")
    calls = 0
    running = asyncio.Event()

    async def tick() -> None:
        nonlocal calls
        calls += 1
        if calls >= 3:
            running.set()
        await _swallows_one_cancel()

    task = tasks.spawn(every(0.0, tick, "tick"), name="tick")
    await asyncio.wait_for(running.wait(), 5)
    await asyncio.wait_for(tasks.close(), 5)
    assert task.done()


async def test_close_cancels_again_a_task_that_ignored_the_first_cancel() -> None:
    tasks = Tasks("t")
    seen: list[Any] = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                seen.append("cancel")
                if len(seen) == 1:
                    continue  # swallowed once
                raise

    tasks.spawn(stubborn(), name="stubborn")
    await asyncio.sleep(0.01)
    await asyncio.wait_for(tasks.close(), 5)
    assert seen == ["cancel", "cancel"]
