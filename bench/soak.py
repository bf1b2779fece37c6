"""Soak: one ``kv`` router under a hostile mix of clients; afterwards, nothing of them left in it.

One embedded nats-server, ``--workers`` mock workers (``--speedup``) and one ``kv`` router, all on
127.0.0.1. ``--rounds`` rounds of ``--seconds`` each, in which ``--clients`` client loops pick one
behaviour after another at random:

- a streamed completion, a non-streamed completion, a streamed chat completion, read to the end
  (a 200; a stream with ``[DONE]``, usage and no error event);
- a stream closed after its first chunk; half a body sent, then closed; a request sent and closed
  at once; a long stream (2,000 tokens) closed as soon as its head came;
- malformed JSON (400), an unknown model (404), no prompt (400), JSON nested past the parser's
  depth, a lone surrogate in the prompt, a ``stream`` neither true nor false (400 each), each in
  the OpenAI error shape; a streamed completion offering ``Upgrade: h2c`` (a 200, read to its end);
- pinned to a worker (``nvext.backend_instance_id``: answered by that worker), or to a worker or
  a rank that does not exist, or with a malformed ``nvext`` (a 4xx, never a 500).

After each round (and each probe) the router's ``rudder_router_requests_in_flight`` must come
back to 0, the workers must run and queue nothing and the router must hold no connection whose
client closed its end (polled, 15 s at most); the router's fds and RSS are recorded and must not
grow from the first round to the last past a slack (the first round fills its pools and caches).

Probes, each of a way a client can hold on to a router (the first three found bugs, as the rounds
did: bookings left by clients that went away while their worker was being selected; run against
the router of the commits before those fixes, each check fails):

- crafted ``x-request-id``: a request whose id is in flight is booked as ``<id>#<seq>`` (seq: the
  scheduler's command counter). ``dupX`` and ``dupX#3000`` .. ``dupX#3249`` are held open while
  requests named ``dupX`` sweep the counter past them: each must be answered 200 (a collision was a
  500). It runs first, while the counter is still below that window;
- abandoned requests: 20 long requests, streamed and then not, whose clients leave once they are
  booked: their bookings must be freed within 2 s (a non-streamed one was held to its answer's end);
- unknown model names: 2,000 random ones and 40 of 256 KiB, each a 404: none may become a
  /metrics series (each did, kept for good);
- slow readers: 20 long streams whose clients read nothing for 5 s (a small receive buffer: the
  kernel takes little for them), then half read to the end and half close. The router pauses
  reading from a worker past a high-water mark (router/upstream.py): its RSS may grow by at most
  2 MB a stream (0.6-1.1 MB measured; 2.7-3.2 MB with the pause taken out), and everything must
  drain. The streams are of 32,000 tokens (~6 MB): on loopback the kernel's send buffer to the
  client grows to 4 MB (``tcp_wmem``) and takes a stream of 4,000 tokens (0.7 MB) whole, so the
  router holds none of it, pause or not;
- slowloris: 50 connections that send a request head one byte every 100 ms. The router's header
  timeout (``RUDDER_HEADER_TIMEOUT_S``, router/ingress.py) must close each within it plus 2 s,
  while normal requests, one every 250 ms, are answered 200 within 2 s;

then 20 normal requests, all answered 200. The logs must hold no traceback. Each check that
fails is listed under "problems" and makes the exit status 1 (the script is a gate); 0 otherwise.
About 90 s with the defaults.

    python bench/soak.py                      # table on stdout, bench/results/soak.json
    python bench/soak.py --rounds 10 --seconds 60 --log-dir /tmp/soak   # longer; keep the logs
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import random
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Fleet, Router, machine, metric_sums, pct, write_result
from cli.embedded import LocalBus
from router.settings import RouterSettings

MODEL = "soak"
SHARED = "shared system prompt "
HEADER_TIMEOUT_S: float = RouterSettings.model_fields["header_timeout_s"].default  # the router's default
DRAIN_WITHIN_S = 15.0
FD_SLACK = 16  # fds the router may hold at the last round beyond the first round's
RSS_SLACK_MB = 32.0  # and MB of RSS
ABANDON_FREED_WITHIN_S = 2.0
SLOW_READER_MB = 2.0  # RSS the router may gain per slow reader
NORMAL_WITHIN_S = 2.0  # a normal request during the slowloris probe
CLOSED_SLACK_S = 2.0  # a slowloris connection lives at most the header timeout plus this
MAX_WAIT_S = 30.0  # any one client operation


# -- what the clients saw ------------------------------------------------------------------------

@dataclass
class Tally:
    """Outcomes by behaviour; the unexpected ones with an example each."""

    outcomes: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    unexpected: dict[tuple[str, str], str] = field(default_factory=dict)

    def note(self, behaviour: str, outcome: str, *, ok: bool = True, example: str = "") -> None:
        self.outcomes[behaviour][outcome] += 1
        if not ok:
            self.unexpected.setdefault((behaviour, outcome), example[:300])

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.outcomes.values())


@dataclass
class Target:
    """The router under test and its workers."""

    url: str
    port: int
    pid: int
    worker_urls: list[str]
    worker_ids: list[int]


@dataclass
class Ctx:
    target: Target
    client: httpx.AsyncClient
    tally: Tally


# -- requests ------------------------------------------------------------------------------------

def prompt() -> str:
    words = " ".join(f"w{random.randrange(100000)}" for _ in range(random.randint(1, 20)))
    return SHARED * random.choice([0, 1, 4, 16, 64, 128]) + words


def completion(stream: bool, max_tokens: int = 0, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt(), "max_tokens": max_tokens or random.randint(4, 64),
            "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def chat(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "max_tokens": random.randint(4, 64),
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SHARED * random.choice([1, 8, 32, 96])},
                         {"role": "user", "content": prompt()}]}


def raw_request(body: dict[str, Any], *, path: str = "/v1/completions", request_id: str = "",
                cut: bool = False) -> bytes:
    """A request as bytes; ``cut``: only the first half of its body (the head declares all of it)."""
    data = json.dumps(body).encode()
    rid = f"x-request-id: {request_id}\r\n" if request_id else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n{rid}"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + (data[: len(data) // 2] if cut else data)


async def open_raw(port: int, request: bytes, *, rcvbuf: int = 0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection with ``request`` sent on it; ``rcvbuf``: a small kernel receive buffer (set
    before connecting) and a stream reader that buffers as little."""
    if rcvbuf:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=rcvbuf)
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    return reader, writer


