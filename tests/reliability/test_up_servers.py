"""B5: ``rudder up`` supervises its servers. PostgreSQL's postmaster killed with SIGKILL is
started again and writes work again; ``rudder status`` lists PostgreSQL and counts the restarts of
PostgreSQL and NATS (a NATS node SIGKILLed is restarted and counted)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from cli.config import read_credentials
from cli.embedded import free_port
from tests.integration.test_up import Up, rudder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "mock-model"


def _processes(cwd: Path) -> dict[str, dict[str, object]]:
    done = rudder(cwd, "--json", "status")
    assert done.returncode == 0, done.stderr
    return {p["name"]: p for p in json.loads(done.stdout)["processes"]}


def _wait(what: str, cond: object, timeout: float = 90) -> None:
    assert callable(cond)
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g}s"
        time.sleep(0.2)


def _patch(server: str, token: str, revision: int, value: float) -> httpx.Response:
    return httpx.patch(f"{server}/router_policy", timeout=10, headers={"Authorization": f"Bearer {token}"},
                       json={"model": MODEL, "expected_revision": revision,
                             "parameters": {"router_temperature": value}})


def test_up_restarts_a_killed_postgres_and_counts_server_restarts(tmp_path: Path) -> None:
    ports = {"admin": free_port(), "router": free_port(), "nats": free_port(), "postgres": free_port()}
    up = Up(tmp_path, ports, extra=["--no-workers", "--no-router"])
    try:
        up.wait_for("rudder up: ready")
        creds = read_credentials(tmp_path / ".rudder" / "credentials")
        server, token = creds["RUDDER_SERVER"], creds["RUDDER_TOKEN"]
        procs = _processes(tmp_path)
        assert procs["postgres"]["restarts"] == 0 and procs["postgres"]["state"] == "running"
        assert procs["nats"]["restarts"] == 0
        r = _patch(server, token, 0, 0.1)
        assert r.status_code == 200, r.text
        head = r.json()["revision"]

        pg_pid = procs["postgres"]["pid"]
        assert isinstance(pg_pid, int)
        os.kill(pg_pid, signal.SIGKILL)
        up.wait_for("postgres      restarted", timeout=90)
        _wait("postgres listed as restarted", lambda: _processes(tmp_path)["postgres"]["restarts"] == 1)
        assert _processes(tmp_path)["postgres"]["pid"] != pg_pid
        # Writes work again by themselves (the control plane's pool reconnects).
        deadline = time.monotonic() + 60
        while (r := _patch(server, token, head, 0.2)).status_code == 503:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.status_code == 200, r.text

        nats_pid = procs["nats"]["pid"]
        assert isinstance(nats_pid, int)
        os.kill(nats_pid, signal.SIGKILL)
        _wait("nats listed as restarted", lambda: _processes(tmp_path)["nats"]["restarts"] == 1)
        nats = _processes(tmp_path)["nats"]
        assert nats["pid"] != nats_pid and nats["last_exit"] == -9
        human = rudder(tmp_path, "status")
        assert human.returncode == 0 and "postgres" in human.stdout
    finally:
        assert up.stop() == 0, "".join(up.output)
