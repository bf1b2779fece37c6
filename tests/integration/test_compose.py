"""compose.yaml, run as written without a container engine (tests/support_compose.py): the
bus-setup, migration, policy-keys and bus-init jobs, a 3-node NATS cluster from
deploy/nats/*.conf with auth and TLS, PostgreSQL, the control plane, both routers and both
workers. A chat goes through each router, a policy change is applied by both, and killing a NATS
node changes neither."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support_compose import ROOT, ComposeFleet, Service, copy_project

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
MODEL = "mock-model"


def _wait(what: str, check: Any, within: float = 90.0) -> Any:
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {within}s (last: {last!r})")


def _chat(url: str, text: str) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=20, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _token(fleet: ComposeFleet) -> str:
    """`docker compose run --rm cli token create --role admin --name me`."""
    cli = Service("cli", fleet.compose["services"]["cli"], fleet.work / "roots" / "cli")
    env = {**os.environ, **fleet.environment(cli), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "cli.main", "token", "create", "--role", "admin",
                          "--name", "me"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _patch_applied_by_both(fleet: ComposeFleet, token: str, value: float) -> None:
    cp = fleet.url_of("controlplane", 8080)
    headers = {"authorization": f"Bearer {token}"}

    def write() -> int | None:
        head = httpx.get(f"{cp}/router_policy", params={"model": MODEL}, headers=headers, timeout=5).json()
        docs = [d for d in head["documents"] if d["kind"] == "selection"]
        r = httpx.patch(f"{cp}/router_policy", headers=headers, timeout=10, json={
            "model": MODEL, "kind": "selection", "expected_revision": docs[0]["revision"] if docs else 0,
            "parameters": {"router_temperature": value}})
        return int(r.json()["revision"]) if r.status_code == 200 else None  # 503 during an election

    revision = _wait("policy write accepted", write, within=60)

    def applied() -> bool:
        routers = httpx.get(f"{cp}/routers", headers=headers, timeout=5).json()["routers"]
        revs = {r["router_id"]: r["applied"].get(f"{MODEL}|selection", {}).get("revision") for r in routers}
        return revs.get("router-1") == revision and revs.get("router-2") == revision

    _wait(f"revision {revision} applied by both routers", applied, within=30)


def test_compose_fleet_runs_as_written(tmp_path: Path) -> None:
    project = copy_project(tmp_path / "project")
    fleet = ComposeFleet(project, tmp_path / "run")
    try:
        fleet.run_once("bus-setup")  # docker compose run --rm bus-setup
        fleet.start_all()            # docker compose up -d
        routers = [fleet.url_of("router-1", 8000), fleet.url_of("router-2", 8000)]
        for url in routers:
            _wait(f"{url} sees both workers", lambda url=url: [
                m["workers"] for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
                if m["id"] == MODEL] == [2])
        token = _token(fleet)
        for url in routers:
            assert _chat(url, f"hello {url}")["usage"]["completion_tokens"] == 2
        _patch_applied_by_both(fleet, token, 0.25)

        fleet.kill("nats-1")
        for url in routers:
            assert _chat(url, f"after the kill {url}")["usage"]["completion_tokens"] == 2
        _patch_applied_by_both(fleet, token, 0.5)
    except BaseException:
        for name in fleet.services:
            print(f"--- {name}\n{fleet.log_tail(name)}")
        raise
    finally:
        fleet.stop()