async def read_status(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1])


async def read_to_done(reader: asyncio.StreamReader) -> int:
    """Read a stream's body up to its ``[DONE]`` (or the connection's end): the bytes read."""
    n, tail = 0, b""
    while chunk := await reader.read(65536):
        n += len(chunk)
        tail = tail[-32:] + chunk
        if b"data: [DONE]" in tail:
            break
    return n


def close(writer: asyncio.StreamWriter, *, abort: bool = False) -> None:
    """Close (FIN) or abort (RST) a raw connection."""
    if abort:
        writer.transport.abort()
    else:
        writer.close()


def shaped(r: httpx.Response) -> bool:
    """An error answer in the OpenAI shape."""
    try:
        return "error" in r.json()
    except ValueError:
        return False


def whole_answer(r: httpx.Response) -> bool:
    """A non-streamed completion with choices and usage."""
    try:
        return bool(r.json()["choices"]) and "usage" in r.json()
    except (ValueError, KeyError, TypeError):
        return False


# -- the mix -------------------------------------------------------------------------------------

async def read_stream(ctx: Ctx, name: str, r: httpx.Response) -> None:
    """Read an SSE answer to its end and note what it was."""
    text = (await r.aread()).decode(errors="replace")
    if r.status_code != 200:
        ctx.tally.note(name, str(r.status_code), ok=False, example=text)
    elif '"error"' in text:
        ctx.tally.note(name, "200 with an error event", ok=False, example=text[-300:])
    elif "data: [DONE]" not in text:
        ctx.tally.note(name, "200 without [DONE]", ok=False, example=text[-300:])
    elif '"usage"' not in text:
        ctx.tally.note(name, "200 without usage", ok=False, example=text[-300:])
    else:
        ctx.tally.note(name, "200")


async def stream_completion(ctx: Ctx) -> None:
    async with ctx.client.stream("POST", ctx.target.url + "/v1/completions", json=completion(True)) as r:
        await read_stream(ctx, "stream completion", r)


async def plain_completion(ctx: Ctx) -> None:
    r = await ctx.client.post(ctx.target.url + "/v1/completions", json=completion(False))
    if r.status_code != 200:
        ctx.tally.note("completion", str(r.status_code), ok=False, example=r.text)
    elif whole_answer(r):
        ctx.tally.note("completion", "200")
    else:
        ctx.tally.note("completion", "200 without choices or usage", ok=False, example=r.text)


async def stream_chat(ctx: Ctx) -> None:
    async with ctx.client.stream("POST", ctx.target.url + "/v1/chat/completions", json=chat(True)) as r:
        await read_stream(ctx, "stream chat", r)


