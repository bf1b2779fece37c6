"""The express path (router.express; docs/decisions.md 128): the common inference request served
from the connections' callbacks, against real mock workers and the same requests served the ASGI
way (a router with ``express_path`` off, seeing the same workers). Each test counts which path
served what (``rudder_router_request_path_total``), so that a test of a behaviour on the express
path fails if the request silently took the other one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support_router.workers import (
    InProcessRouter,
    MockWorker,
    mock_workers,
    router_settings,
    wait_for,
    worker_process,
)

pytestmark = pytest.mark.timeout(120)
MODEL = "org/express-model:v1"


def paths(router: InProcessRouter) -> tuple[float, float]:
    """(requests served by the express path, by the ASGI path) so far."""
    m = router.runtime.metrics
    return m.express_path.value, m.asgi_path.value


@pytest.fixture(scope="module")
async def routers(nats_url: str) -> AsyncIterator[tuple[InProcessRouter, InProcessRouter, list[MockWorker]]]:
    """One worker; a router with the express path and one without, both seeing it."""
    async with mock_workers(nats_url, MODEL, 1) as workers:
        express = await InProcessRouter(router_settings(nats_url, MODEL)).start()
        asgi = await InProcessRouter(router_settings(nats_url, MODEL, express_path=False)).start()
        try:
            for r in (express, asgi):
                await wait_for(lambda r=r: r.runtime.scheduler.view.workers.get(MODEL) == 1)
            yield express, asgi, workers
        finally:
            await express.stop()
            await asgi.stop()


async def _in_flight_zero(router: InProcessRouter) -> bool:
    return bool(await router.runtime.scheduler.inspect(lambda s: len(s.bookings) == 0))


def _content(path: str, stream: bool, raw: bytes) -> list[Any]:
    """What an answer says, without its ids and times."""
    if stream:
        lines = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert lines[-1] == b"[DONE]", raw
        parts = [json.loads(e) for e in lines[:-1]]
    else:
        parts = [json.loads(raw)]
    out = []
    for p in parts:
        for choice in p.get("choices") or []:
            out.append(choice.get("text") if path == "/v1/completions" else
                       (choice.get("delta") or choice.get("message") or {}).get("content"))
        if p.get("usage"):
            out.append(p["usage"].get("prompt_tokens"))
    return out


async def test_common_requests_take_the_express_path_and_answer_as_the_asgi_path(
    routers: tuple[InProcessRouter, InProcessRouter, list[MockWorker]],
) -> None:
    """Chat and completions, streamed and not, with usage asked for, with and without a request id:
    the express router serves each on its express path, the other router on its ASGI path, and
    the two answers agree: status, headers (names, and the values that are not per request), and
    the answer's content; both routers end with nothing booked."""
    express, asgi, [worker] = routers
    cases = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        for stream in (False, True):
            prompt = f"express {path} {stream} " * 8
            body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": stream}
            if path == "/v1/completions":
                body["prompt"] = prompt
            else:
                body["messages"] = [{"role": "user", "content": prompt}]
            if stream:
                body["stream_options"] = {"include_usage": True}
            cases.append((path, stream, body))
    async with httpx.AsyncClient(timeout=30) as http:
        before_e, before_a = paths(express), paths(asgi)
        for i, (path, stream, body) in enumerate(cases):
            headers = {"x-request-id": f"express-parity-{i}"} if i % 2 else {}
            answers = [await http.post(r.url + path, json=body, headers=headers) for r in (express, asgi)]
            for a in answers:
                assert a.status_code == 200, (path, stream, a.text)
            e, s = answers
            assert set(e.headers) == set(s.headers), (path, stream, e.headers, s.headers)
            for name in ("content-type", "x-worker-instance-id", "x-dp-rank", "x-rudder-policy-revisions",
                         "transfer-encoding"):
                assert e.headers.get(name) == s.headers.get(name), (name, path, stream)
            if i % 2:
                assert e.headers["x-request-id"] == s.headers["x-request-id"] == f"express-parity-{i}"
            assert _content(path, stream, e.content) == _content(path, stream, s.content), (path, stream)
            assert _content(path, stream, e.content)
    after_e, after_a = paths(express), paths(asgi)
    assert (after_e[0] - before_e[0], after_e[1] - before_e[1]) == (len(cases), 0)
    assert (after_a[0] - before_a[0], after_a[1] - before_a[1]) == (0, len(cases))
    # The worker got the target in nvext from both, the same way.
    sent = worker.requests[-2 * len(cases):]
    assert all(b["nvext"]["backend_instance_id"] == worker.instance_id for b in sent)
    for r in (express, asgi):
        await wait_for(lambda r=r: _in_flight_zero(r), within=5)


