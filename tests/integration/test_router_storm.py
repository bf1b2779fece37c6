"""A storm of streams that end every way a client can end them, at once, through one router in
front of a mock worker at a real pace: most chunks are pushed to the clients from the worker
connections' callbacks (router.cycle.DirectCycle.push), so every way out must also work from
there. Afterwards nothing is left booked, the worker runs nothing, the router's pool holds no
connection of an unfinished exchange, and the router serves as before."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import sys
from typing import Any

import httpx
import pytest

from tests.support_router.workers import (
    engine_idle,
    free_port,
    mock_answer,
    mock_workers,
    routed_workers,
    spawn_router,
    sse_events,
    wait_for,
    wait_http_ok,
)

pytestmark = pytest.mark.timeout(120)
MODEL = "storm/model:1b"
STREAMS = 60
TOKENS = 2_000  # ~3 s of generation at this pace: a stream the router does not cut runs on


async def post(port: int, body: dict[str, object],
               extra: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A completion request sent on a new connection (``extra``: more header lines)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                 + extra + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    await writer.drain()
    return reader, writer


def reset(writer: asyncio.StreamWriter) -> None:
    """Reset the connection (an RST, not a FIN)."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def stream(port: int, how: str, after: int, model: str = MODEL) -> bytes:
    """One streamed completion; the client reads ``after`` events and then: ``fin`` closes its
    connection, ``rst`` resets it, ``stall`` stops reading and closes a moment later; ``read``
    reads to the end."""
    reader, writer = await post(port, {"model": model, "prompt": f"storm {after} {how}",
                                       "max_tokens": 40 if how == "read" else TOKENS, "stream": True},
                                b"Connection: close\r\n")
    got = b""
    try:
        while how == "read" or got.count(b"data: ") < after:
            data = await asyncio.wait_for(reader.read(65536), 30)
            if not data:
                break
            got += data
        if how == "rst":
            reset(writer)
        elif how == "stall":
            await asyncio.sleep(0.05)  # holds the connection open, unread, for a moment
    finally:
        writer.close()  # fin (and the end of the others)
    return got


def _text(raw: bytes) -> str:
    """The completion's text from a whole chunked SSE answer."""
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    return "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1]) if c["choices"])


async def cut_at_once(router: Any, worker: Any) -> None:
    """Within 2 s of the clients' leaving: nothing booked at the router, nothing run by the worker."""
    loop = asyncio.get_running_loop()
    gone = loop.time()
    sched = router.runtime.scheduler
    await wait_for(lambda: sched.inspect(lambda s: len(s.bookings) == 0), within=10)
    await wait_for(lambda: engine_idle(worker), within=10)
    assert loop.time() - gone < 2.0


async def test_a_storm_of_streams_ended_every_way_leaves_nothing_behind(nats_url: str) -> None:
    rng = random.Random(16)
    plan = [(rng.choice(["fin", "rst", "stall"]), rng.randint(1, 100)) for _ in range(STREAMS)]
    async with routed_workers(nats_url, MODEL, 1, workers={"mock": {"speedup_ratio": 4.0}}) as (router, workers):
        port = router.settings.port
        results = await asyncio.gather(*(stream(port, how, after) for how, after in plan))
        assert all(raw.startswith(b"HTTP/1.1 200") for raw in results)
        # Every stream cut at the client is cut at the worker within a moment, not when its
        # generation would have ended (seconds later).
        await cut_at_once(router, workers[0])
        pools = router.runtime.http._pools.values()
        assert all(not c.active and not c.lost and c.sink is None for p in pools for c in p.idle)
        requests = router.runtime.metrics.requests
        assert requests.labels(MODEL, "/v1/completions", "499").value == STREAMS
        served = await stream(port, "read", 0)  # and the router serves as before
        assert _text(served) == mock_answer(40)


async def whole(port: int, wait_s: float, rst: bool) -> bytes:
    """One non-streamed completion whose client goes away after ``wait_s`` (its answer takes
    seconds: none of it has come), closing its connection or resetting it."""
    reader, writer = await post(port, {"model": MODEL, "prompt": f"whole {wait_s}", "max_tokens": TOKENS})
    try:
        return await asyncio.wait_for(reader.read(65536), wait_s)
    except TimeoutError:
        return b""
    finally:
        if rst:
            reset(writer)
        writer.close()


async def test_a_storm_of_non_streamed_requests_whose_clients_leave_leaves_nothing_behind(nats_url: str) -> None:
    """Non-streamed requests whose clients leave while they wait (queued for a selection, or for
    the worker's whole answer) are ended at once: the bookings freed, the worker stopped, each a
    499. They once held both until the answer nobody would read was computed."""
    rng = random.Random(17)
    plan = [(rng.uniform(0.0, 0.4), rng.random() < 0.5) for _ in range(STREAMS)]
    async with routed_workers(nats_url, MODEL, 1, workers={"mock": {"speedup_ratio": 4.0}}) as (router, workers):
        port = router.settings.port
        results = await asyncio.gather(*(whole(port, wait_s, rst) for wait_s, rst in plan))
        assert results == [b""] * STREAMS  # no answer came before the clients left
        await cut_at_once(router, workers[0])
        requests = router.runtime.metrics.requests
        await wait_for(lambda: requests.labels(MODEL, "/v1/completions", "499").value == STREAMS, within=5)
        served = await stream(port, "read", 0)  # and the router serves as before
        assert _text(served) == mock_answer(40)


async def test_streams_read_and_cut_through_a_router_as_deployed_on_uvloop(nats_url: str) -> None:
    """The same through ``rudder serve router`` (uvloop, whose transports are not asyncio's
    classes): streams read to the end arrive whole, streams cut are cut at the worker."""
    model = "storm/uvloop:1b"
    plan = [("read", 0)] * 8 + [("rst", k) for k in (1, 5, 20, 50)] + [("fin", k) for k in (2, 10, 30, 60)]
    async with mock_workers(nats_url, model, 1, mock={"speedup_ratio": 4.0}) as workers:
        port = free_port()
        proc = spawn_router(nats_url, model, port=port, router_id="r-storm-uvloop",
                            command=[sys.executable, "-m", "cli.main", "serve", "router"])
        try:
            await wait_http_ok(f"http://127.0.0.1:{port}/health")
            results = await asyncio.gather(*(stream(port, how, after, model) for how, after in plan))
            for (how, _), raw in zip(plan, results, strict=True):
                assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
                if how == "read":
                    assert _text(raw) == mock_answer(40)
            await wait_for(lambda: engine_idle(workers[0]), within=10)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            counted = {status: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                   if line.startswith("rudder_router_requests_total{")
                                   and f'status="{status}"' in line)
                       for status in ("200", "499")}
            assert counted == {"200": 8, "499": 8}
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 10)