async def close_after_first_chunk(ctx: Ctx) -> None:
    reader, writer = await open_raw(ctx.target.port, raw_request(completion(True, random.randint(16, 256))))
    try:
        status = await read_status(reader)
        first = await reader.read(4096)
        ctx.tally.note("close after first chunk", f"{status}" if first else f"{status} without a body",
                       ok=status == 200 and bool(first))
    finally:
        close(writer)


async def half_body(ctx: Ctx) -> None:
    _, writer = await open_raw(ctx.target.port, raw_request(completion(random.random() < 0.5), cut=True))
    await asyncio.sleep(random.choice([0, 0.01, 0.05]))
    close(writer, abort=random.random() < 0.3)
    ctx.tally.note("half body, close", "sent")


async def send_and_close(ctx: Ctx) -> None:
    stream = random.random() < 0.5
    path, body = random.choice([("/v1/completions", completion(stream)), ("/v1/chat/completions", chat(stream))])
    _, writer = await open_raw(ctx.target.port, raw_request(body, path=path))
    close(writer, abort=random.random() < 0.3)
    ctx.tally.note("send and close", "sent")


async def long_stream_abandoned(ctx: Ctx) -> None:
    reader, writer = await open_raw(ctx.target.port, raw_request(completion(True, 2000)))
    try:
        status = await asyncio.wait_for(read_status(reader), 0.05)
        ctx.tally.note("long stream abandoned", f"{status}, closed", ok=status == 200)
    except TimeoutError:
        ctx.tally.note("long stream abandoned", "closed before the head")
    finally:
        close(writer, abort=random.random() < 0.3)


async def bad_request(ctx: Ctx) -> None:
    kind = random.choice(["malformed JSON", "unknown model", "missing prompt", "nested too deeply",
                          "lone surrogate", "stream not boolean"])
    url = ctx.target.url + "/v1/completions"
    body = completion(random.random() < 0.5)
    if kind == "malformed JSON":
        r = await ctx.client.post(url, content=b'{"model": "soak", "prompt": "x",',
                                  headers={"content-type": "application/json"})
    elif kind == "nested too deeply":  # past json's recursion limit (decision 124)
        r = await ctx.client.post(url, content=json.dumps(body).encode()[:-1] + b', "x": ' + b"[" * 5000
                                  + b"]" * 5000 + b"}", headers={"content-type": "application/json"})
    elif kind == "lone surrogate":  # a JSON "\ud800" escape: no tokenizer encodes it
        r = await ctx.client.post(url, content=json.dumps({**body, "prompt": "soak \ud800"}).encode(),
                                  headers={"content-type": "application/json"})
    elif kind == "stream not boolean":
        r = await ctx.client.post(url, json={**body, "stream": "maybe"})
    elif kind == "unknown model":
        r = await ctx.client.post(url, json={**body, "model": "no-such-model"})
    else:
        del body["prompt"]
        r = await ctx.client.post(url, json=body)
    expected = 404 if kind == "unknown model" else 400
    ctx.tally.note(kind, f"{r.status_code}{'' if shaped(r) else ' (not OpenAI-shaped)'}",
                   ok=r.status_code == expected and shaped(r), example=r.text)


async def h2c_offer(ctx: Ctx) -> None:
    """A POST offering ``Upgrade: h2c`` (Java's and Ktor's clients do): served as HTTP/1.1 with its
    body (decision 124)."""
    request = raw_request(completion(True, random.randint(4, 32))).replace(
        b"Host: soak\r\n", b"Host: soak\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n", 1)
    reader, writer = await open_raw(ctx.target.port, request)
    try:
        status = await read_status(reader)
        n = await read_to_done(reader) if status == 200 else 0
        ctx.tally.note("h2c offer", str(status), ok=status == 200 and n > 0)
    finally:
        close(writer)