async def test_refusals_on_the_express_path_are_the_asgi_paths(
    routers: tuple[InProcessRouter, InProcessRouter, list[MockWorker]],
) -> None:
    """A bad body, an unknown model, a bad field and a pin to an unknown worker are refused by the
    express router exactly as by the other (status and OpenAI-shaped body), served on its express
    path, counted in the same series; nothing is booked."""
    express, asgi, _ = routers
    bad = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", json.dumps({"model": "nobody", "prompt": "x"}).encode()),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                            "stream": "perhaps"}).encode()),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x",
                                        "nvext": {"backend_instance_id": 999}}).encode()),
    ]
    before = paths(express)
    async with httpx.AsyncClient(timeout=30) as http:
        for path, content in bad:
            e, s = [await http.post(r.url + path, content=content, headers={"content-type": "application/json"})
                    for r in (express, asgi)]
            assert e.status_code == s.status_code and e.status_code in (400, 404, 503), (path, e.text)
            assert e.json() == s.json(), (e.json(), s.json())
            assert e.headers["content-type"] == s.headers["content-type"]
    assert paths(express)[0] - before[0] == len(bad)
    assert paths(express)[1] == before[1]
    text = express.runtime.metrics.render().decode()
    assert 'rudder_router_requests_total{endpoint="/v1/completions",model="",status="400"}' in text \
        or any('status="400"' in line and line.startswith("rudder_router_requests_total")
               for line in text.splitlines()), text
    await wait_for(lambda: _in_flight_zero(express), within=5)


async def test_what_the_express_path_does_not_serve_goes_the_asgi_way(
    routers: tuple[InProcessRouter, InProcessRouter, list[MockWorker]],
) -> None:
    """A body past ``offload_min_bytes``, a client that expects 100-continue, and a request whose
    body arrives in pieces past the limit are served the ASGI way, and answered."""
    express, _, _ = routers
    port = express.settings.port
    big = {"model": MODEL, "prompt": "y" * (express.settings.offload_min_bytes + 10), "max_tokens": 2}
    before = paths(express)
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(express.url + "/v1/completions", json=big)
        assert r.status_code == 200, r.text
    assert paths(express) == (before[0], before[1] + 1)
    # Expect: 100-continue, the body sent once the router says so.
    small = json.dumps({"model": MODEL, "prompt": "continue", "max_tokens": 2}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(small))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 100"), head
        writer.write(small)
        raw = await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert paths(express) == (before[0], before[1] + 2)
    # A body in pieces: its first bytes with the head, the rest once the router holds the request
    # waiting for it (express, when the whole is small; else the ASGI way once it grows past).
    assert express._server is not None
    connections = express._server.server_state.connections

    def waiting_for_its_body() -> bool:
        return any(p.cycle is not None and p.cycle.more_body and len(p.cycle.body) >= 50 for p in connections)

    for size, via_express in ((200, True), (express.settings.offload_min_bytes * 2, False)):
        body = json.dumps({"model": MODEL, "prompt": "z" * size, "max_tokens": 2}).encode()
        now = paths(express)
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:50])
            await wait_for(waiting_for_its_body, within=5)
            sock.sendall(body[50:])
            sock.setblocking(False)
            raw = await _read_to_eof(sock, within=15)
        finally:
            sock.close()
        assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
        assert paths(express) == ((now[0] + 1, now[1]) if via_express else (now[0], now[1] + 1)), size
    await wait_for(lambda: _in_flight_zero(express), within=5)


