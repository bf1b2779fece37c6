"""The router's client to its workers, fuzzed (Hypothesis) with what a worker may answer: a worker's
credential can be stolen, and whatever comes back must end as the body it framed or as one of the
client's two errors, never another exception, a hang or a wrong body. Real sockets on loopback;
the response bytes are written in random pieces (the client must not depend on how TCP cuts
them), and taken by a sink that takes or refuses each read at random (the relay pushing to a
client that sometimes takes no bytes) and the reader."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.upstream import UpstreamBroken, UpstreamClient, UpstreamError

uvloop = pytest.importorskip("uvloop")

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Answer:
    raw: bytes  # what the worker writes
    body: bytes | None  # the body the client must return (None: it must raise UpstreamError)
    close: bool  # the worker closes the connection after writing
    extra: bytes = b""  # written after the answer, in the same write as its last piece


def _cuts(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@st.composite
def framed(draw: st.DrawFn) -> Answer:
    """A well-formed answer (chunked with extensions and trailers, by Content-Length, or by close),
    maybe followed by bytes that are no part of it (a second answer, noise): never its body."""
    answer = draw(_framed())
    if answer.close or not draw(st.booleans()):
        return answer
    extra = draw(st.one_of(st.binary(min_size=1, max_size=60),
                           st.just(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged")))
    return Answer(answer.raw, answer.body, close=False, extra=extra)


@st.composite
def _framed(draw: st.DrawFn) -> Answer:
    parts = draw(st.lists(st.binary(min_size=1, max_size=300), max_size=6))
    body = b"".join(parts)
    kind = draw(st.sampled_from(["chunked", "length", "close"]))
    status = draw(st.sampled_from([200, 400, 404, 500, 503]))
    head = f"HTTP/1.1 {status} X\r\nContent-Type: text/event-stream\r\n"
    if kind == "chunked":
        out = bytearray((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
        for part in parts:
            ext = b";ext=1" if draw(st.booleans()) else b""
            out += b"%x%s\r\n%s\r\n" % (len(part), ext, part)
        out += b"0\r\nX-Trailer: t\r\n\r\n" if draw(st.booleans()) else b"0\r\n\r\n"
        return Answer(bytes(out), body, close=False)
    if kind == "length":
        return Answer((head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body, body, close=False)
    return Answer((head + "Connection: close\r\n\r\n").encode() + body, body, close=True)


@st.composite
def broken(draw: st.DrawFn) -> Answer:
    """A well-formed answer cut short, an answer with a byte changed in its framing, or noise."""
    good = draw(_framed())
    how = draw(st.sampled_from(["cut", "noise", "bad-size"]))
    if how == "noise":
        return Answer(draw(st.binary(min_size=1, max_size=200)), None, close=True)
    if how == "bad-size" and b"Transfer-Encoding" in good.raw:
        head, _, rest = good.raw.partition(b"\r\n\r\n")
        return Answer(head + b"\r\n\r\nzz\r\n" + rest, None, close=True)
    if good.close:  # a close-framed body has no wrong length: cut inside its head instead
        head = good.raw.split(b"\r\n\r\n", 1)[0]
        return Answer(head[: draw(st.integers(1, len(head) - 1))], None, close=True)
    end = draw(st.integers(1, len(good.raw) - 1))
    return Answer(good.raw[:end], None, close=True)


async def exchange(answer: Answer, cuts: list[int], accepts: list[bool]) -> bytes | UpstreamError:
    """The body as the router's client gives it, through a sink that takes or refuses each read
    in turn as ``accepts`` says (a relay pushing to a client that sometimes takes no bytes), and
    the reader for the rest, in the order each got its part; none if ``accepts`` is empty."""
    served = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            await reader.readexactly(2)  # the body, b"{}"
            pieces = _cuts(answer.raw, cuts)
            pieces[-1] += answer.extra
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
            if answer.close:
                writer.close()
            else:
                await reader.read()  # keep the connection until the client is done
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            served.set()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = UpstreamClient(connect_timeout_s=2, read_timeout_s=2)
    try:
        resp = await client.open(url, "/", b"{}", {})
        got: list[bytes] = []
        if accepts:
            turns = itertools.cycle(accepts)

            def sink(data: bytes) -> bool:
                if next(turns):
                    got.append(data)
                    return True
                return False

            resp.sink = sink
        async for chunk in resp.aiter_raw():
            got.append(chunk)
        return b"".join(got)
    except UpstreamError as exc:
        return exc
    finally:
        await client.aclose()  # the worker's side sees the end and returns
        await asyncio.wait_for(served.wait(), 5)
        server.close()


def run(answer: Answer, cuts: list[int], accepts: list[bool]) -> list[bytes | UpstreamError]:
    """The exchange on asyncio's loop and on uvloop's (a router process runs on uvloop)."""
    results = [asyncio.run(asyncio.wait_for(exchange(answer, cuts, accepts), 10))]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results.append(runner.run(asyncio.wait_for(exchange(answer, cuts, accepts), 10)))
    return results


ACCEPTS = st.lists(st.booleans(), max_size=6)


@FUZZ
@given(framed(), st.lists(st.integers(0, 10_000), max_size=8), ACCEPTS)
def test_a_framed_answer_comes_back_as_its_body_however_tcp_cuts_it(
    answer: Answer, cuts: list[int], accepts: list[bool]
) -> None:
    assert run(answer, cuts, accepts) == [answer.body, answer.body]


@FUZZ
@given(broken(), st.lists(st.integers(0, 10_000), max_size=8), ACCEPTS)
def test_a_broken_answer_is_an_upstream_error_never_a_body_or_another_exception(
    answer: Answer, cuts: list[int], accepts: list[bool]
) -> None:
    for got in run(answer, cuts, accepts):
        assert isinstance(got, UpstreamError), got
        if answer.raw.startswith(b"HTTP/1.1 ") and b"\r\n\r\n" in answer.raw:
            assert isinstance(got, UpstreamBroken)  # the head arrived: not to be retried elsewhere