async def pinned(ctx: Ctx) -> None:
    ids = ctx.target.worker_ids
    url = ctx.target.url + "/v1/completions"
    x = random.random()
    if x < 0.3:  # no such worker, no such rank, a malformed nvext: a 4xx (or 503), never a 500
        name, nvext = random.choice([
            ("pinned: no such worker", {"backend_instance_id": 12345}),
            ("pinned: no such rank", {"backend_instance_id": random.choice(ids), "dp_rank": 7}),
            ("pinned: bad nvext", random.choice(["str", {"backend_instance_id": "abc"}, {"backend_instance_id": -1},
                                                 {"dp_rank": 0}, {"backend_instance_id": 2**70}])),
        ])
        r = await ctx.client.post(url, json=completion(False, nvext=nvext))
        ctx.tally.note(name, str(r.status_code), ok=400 <= r.status_code < 500 or r.status_code == 503,
                       example=f"{nvext!r}: {r.text}")
        return
    worker = random.choice(ids)
    body = completion(random.random() < 0.5, nvext={"backend_instance_id": worker})
    if body["stream"]:
        async with ctx.client.stream("POST", url, json=body) as r:
            await read_stream(ctx, "pinned", r)
    else:
        r = await ctx.client.post(url, json=body)
        ctx.tally.note("pinned", str(r.status_code), ok=r.status_code == 200, example=r.text)
    answered = r.headers.get("x-worker-instance-id")
    if r.status_code == 200 and answered != str(worker):
        ctx.tally.note("pinned", "200 from another worker", ok=False,
                       example=f"pinned {worker}, answered by {answered}")


# Each notes its outcomes under its name (bad_request and pinned under their kinds'); an exception
# is noted under the name here.
BEHAVIOURS: dict[str, Callable[[Ctx], Awaitable[None]]] = {
    "stream completion": stream_completion, "completion": plain_completion, "stream chat": stream_chat,
    "close after first chunk": close_after_first_chunk, "half body, close": half_body,
    "send and close": send_and_close, "bad request": bad_request, "pinned": pinned,
    "long stream abandoned": long_stream_abandoned, "h2c offer": h2c_offer,
}


async def client_loop(ctx: Ctx, until: float) -> None:
    while time.monotonic() < until:
        name, behaviour = random.choice(list(BEHAVIOURS.items()))
        try:
            await asyncio.wait_for(behaviour(ctx), MAX_WAIT_S)
        except TimeoutError:
            ctx.tally.note(name, f"no answer in {MAX_WAIT_S:g} s", ok=False)
        except (httpx.HTTPError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            ctx.tally.note(name, f"error {type(exc).__name__}", ok=False,
                           example="".join(traceback.format_exception_only(exc)))


async def load_round(target: Target, tally: Tally, clients: int, seconds: float) -> None:
    # keep-alive under the router's (uvicorn's) 5 s idle timeout: at exactly 5 s on both sides a
    # reused connection races the server's close (a ReadError of the client's, not the router's)
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients, keepalive_expiry=4.0)
    async with httpx.AsyncClient(timeout=MAX_WAIT_S, limits=limits) as client:
        ctx = Ctx(target, client, tally)
        until = time.monotonic() + seconds
        await asyncio.gather(*(client_loop(ctx, until) for _ in range(clients)))


# -- the router's state --------------------------------------------------------------------------

async def in_flight(client: httpx.AsyncClient, url: str) -> float:
    name = "rudder_router_requests_in_flight"
    return (await metric_sums(client, url, (name,)))[name]


async def workers_busy(client: httpx.AsyncClient, urls: list[str]) -> float:
    """Requests the workers run or queue."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    busy = 0.0
    for url in urls:
        busy += sum((await metric_sums(client, url, names)).values())
    return busy


def orphaned_connections(target: Target) -> int:
    """Client connections the router holds whose client (this process) no longer holds its end."""
    ours = {c.laddr for c in psutil.Process().net_connections(kind="tcp")}
    return sum(1 for c in psutil.Process(target.pid).net_connections(kind="tcp")
               if c.status != psutil.CONN_LISTEN and c.laddr and c.laddr.port == target.port and c.raddr not in ours)


def usage(target: Target) -> dict[str, float]:
    p = psutil.Process(target.pid)
    return {"fds": p.num_fds(), "rss_mb": round(p.memory_info().rss / 2**20, 1)}


async def drain(target: Target, within: float = DRAIN_WITHIN_S) -> dict[str, Any]:
    """Poll until the router has nothing in flight, the workers run nothing and the router holds
    no connection its client closed; what was last seen, and how long it took."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            state = {"in_flight": await in_flight(client, target.url),
                     "workers_busy": await workers_busy(client, target.worker_urls),
                     "orphaned_connections": orphaned_connections(target)}
            drained = not any(state.values())
            if drained or time.monotonic() - t0 > within:
                return {"drained": drained, "took_s": round(time.monotonic() - t0, 2), **state}
            await asyncio.sleep(0.1)


async def watch_in_flight(client: httpx.AsyncClient, url: str, until: Callable[[float], bool],
                          within: float = DRAIN_WITHIN_S) -> tuple[float, float]:
    """Poll the router's in-flight count until ``until(count)`` (or ``within`` passes): the last
    count, and the seconds it took."""
    t0 = time.monotonic()
    while True:
        count = await in_flight(client, url)
        took = time.monotonic() - t0
        if until(count) or took > within:
            return count, round(took, 2)
        await asyncio.sleep(0.05)


