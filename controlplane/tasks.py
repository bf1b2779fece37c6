"""The control plane's one helper for its background tasks."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel background tasks and wait for them to end (their errors were logged where they ran)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    tasks.clear()
