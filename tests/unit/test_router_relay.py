"""The relay's trimmed hot path (issue 16): the worker's body spliced instead of re-encoded, the
answer's last chunk and its end in one ASGI message, the upstream response's end seen as its last
chunk arrives. Real sockets on loopback for the upstream client; the relay driven through ASGI."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from router.api import RelayResponse
from router.commands import NO_REVISIONS, Selection
from router.requestwork import target_body
from router.upstream import UpstreamBroken, UpstreamClient

pytestmark = pytest.mark.timeout(30)

SEL = Selection("r", "m", 12345, 2, "http://w", NO_REVISIONS, 1, None, 0, 0, 0, 0)


@pytest.mark.parametrize("raw", [
    b'{"model":"m","prompt":"hi","stream":true}', b'  {"a": [1, 2], "b": {"c": null}}\n', b"{}",
    b'{"nvext":{"ttft_slo_ms":5}}', '{"prompt":"héllo"}'.encode(),
])
def test_the_target_body_is_the_clients_with_the_target_whether_spliced_or_encoded(raw: bytes) -> None:
    body = json.loads(raw)
    spliced = target_body(body, SEL, raw=bytearray(raw))
    encoded = target_body(body, SEL)
    assert json.loads(spliced) == json.loads(encoded) == {
        **body, "nvext": {**body.get("nvext", {}), "backend_instance_id": 12345, "dp_rank": 2}}
    if "nvext" not in body:
        assert spliced.startswith(raw.strip()[:-1])  # the client's bytes, not a re-encoding


def test_a_body_in_utf16_is_encoded_not_spliced() -> None:
    raw = json.dumps({"prompt": "x"}).encode("utf-16-be")
    body = json.loads(raw)
    out = target_body(body, SEL, raw=raw)
    assert json.loads(out) == {"prompt": "x", "nvext": {"backend_instance_id": 12345, "dp_rank": 2}}


async def relay_messages(chunks: list[bytes], last_after: int | None) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    done = asyncio.Event()
    n = 0

    parts = iter(chunks)

    async def body() -> bytes | None:
        nonlocal n
        part = next(parts, None)
        if part is not None:
            n += 1
        return part

    async def receive() -> dict[str, Any]:
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def closed() -> None:
        done.set()

    resp = RelayResponse(body, status_code=200, media_type="text/event-stream", headers={},
                         on_disconnect=lambda: None, on_close=closed,
                         last=lambda: last_after is not None and n >= last_after)
    await resp({"type": "http"}, receive, send)
    return sent


async def test_the_last_chunk_ends_the_answer_in_the_same_message() -> None:
    sent = await relay_messages([b"data: a\n\n", b"data: [DONE]\n\n"], last_after=2)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"data: a\n\n", True), (b"data: [DONE]\n\n", False)]
    # Not known to be the last (a body framed by the connection's close): an empty end follows.
    sent = await relay_messages([b"x", b"y"], last_after=None)
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"x", True), (b"y", True), (b"", False)]


async def test_the_upstream_response_is_complete_as_its_last_chunk_comes() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"4\r\nlast\r\n0\r\n\r\n")  # the last data and the end in one read
        await writer.drain()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    c = UpstreamClient(connect_timeout_s=1, read_timeout_s=2)
    try:
        resp = await c.open(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "/", b"", {})
        seen = [(chunk, resp.complete) async for chunk in resp.aiter_raw()]
        assert seen == [(b"first", False), (b"last", True)]
    finally:
        await c.aclose()
        server.close()


async def test_a_worker_silent_mid_body_times_out_and_a_slow_consumer_does_not() -> None:
    """The body's read timeout (one timer per response): a worker that stops sending after its
    first chunk breaks the stream after about the timeout; a consumer slower than the timeout
    between chunks that the worker already sent does not."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.sleep(5 if b"/stall" in line else 0.05)  # /stall: the client must give up first
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    c = UpstreamClient(connect_timeout_s=1, read_timeout_s=0.3)
    try:
        resp = await c.open(url, "/stall", b"", {})
        got = []
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamBroken, match="TimeoutError"):
            async for chunk in resp.aiter_raw():
                got.append(chunk)
        assert got == [b"first"]
        assert 0.25 <= asyncio.get_running_loop().time() - t0 < 2.0
        resp = await c.open(url, "/quick", b"", {})
        slow = []
        async for chunk in resp.aiter_raw():
            slow.append(chunk)
            await asyncio.sleep(0.5)  # longer than the timeout, between chunks already sent
        assert b"".join(slow) == b"firstsecond"
    finally:
        await c.aclose()
        server.close()