async def peak_rss(pid: int, until: asyncio.Future[Any]) -> float:
    """The process's largest RSS (MB) until ``until`` is done, sampled every 50 ms."""
    process = psutil.Process(pid)
    peak = 0.0
    while not until.done():
        peak = max(peak, process.memory_info().rss / 2**20)
        await asyncio.sleep(0.05)
    return peak


# -- probes --------------------------------------------------------------------------------------

async def hold_many(target: Target, body: dict[str, Any], ids: list[str]) -> list[asyncio.StreamWriter]:
    """One open request per id; nothing read from them."""
    return [(await open_raw(target.port, raw_request(body, request_id=rid)))[1] for rid in ids]


async def probe_request_ids(target: Target) -> dict[str, Any]:
    lo, hi, sweep = 3000, 3250, 3000
    hold = {"model": MODEL, "prompt": "hold " * 8, "max_tokens": 100000, "stream": True,
            "nvext": {"backend_instance_id": target.worker_ids[0]}}
    statuses: collections.Counter[int] = collections.Counter()
    first_failure = ""
    async with httpx.AsyncClient(timeout=MAX_WAIT_S) as client:
        base = await in_flight(client, target.url)
        writers = await hold_many(target, hold, ["dupX", *(f"dupX#{k}" for k in range(lo, hi))])
        try:
            held, _ = await watch_in_flight(client, target.url, lambda count: count >= base + len(writers))
            for _ in range(sweep):
                r = await client.post(target.url + "/v1/completions", headers={"x-request-id": "dupX"},
                                      json={"model": MODEL, "prompt": "sweep", "max_tokens": 1,
                                            "nvext": {"backend_instance_id": target.worker_ids[-1]}})
                statuses[r.status_code] += 1
                if r.status_code != 200:
                    first_failure = f"{r.status_code} {r.text[:200]}"
                    break
        finally:
            for w in writers:
                close(w, abort=True)
    return {"held": len(writers), "in_flight_while_held": held - base, "sweep_statuses": dict(statuses),
            "first_failure": first_failure, "ok": not first_failure and held - base >= len(writers)}


async def probe_abandoned(target: Target, *, stream: bool, n: int = 20) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt(), "max_tokens": 60000, "stream": stream}
    tag = f"abandoned-{'s' if stream else 'ns'}-{random.getrandbits(32):x}"
    async with httpx.AsyncClient(timeout=5) as client:
        base = await in_flight(client, target.url)  # 0, unless an earlier phase left bookings
        writers = await hold_many(target, body, [f"{tag}-{i}" for i in range(n)])
        booked, _ = await watch_in_flight(client, target.url, lambda count: count >= base + n)
        for w in writers:
            close(w)
        left, freed_s = await watch_in_flight(client, target.url, lambda count: count <= base)
    return {"stream": stream, "booked": booked - base, "left": left - base, "freed_after_s": freed_s,
            "ok": booked - base >= n and left <= base and freed_s <= ABANDON_FREED_WITHIN_S}


async def probe_unknown_models(target: Target) -> dict[str, Any]:
    names = [f"nope-{random.getrandbits(64):x}" for _ in range(2000)]
    names += [f"{i}{'M' * 256 * 1024}" for i in range(40)]
    statuses: collections.Counter[int] = collections.Counter()
    gate = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=MAX_WAIT_S) as client:
        before = (await client.get(target.url + "/metrics")).text

        async def one(name: str) -> None:
            async with gate:
                r = await client.post(target.url + "/v1/completions", json={**completion(False), "model": name})
                statuses[r.status_code] += 1

        await asyncio.gather(*(one(name) for name in names))
        after = (await client.get(target.url + "/metrics")).text
    mentions = sum(1 for line in after.splitlines() if "nope-" in line or "MMMM" in line)
    return {"requests": len(names), "statuses": dict(statuses), "metrics_lines_naming_them": mentions,
            "metrics_bytes_before": len(before), "metrics_bytes_after": len(after),
            "ok": mentions == 0 and set(statuses) == {404}}


async def slow_reader(target: Target, body: dict[str, Any], *, pause_s: float, read: bool) -> int:
    """A stream whose client reads nothing for ``pause_s``, then reads it to the end (the bytes
    read; -1: not a 200) or closes (0)."""
    reader, writer = await open_raw(target.port, raw_request(body), rcvbuf=16 * 1024)
    try:
        await asyncio.sleep(pause_s)
        if not read:
            return 0
        if await read_status(reader) != 200:
            return -1
        return await asyncio.wait_for(read_to_done(reader), MAX_WAIT_S)
    finally:
        close(writer)