async def _read_to_eof(sock: socket.socket, *, within: float) -> bytes:
    loop = asyncio.get_running_loop()
    out = b""
    async with asyncio.timeout(within):
        while data := await loop.sock_recv(sock, 65536):
            out += data
    return out


async def test_pipelined_requests_are_answered_in_order_on_the_express_path(
    routers: tuple[InProcessRouter, InProcessRouter, list[MockWorker]],
) -> None:
    """Three requests in one write (streamed, not, streamed): three answers in order, the last
    closing the connection, each served on the express path."""
    express, _, _ = routers
    before = paths(express)
    reqs = b""
    for i, stream in enumerate((True, False, True)):
        body = json.dumps({"model": MODEL, "prompt": f"pipelined {i}", "max_tokens": 2, "stream": stream}).encode()
        close = b"Connection: close\r\n" if i == 2 else b""
        reqs += (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nx-request-id: p%d\r\n"
                 % i + close + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    sock = socket.create_connection(("127.0.0.1", express.settings.port))
    try:
        sock.sendall(reqs)
        sock.setblocking(False)
        raw = await _read_to_eof(sock, within=20)
    finally:
        sock.close()
    heads = [part for part in raw.split(b"HTTP/1.1 ")[1:]]
    assert [h[:3] for h in heads] == [b"200"] * 3, raw[:600]
    assert [h.split(b"x-request-id: ")[1][:2] for h in heads] == [b"p0", b"p1", b"p2"]
    assert raw.endswith(b"0\r\n\r\n")
    assert paths(express)[0] - before[0] == 3


async def test_a_worker_that_hangs_before_its_head_is_left_for_another(nats_url: str, tmp_path: Path) -> None:
    """Two worker processes; one is stopped (SIGSTOP: its connections stay open, nothing answers)
    while the router holds an idle connection to it. A request the express path sends there gets
    no head within the request timeout: the worker is marked unreachable, the request handed to
    the ASGI path with that worker left out, and answered by the other (a retry counted); a request
    pinned to the stopped worker is answered 503 and not rerouted."""
    model = "express-hang-model"
    procs = [worker_process(nats_url, model, tmp_path / f"w{i}.log", speedup=50.0) for i in range(2)]
    router = await InProcessRouter(router_settings(nats_url, model, mode="round_robin",
                                                   request_timeout_s=1.0, worker_stale_s=30.0,
                                                   worker_ttl_s=60.0)).start()
    try:
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 2, within=30)
        body = {"model": model, "prompt": "hang", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
            seen: dict[int, int] = {}
            for _ in range(4):  # an idle pooled connection to each worker
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                seen[int(r.headers["x-worker-instance-id"])] = 1
            assert len(seen) == 2
            by_pid = await _instance_ids_by_pid(router, procs)
            stopped_pid, stopped = next(iter(by_pid.items()))
            other = next(w for w in seen if w != stopped)
            os.kill(stopped_pid, signal.SIGSTOP)
            retries = _retries(router, model)
            answered = [await http.post("/v1/completions", json=body) for _ in range(2)]
            assert [r.status_code for r in answered] == [200, 200], [r.text for r in answered]
            assert {int(r.headers["x-worker-instance-id"]) for r in answered} == {other}
            assert _retries(router, model) == retries + 1
            pinned = await http.post("/v1/completions", json={**body, "nvext": {"backend_instance_id": stopped}})
            assert pinned.status_code == 503, pinned.text
        await wait_for(lambda: _in_flight_zero(router), within=5)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=20)
        await router.stop()


def _retries(router: InProcessRouter, model: str) -> float:
    for line in router.runtime.metrics.render().decode().splitlines():
        if line.startswith("rudder_router_retries_total") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _instance_ids_by_pid(router: InProcessRouter, procs: list[Any]) -> dict[int, int]:
    """pid → instance id of the worker processes, through the ports they advertise."""
    records = await router.runtime.scheduler.inspect(
        lambda s: [st.record for st in s.discovery.workers.values()])
    out = {}
    for rec in records:
        port = int(rec.url.rsplit(":", 1)[1].split("/")[0])
        for p in procs:
            if _listens(p.pid, port):
                out[p.pid] = rec.instance_id
    assert len(out) == len(procs), (records, [p.pid for p in procs])
    return out


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on ``port`` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False


