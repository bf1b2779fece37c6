"""``rudder up``'s stop signal reaches its cleanup wherever it lands: inside an ``except
Exception`` or an event loop (its NATS store probe runs one), it is not taken for an error and
dropped. (It was an ``Exception``: a SIGTERM that arrived during a probe was lost, the handler had
already switched to ignoring further signals, and ``rudder up --ha`` ran on.)"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from cli import up


@pytest.fixture
def stop_handler() -> Iterator[None]:
    previous = {sig: signal.signal(sig, up._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_stop_inside_a_broad_except_in_an_event_loop_still_stops(stop_handler: None) -> None:
    async def probe() -> str:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.5)  # the handler runs here, inside the loop
        except Exception:
            return "taken for an error"
        return "not delivered"

    with pytest.raises(up._StopRequested):
        asyncio.run(probe())


def test_a_stop_raised_in_a_loop_callback_is_not_dropped(stop_handler: None) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(os.kill, os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.5)

    with pytest.raises(up._StopRequested):
        asyncio.run(main())