async def probe_slow_readers(target: Target, n: int = 20, pause_s: float = 5.0) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt(), "max_tokens": 32000, "stream": True}
    rss_before = usage(target)["rss_mb"]
    readers = asyncio.gather(*(slow_reader(target, body, pause_s=pause_s, read=i % 2 == 0) for i in range(n)))
    peak = await peak_rss(target.pid, readers)
    read = readers.result()[::2]
    complete = [b for b in read if b > 0]
    carried_mb = max(complete, default=0) * n / 2**20  # what all of them would have read
    grew_mb = round(peak - rss_before, 1)
    return {"streams": n, "read_to_end": len(complete), "of": len(read), "carried_mb": round(carried_mb, 1),
            "rss_before_mb": rss_before, "rss_peak_mb": round(peak, 1), "rss_grew_mb": grew_mb,
            "ok": len(complete) == len(read) and grew_mb <= n * SLOW_READER_MB}


async def slowloris(port: int, drip_s: float, within: float) -> tuple[float, str]:
    """A request head that never ends, a byte every ``drip_s``: how long the router kept the
    connection, and what it answered (``open`` if it still was after ``within``)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = itertools.chain(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nX-Slow: ", itertools.repeat(ord("a")))

    async def drip() -> None:
        for byte in head:
            writer.write(bytes([byte]))
            await asyncio.sleep(drip_s)

    dripping = asyncio.create_task(drip())
    try:
        answer = await asyncio.wait_for(reader.read(), within)  # to the connection's end
        outcome = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
    except TimeoutError:
        outcome = "open"
    except ConnectionResetError:
        outcome = "reset"
    finally:
        dripping.cancel()
        close(writer, abort=True)
    return time.monotonic() - t0, outcome


async def normal_requests(url: str, until: asyncio.Future[Any]) -> list[float]:
    """Non-streamed completions one every 250 ms until ``until`` is done: their latencies
    (``inf``: not a 200)."""
    took: list[float] = []
    async with httpx.AsyncClient(timeout=MAX_WAIT_S) as client:
        while not until.done():
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/completions", json=completion(False))
            took.append(time.perf_counter() - t0 if r.status_code == 200 else float("inf"))
            await asyncio.sleep(0.25)
    return took


async def probe_slowloris(target: Target, n: int = 50, drip_s: float = 0.1) -> dict[str, Any]:
    within = 3 * HEADER_TIMEOUT_S
    conns = asyncio.gather(*(slowloris(target.port, drip_s, within) for _ in range(n)))
    latencies = await normal_requests(target.url, conns)
    lived = [t for t, _ in conns.result()]
    answers = collections.Counter(outcome for _, outcome in conns.result())
    served = [t for t in latencies if t != float("inf")]
    return {"connections": n, "header_timeout_s": HEADER_TIMEOUT_S, "answers": dict(answers),
            "lived_min_s": round(min(lived), 2), "lived_max_s": round(max(lived), 2),
            "normal_requests": len(latencies), "normal_200": len(served),
            "normal_p50_ms": round(pct(served, 0.5) * 1e3, 1), "normal_max_ms": round(max(served, default=0) * 1e3, 1),
            "ok": ("open" not in answers and max(lived) <= HEADER_TIMEOUT_S + CLOSED_SLACK_S
                   and len(served) == len(latencies) and max(served, default=0) <= NORMAL_WITHIN_S)}


async def final_requests(url: str, n: int = 20) -> dict[str, Any]:
    statuses: collections.Counter[str] = collections.Counter()
    async with httpx.AsyncClient(timeout=MAX_WAIT_S) as client:
        for i in range(n):
            if i % 2:
                r = await client.post(url + "/v1/completions", json=completion(False))
                statuses[str(r.status_code)] += 1
            else:
                async with client.stream("POST", url + "/v1/completions", json=completion(True)) as r:
                    whole = b"data: [DONE]" in await r.aread()
                    statuses[f"{r.status_code}{'' if whole else ' without [DONE]'}"] += 1
    return {"statuses": dict(statuses), "ok": statuses == {"200": n}}


def scan_log(path: Path) -> dict[str, Any]:
    """Tracebacks in a log, and the first one."""
    text = path.read_text(errors="replace") if path.exists() else ""
    at = text.find("Traceback")
    return {"tracebacks": text.count("Traceback"), "first": text[max(0, at - 200): at + 3000] if at >= 0 else ""}


# -- the run -------------------------------------------------------------------------------------

async def soak(target: Target, args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    """The crafted-id probe, the rounds, the other probes and the final requests, each followed by
    a drain; their results."""
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {line}", flush=True)

    probes: dict[str, Any] = {}

    async def probe(name: str, result: Awaitable[dict[str, Any]]) -> None:
        probes[name] = {**await result, "drain": await drain(target)}
        say(f"probe {name}: {'ok' if probes[name]['ok'] else 'PROBLEM'}; drained "
            f"{yes(probes[name]['drain']['drained'])} in {probes[name]['drain']['took_s']} s")

    await probe("crafted x-request-id", probe_request_ids(target))
    rounds: list[dict[str, Any]] = []
    for rnd in range(1, args.rounds + 1):
        say(f"round {rnd}: {args.clients} clients for {args.seconds:g} s")
        before = tally.total()
        await load_round(target, tally, args.clients, args.seconds)
        r: dict[str, Any] = {"round": rnd, "operations": tally.total() - before, "drain": await drain(target),
                             **usage(target)}
        rounds.append(r)
        say(f"round {rnd}: {r['operations']} operations; drained {yes(r['drain']['drained'])} in "
            f"{r['drain']['took_s']} s; router fds {r['fds']}, RSS {r['rss_mb']} MB")
    await probe("abandoned streamed", probe_abandoned(target, stream=True))
    await probe("abandoned non-streamed", probe_abandoned(target, stream=False))
    await probe("unknown models", probe_unknown_models(target))
    await probe("slow readers", probe_slow_readers(target))
    await probe("slowloris", probe_slowloris(target))
    await probe("final requests", final_requests(target.url))
    return {"rounds": rounds, "probes": probes, "after_probes": usage(target)}


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def drained(d: dict[str, Any]) -> str:
    return (f"drained {yes(d['drained'])} in {d['took_s']} s (in flight {d['in_flight']:g}, workers idle "
            f"{yes(not d['workers_busy'])}, orphaned client connections {d['orphaned_connections']})")


def growth(rounds: list[dict[str, Any]]) -> list[str]:
    """The router's fds and RSS from the first round to the last, past their slack."""
    first, last = rounds[0], rounds[-1]
    found = []
    if last["fds"] > first["fds"] + FD_SLACK:
        found.append(f"router fds grew from {first['fds']} (round 1) to {last['fds']} (round {last['round']})")
    if last["rss_mb"] > first["rss_mb"] + RSS_SLACK_MB:
        found.append(f"router RSS grew from {first['rss_mb']} MB (round 1) to {last['rss_mb']} MB "
                     f"(round {last['round']})")
    return found