async def test_a_bug_on_the_express_path_is_a_500_or_a_closed_stream_and_frees_the_booking(
    routers: tuple[InProcessRouter, InProcessRouter, list[MockWorker]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug (an exception that is not a RudderError) while a request is prepared is answered 500
    in the OpenAI shape, as the ASGI path answers one; one while its answer streams closes the
    client's connection (as uvicorn does when an app raises once its answer began). Either way it
    is counted as an internal error and nothing stays booked; the router serves the next request."""
    import controlplane.protocol.tokenizer as byte_tokenizer

    express, _, _ = routers
    bugs = express.runtime.metrics.rejections.labels("internal_error")
    before = bugs._value.get()
    body = {"model": MODEL, "prompt": "a bug", "max_tokens": 3}

    def broken_tokenize(*args: Any) -> Any:
        raise RuntimeError("a bug in tokenizing")

    async with httpx.AsyncClient(base_url=express.url, timeout=30) as http:
        with monkeypatch.context() as m:
            # (the compiled request path calls the byte tokenizer's encoding through its module)
            m.setattr(byte_tokenizer, "encode", broken_tokenize)
            r = await http.post("/v1/completions", json=body)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error"

        def broken_slo(model: str, outcome: str) -> None:  # (called at the first token)
            raise RuntimeError("a bug in the relay")

        with monkeypatch.context() as m:
            m.setattr(express.runtime.metrics, "observe_slo", broken_slo)
            with pytest.raises(httpx.HTTPError):
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True},
                                       headers={"x-rudder-ttft-slo-ms": "60000"}) as resp:
                    await resp.aread()
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    assert bugs._value.get() == before + 2
    await wait_for(lambda: _in_flight_zero(express), within=5)


async def test_a_selection_behind_the_actors_work_continues_on_the_express_path(
    routers: tuple[InProcessRouter, InProcessRouter, list[MockWorker]],
) -> None:
    """While the scheduler actor is busy (a command that queues itself again until released), a
    request's selection waits in its queue: its answer continues the request on the express path
    (no ASGI task), and the client gets its answer. A client that goes away while its selection
    waits cancels it: the actor skips it, nothing is booked, and a 499 is counted."""
    from router.commands import Inspect

    class Hold(Inspect):
        liveness = True  # ahead of every request's command: the selections wait behind it

    express, _, _ = routers
    sched = express.runtime.scheduler
    release = asyncio.Event()

    def busy(s: Any) -> None:
        if not release.is_set():
            s.submit(Hold(busy))

    gone = express.runtime.metrics.rejections.labels("client_gone")
    gone_before = gone._value.get()
    before = paths(express)
    body = json.dumps({"model": MODEL, "prompt": "queued", "max_tokens": 2, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    skipped = sched.stats["skipped"]
    sched.submit(Hold(busy))
    try:
        leaving = socket.create_connection(("127.0.0.1", express.settings.port))
        leaving.sendall(request)
        await wait_for(lambda: sched._queued_selections >= 1, within=10)
        leaving.close()
        await wait_for(lambda: gone._value.get() == gone_before + 1, within=10)
        staying = socket.create_connection(("127.0.0.1", express.settings.port))
        staying.sendall(request)
        await wait_for(lambda: sched._queued_selections >= 2, within=10)  # (the one gone still queued)
    finally:
        release.set()
    try:
        staying.setblocking(False)
        raw = await _read_to_eof(staying, within=15)
    finally:
        staying.close()
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"0\r\n\r\n"), raw[:300]
    assert b"data: [DONE]" in raw
    assert paths(express) == (before[0] + 2, before[1])
    assert await sched.inspect(lambda s: s._queued_selections) == 0
    assert sched.stats["skipped"] == skipped + 1  # the gone client's selection, never made
    await wait_for(lambda: _in_flight_zero(express), within=5)
