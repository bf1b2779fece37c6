"""B4 on a real router process whose clock is off the NATS server's (libfaketime): +5 s used to
stale every worker (every chat 503 while /health said ok), +1 h to drop them all (/health
"starting" for ever). Ages are now measured on the server's clock: the router is healthy and
serves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.embedded import free_port
from tests import buskit
from tests.policy_keys import session_keys
from tests.support_router.workers import wait_for
from worker import agent
from worker.settings import MockEngineSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
MODEL = "skew/model"


def _start_router(faketime: str, offset: str, port: int, env: dict[str, str],
                  log_path: Path) -> subprocess.Popen[bytes]:
    """The router under ``faketime``, in its own process group: faketime runs the router as its
    child, so signalling faketime alone left the router running after the test."""
    with open(log_path, "wb") as log:
        return subprocess.Popen([faketime, "-f", offset, sys.executable, "-m", "cli.main", "serve", "router",
                                 "--model", MODEL, "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (a zombie left for PID 1 to reap does not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _stop_group(proc: subprocess.Popen[bytes], *, within_s: float = 15.0) -> None:
    """Stop faketime and the router it runs (SIGTERM to the group, SIGKILL past ``within_s``);
    raises if anything of the group is still there."""
    pgid = proc.pid  # the leader of its own session
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        proc.poll()
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        deadline = time.monotonic() + 5
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    proc.poll()
    assert not _group_alive(pgid), f"router process group {pgid} still running after SIGKILL"


@pytest.mark.parametrize("offset", ["+5s", "+1h", "-1h"])
async def test_a_router_with_a_skewed_clock_serves(nats_url: str, tmp_path: Path, offset: str) -> None:
    faketime = shutil.which("faketime")
    if faketime is None:
        pytest.skip("libfaketime is not installed (apt-get install -y faketime)")
    stop = asyncio.Event()
    ready: list[Any] = []
    settings = buskit.worker_settings(nats_url=nats_url, model=MODEL, heartbeat_s=0.3,
                                      mock=MockEngineSettings(speedup_ratio=50.0, block_size=16))
    worker = asyncio.create_task(agent.serve(settings, stop=stop, on_ready=ready.append))  # type: ignore[arg-type]
    port = free_port()
    router_id = f"skew-{offset.replace('+', 'p').replace('-', 'm')}-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUDDER_")}
    env.update({"RUDDER_NATS_URL": nats_url, "RUDDER_NATS_CREDS": str(buskit.router_creds(router_id)),
                "RUDDER_ROUTER_ID": router_id, "RUDDER_POLICY_VERIFY_KEYS": str(session_keys().verify_path),
                "PYTHONUNBUFFERED": "1", "DONT_FAKE_MONOTONIC": "1"})
    proc = None
    try:
        await wait_for(lambda: bool(ready) or worker.done(), within=30)
        proc = _start_router(faketime, offset, port, env, tmp_path / "router.log")
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=5) as http:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, (tmp_path / "router.log").read_text()
                with contextlib.suppress(httpx.HTTPError):
                    health = await http.get(f"{url}/health")
                    if health.status_code == 200:
                        break
                assert time.monotonic() < deadline, (health.text, (tmp_path / "router.log").read_text()[-3000:])
                await asyncio.sleep(0.2)
            for i in range(5):
                r = await http.post(f"{url}/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": f"skew {i}"}], "max_tokens": 2})
                assert r.status_code == 200, r.text
    finally:
        if proc is not None:
            _stop_group(proc)
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(worker, 10)