def problems(report: dict[str, Any], tally: Tally) -> list[str]:
    """What the checks found (empty: nothing)."""
    found = [f"{behaviour}: {outcome} x{tally.outcomes[behaviour][outcome]}, e.g. {example!r}"
             for (behaviour, outcome), example in tally.unexpected.items()]
    rounds = report["rounds"]
    found += [f"round {r['round']}: not drained within {DRAIN_WITHIN_S:g} s: {r['drain']}"
              for r in rounds if not r["drain"]["drained"]]
    found += growth(rounds)
    for name, probe in report["probes"].items():
        if not probe["ok"]:
            found.append(f"probe {name}: {PROBE_LINES[name](probe)}")
        if not probe["drain"]["drained"]:
            found.append(f"probe {name}: not drained within {DRAIN_WITHIN_S:g} s afterwards: {probe['drain']}")
    found += [f"{name}: {log['tracebacks']} tracebacks, the first: {log['first']}"
              for name, log in report["logs"].items() if log["tracebacks"]]
    if not report["router_alive"]:
        found.append("the router process exited")
    return found


def print_report(report: dict[str, Any]) -> None:
    print(f"\n{'behaviour':<26}{'count':>7}  outcomes")
    for name, outcomes in report["behaviours"].items():
        print(f"{name:<26}{sum(outcomes.values()):>7}  " + ", ".join(f"{k}: {v}" for k, v in outcomes.items()))
    print("\nchecks")
    rounds = report["rounds"]
    for r in rounds:
        print(f"  round {r['round']}: {r['operations']} operations; {drained(r['drain'])}; router fds {r['fds']}, "
              f"RSS {r['rss_mb']} MB")
    first, last, after = rounds[0], rounds[-1], report["after_probes"]
    print(f"  router from round 1 to round {last['round']}: fds {first['fds']} -> {last['fds']} (slack {FD_SLACK}), "
          f"RSS {first['rss_mb']} -> {last['rss_mb']} MB (slack {RSS_SLACK_MB:g}): "
          f"{'ok' if not growth(rounds) else 'PROBLEM'}; after the probes fds {after['fds']}, RSS {after['rss_mb']} MB")
    for name, probe in report["probes"].items():
        print(f"  {name}: {PROBE_LINES[name](probe)}: {'ok' if probe['ok'] else 'PROBLEM'}; {drained(probe['drain'])}")
    print("  log tracebacks: " + ", ".join(f"{k} {v['tracebacks']}" for k, v in report["logs"].items()))
    print("\nproblems:" + ("".join(f"\n  - {x}" for x in report["problems"]) or " none"))


