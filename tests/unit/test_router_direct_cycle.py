"""The router's request cycle (router.cycle.DirectCycle): a response head written with the
first body message, a head alone written at the end of the loop's turn, and disconnect callbacks
in place of a task per request waiting for ``http.disconnect`` (issue 16). The protocol is
driven as uvicorn drives it, with a transport that records every write."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse
from uvicorn.server import ServerState

from controlplane.protocol.errors import ClientGone
from router.api import RelayResponse, _ClientWatch, _select, error_response
from router.commands import RoutingRequest
from router.cycle import HOLD, disconnect_hook, push_hook
from router.ingress import GuardedHttpProtocol, IngressLimits, protocol_class
from router.metrics import RouterMetrics

pytestmark = pytest.mark.timeout(30)

ROUTING = RoutingRequest(request_id="r", model="m", prompt_tokens=1, hashes={})
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}"


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def serve(app: Callable[..., Any]) -> tuple[GuardedHttpProtocol, Transport, ServerState]:
    config = uvicorn.Config(app, log_config=None, lifespan="off")
    config.load()
    limits = IngressLimits(max_connections=10, max_header_bytes=8192, header_timeout_s=5,
                           body_timeout_s=5, write_timeout_s=5,
                           render=lambda exc: error_response(exc))
    state = ServerState()
    protocol = protocol_class(limits)(config=config, server_state=state, app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport, state


async def finished(state: ServerState) -> None:
    await asyncio.gather(*list(state.tasks))


async def test_the_head_goes_out_with_the_first_body_message() -> None:
    protocol, transport, state = serve(JSONResponse({"ok": True}))
    protocol.data_received(REQUEST)
    await finished(state)
    assert len(transport.writes) == 1, transport.writes
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 11" in head
    assert body == b'{"ok":true}'


async def test_an_answer_to_head_is_its_head_alone() -> None:
    """uvicorn writes no body for HEAD (a load balancer's health check may use it): the held
    head still goes out, once."""
    protocol, transport, state = serve(JSONResponse({"ok": True}))
    protocol.data_received(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")
    await finished(state)
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(transport.writes) == 1, transport.writes
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK") and transport.writes[0].endswith(b"\r\n\r\n")
    assert not transport.closed  # kept alive


async def test_pipelined_requests_are_answered_in_order_each_head_with_its_body() -> None:
    answered = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(0.01 if scope["path"] == "/a" else 0)  # the first is the slower
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        if scope["path"] == "/b":
            answered.set()

    protocol, transport, state = serve(app)
    second = REQUEST.replace(b"/v1/completions", b"/b")
    protocol.data_received(REQUEST.replace(b"/v1/completions", b"/a") + second)
    await asyncio.wait_for(answered.wait(), 5)
    await finished(state)
    assert [w.rpartition(b"\r\n\r\n")[2] for w in transport.writes] == [b"/a", b"/b"]
    assert all(w.startswith(b"HTTP/1.1 200 OK") for w in transport.writes)


async def test_a_streamed_answer_is_its_head_and_first_chunk_then_one_write_a_chunk() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False})

    protocol, transport, state = serve(app)
    protocol.data_received(REQUEST)
    await finished(state)
    assert len(transport.writes) == 2, transport.writes
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert transport.writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert transport.writes[1] == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"


async def test_push_writes_a_chunk_at_once_only_where_a_body_message_could_go_without_waiting() -> None:
    """``push`` (scope extension): nothing before the head, a chunk taken once it is rendered
    and written with what follows in the same turn (with a held head, or before the next body
    message), nothing while the client takes no bytes (the relay then sends and waits), nothing
    once the answer is complete."""
    results: list[bool] = []
    protocol: GuardedHttpProtocol

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        push = push_hook(scope)
        assert push is not None
        results.append(push(b"early"))  # no head yet
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        results.append(push(b"held"))  # goes after the held head
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        results.append(push(b"data: 2\n\n"))
        protocol.pause_writing()  # the client's buffers are full
        results.append(push(b"data: 3\n\n"))
        protocol.resume_writing()
        await send({"type": "http.response.body", "body": b"data: 3\n\n", "more_body": False})
        results.append(push(b"after the end"))

    protocol, transport, state = serve(app)
    protocol.data_received(REQUEST)
    await finished(state)
    for _ in range(3):
        await asyncio.sleep(0)  # a flush scheduled by a push writes nothing more
    assert results == [False, True, True, False, False]
    assert len(transport.writes) == 2, transport.writes
    assert transport.writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n4\r\nheld\r\n9\r\ndata: 1\n\n\r\n")
    assert transport.writes[1] == b"9\r\ndata: 2\n\n\r\n9\r\ndata: 3\n\n\r\n0\r\n\r\n"
    assert push_hook({"type": "http"}) is None  # another server: the relay sends every chunk


async def test_chunks_pushed_in_one_turn_go_out_in_one_write_at_its_end() -> None:
    seen: list[list[bytes]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        push = push_hook(scope)
        assert push is not None
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        assert push(b"b") and push(b"c")
        seen.append(list(transport.writes))
        for _ in range(3):
            await asyncio.sleep(0)
        seen.append(list(transport.writes))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    protocol, transport, state = serve(app)
    protocol.data_received(REQUEST)
    await finished(state)
    assert len(seen[0]) == 1 and seen[1][1:] == [b"1\r\nb\r\n1\r\nc\r\n"]
    assert transport.writes[2:] == [b"0\r\n\r\n"]


async def _head_then_a_late_body(start: dict[str, Any]) -> tuple[list[bytes], list[bytes]]:
    """An app that sends ``start`` and then waits before its body: (what was written while it
    waited, everything written)."""
    go = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send(start)
        await go.wait()
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    protocol, transport, state = serve(app)
    protocol.data_received(REQUEST)
    for _ in range(5):
        await asyncio.sleep(0)
    waiting = list(transport.writes)
    go.set()
    await finished(state)
    return waiting, transport.writes


async def test_a_head_with_no_body_yet_is_written_at_the_end_of_the_turn() -> None:
    """The app sends the head and then waits: the client gets the head meanwhile."""
    waiting, writes = await _head_then_a_late_body({"type": "http.response.start", "status": 200, "headers": []})
    assert len(waiting) == 1 and waiting[0].startswith(b"HTTP/1.1 200 OK")
    assert writes[1:] == [b"4\r\nlate\r\n0\r\n\r\n"]


async def test_a_held_head_waits_for_the_first_body_message_and_goes_with_it() -> None:
    """A start message with HOLD (the relay's, sent while the worker computes its first token)
    is rendered at once and written only with the first body message, in one write."""
    waiting, writes = await _head_then_a_late_body(
        {"type": "http.response.start", "status": 200, "headers": [], HOLD: True})
    assert waiting == []
    assert len(writes) == 1, writes
    assert writes[0].startswith(b"HTTP/1.1 200 OK")
    assert writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n4\r\nlate\r\n0\r\n\r\n")


async def test_the_relay_renders_its_head_before_the_first_chunk_and_writes_both_at_once() -> None:
    """Under the router's server the relay's head is rendered while the first chunk is awaited
    (off the path of the first token) and goes out with it."""
    first = asyncio.Event()
    parts = [b"data: 1\n\n", None]

    async def body() -> bytes | None:
        await first.wait()
        return parts.pop(0)

    async def closed() -> None:
        pass

    async def app(scope: Any, receive: Any, send: Any) -> None:
        relay = RelayResponse(body, status_code=200, media_type="text/event-stream", headers={},
                              on_disconnect=lambda: None, on_close=closed, push_from=lambda push: None)
        await relay(scope, receive, send)

    protocol, transport, state = serve(app)
    protocol.data_received(REQUEST)
    for _ in range(5):
        await asyncio.sleep(0)
    assert protocol.cycle is not None and protocol.cycle.response_started  # rendered
    assert transport.writes == []  # and held
    first.set()
    await finished(state)
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert transport.writes[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")


async def test_disconnect_callbacks_run_once_when_the_client_goes_and_at_once_after() -> None:
    ran: list[str] = []
    registered = asyncio.Event()
    hooks: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        hook = disconnect_hook(scope)
        assert hook is not None
        hooks.append(hook)
        hook(lambda: ran.append("a"))
        remove = hook(lambda: ran.append("removed"))
        remove()
        registered.set()
        while (await receive())["type"] != "http.disconnect":
            pass

    protocol, _, state = serve(app)
    protocol.data_received(REQUEST)
    await registered.wait()
    protocol.connection_lost(None)
    await finished(state)
    assert ran == ["a"]
    hooks[0](lambda: ran.append("late"))  # the client is gone already: runs at once
    assert ran == ["a", "late"]
    assert disconnect_hook({"type": "http"}) is None  # another server: the app watches receive()


class Scheduler:
    """What ``_select`` asks of a busy scheduler: no selection at once, a future for it queued."""

    def __init__(self) -> None:
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        self.sent: list[Any] = []

    def select_now(self, request: Any) -> None:
        return None

    def submit(self, command: Any) -> asyncio.Future[Any]:
        return self.future

    def send(self, command: Any) -> None:
        self.sent.append(command)


async def _watched_select(request: Request, rt: Any) -> Any:
    """A selection under the request's watch of its client, as ``_completion`` makes it."""
    with _ClientWatch(request):
        return await _select(rt, ROUTING)


async def test_a_client_gone_while_its_selection_is_queued_cancels_the_selection() -> None:
    gone: list[Callable[[], None]] = []
    hooked = asyncio.Event()

    def hook(callback: Callable[[], None]) -> Callable[[], None]:
        gone.append(callback)
        hooked.set()
        return lambda: None

    rt: Any = SimpleNamespace(scheduler=Scheduler(), metrics=RouterMetrics())
    request = Request({"type": "http", "extensions": {"rudder.disconnect": {"on_disconnect": hook}}})

    async def queued() -> asyncio.Task[Any]:
        """A new request's selection, waiting in a new (busy) scheduler's queue."""
        gone.clear()
        rt.scheduler = Scheduler()
        task = asyncio.create_task(_watched_select(request, rt))
        await hooked.wait()
        await asyncio.sleep(0)
        return task

    task = await queued()
    gone[0]()
    with pytest.raises(ClientGone):
        await task
    assert rt.scheduler.future.cancelled()  # the actor skips it
    assert task.cancelling() == 0  # the cancellation was taken back

    # The router stopping (the request's task cancelled) is not a client gone.
    task = await queued()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # Nor is the router stopping after the client went: both cancellations stand.
    task = await queued()
    gone[0]()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # The actor had made the selection when the client went (the request's task not yet
    # resumed with it): its booking is freed, not left to nobody.
    task = await queued()
    rt.scheduler.future.set_result(SimpleNamespace(booking_id="made"))
    gone[0]()
    with pytest.raises(ClientGone):
        await task
    assert [(type(c).__name__, c.request_id) for c in rt.scheduler.sent] == [("RequestDone", "made")]

    # A client gone before the watch starts: a ClientGone at once, nothing selected.
    def gone_already(callback: Callable[[], None]) -> Callable[[], None]:
        callback()
        return lambda: None

    rt.scheduler = Scheduler()
    left = Request({"type": "http", "extensions": {"rudder.disconnect": {"on_disconnect": gone_already}}})
    with pytest.raises(ClientGone):
        await _watched_select(left, rt)
    assert not rt.scheduler.future.done()