def _abandoned_line(p: dict[str, Any]) -> str:
    return f"{p['booked']:g} booked, {p['left']:g} left in flight {p['freed_after_s']} s after their clients left"


PROBE_LINES: dict[str, Callable[[dict[str, Any]], str]] = {
    "crafted x-request-id": lambda p: (f"{p['held']} held ({p['in_flight_while_held']:g} in flight), "
                                       f"sweep {p['sweep_statuses']}"
                                       + (f", first failure {p['first_failure']}" if p["first_failure"] else "")),
    "abandoned streamed": _abandoned_line,
    "abandoned non-streamed": _abandoned_line,
    "unknown models": lambda p: (f"{p['requests']} requests {p['statuses']}; /metrics lines naming them "
                                 f"{p['metrics_lines_naming_them']}, /metrics {p['metrics_bytes_before']} -> "
                                 f"{p['metrics_bytes_after']} bytes"),
    "slow readers": lambda p: (f"{p['streams']} streams carrying {p['carried_mb']} MB; router RSS "
                               f"{p['rss_before_mb']} -> peak {p['rss_peak_mb']} MB (+{p['rss_grew_mb']}); "
                               f"read to the end {p['read_to_end']}/{p['of']}"),
    "slowloris": lambda p: (f"{p['connections']} connections {p['answers']}, closed after {p['lived_min_s']}-"
                            f"{p['lived_max_s']} s (header timeout {p['header_timeout_s']:g} s); normal requests "
                            f"meanwhile {p['normal_200']}/{p['normal_requests']} answered, p50 "
                            f"{p['normal_p50_ms']} ms, max {p['normal_max_ms']} ms"),
    "final requests": lambda p: f"{p['statuses']}",
}


async def main(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    tally = Tally()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        logs = Path(args.log_dir or tmp)
        bus = LocalBus(Path(tmp))
        bus.start()
        fleet = Fleet(bus, MODEL, args.workers, mock={"speedup_ratio": args.speedup}, log_dir=logs)
        router: Router | None = None
        try:
            await fleet.start()
            router = Router(bus, MODEL, mode="kv", log=logs / "router.log",
                            env={"RUDDER_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)})
            await router.ready(args.workers)
            target = Target(router.url, router.port, router.proc.pid, fleet.urls, fleet.instance_ids)
            print(f"router {router.url} (pid {target.pid}), {args.workers} workers"
                  + (f"; logs in {logs}" if args.log_dir else ""), flush=True)
            report = await soak(target, args, tally)
            report["router_alive"] = router.proc.poll() is None
        finally:
            if router is not None:
                router.stop()
            fleet.stop()
            bus.stop()
        report["logs"] = {name: scan_log(logs / f"{name}.log")
                          for name in ["router", *(f"worker{i}" for i in range(args.workers))]}
    report = {"benchmark": "soak", **machine(), "args": vars(args), "wall_s": round(time.monotonic() - t0, 1),
              "behaviours": {k: dict(v.most_common()) for k, v in sorted(tally.outcomes.items())}, **report}
    report["problems"] = problems(report, tally)
    print_report(report)
    print(f"\n{report['wall_s']} s; wrote {write_result(args.output, report)}")
    return 1 if report["problems"] else 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="length of a round of mixed load")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=48, help="client loops in a round")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--speedup", type=float, default=50.0, help="mock speedup_ratio")
    p.add_argument("--seed", type=int, default=None, help="the mix's random seed")
    p.add_argument("--log-dir", default="", help="keep the router's and workers' logs here")
    p.add_argument("--output", default="soak", help="bench/results/<output>.json")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.log_dir:  # this run's logs only (the processes append to theirs)
        log_dir = Path(arguments.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        for old in [log_dir / "router.log", *log_dir.glob("worker*.log")]:
            old.unlink(missing_ok=True)
    sys.exit(asyncio.run(main(arguments)))
