"""``rudder up --ha`` as a user runs it: kill -9 one NATS node, then one control plane, then one
router, while 4 writers patch policy and a client chats through the surviving router.

Every accepted write is in the stream (same event id at its revision) and in the audit log; after
each kill every live router applies the head within 2 s of the writers pausing; no chat fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from bus.authority import BusAuthority
from bus.connect import BusOptions, connect
from bus.identities import Identity, IdentityKind
from cli.config import read_credentials
from cli.embedded import free_port
from controlplane.protocol.subjects import HDR_MSG_ID, STREAM_POLICY
from tests.integration.test_up import Up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
MODEL = "mock-model"


def _status(cwd: Path) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((cwd / ".rudder" / "status.json").read_text())
    return body


def _process(cwd: Path, name: str) -> dict[str, Any]:
    return next(p for p in _status(cwd)["processes"] if p["name"] == name)


class Writers:
    """4 writers doing read-modify-write PATCHes (CAS), failing over between control planes."""

    def __init__(self, planes: list[str], token: str) -> None:
        self.planes = planes
        self.headers = {"authorization": f"Bearer {token}"}
        self.accepted: list[tuple[int, str]] = []
        self.running = asyncio.Event()
        self.running.set()
        self.stopped = False
        self.unavailable = 0

    async def one(self, n: int) -> None:
        i = n
        async with httpx.AsyncClient(timeout=10, headers=self.headers) as http:
            while not self.stopped:
                await self.running.wait()
                plane = self.planes[i % len(self.planes)]
                try:
                    head = await http.get(f"{plane}/router_policy", params={"model": MODEL})
                    if head.status_code != 200:
                        raise httpx.TransportError(str(head.status_code))
                    docs = [d for d in head.json()["documents"] if d["kind"] == "selection"]
                    revision = docs[0]["revision"] if docs else 0
                    r = await http.patch(f"{plane}/router_policy", json={
                        "model": MODEL, "kind": "selection", "expected_revision": revision,
                        "parameters": {"router_temperature": round(0.001 * (len(self.accepted) % 900 + n), 6)}})
                except httpx.HTTPError:
                    i += 1  # that control plane is away: use the other one
                    await asyncio.sleep(0.05)
                    continue
                if r.status_code == 200:
                    body = r.json()
                    self.accepted.append((body["revision"], body["event_id"]))
                elif r.status_code == 503:
                    self.unavailable += 1
                    await asyncio.sleep(min(float(r.headers.get("retry-after", "1")), 1.0))
                else:
                    assert r.status_code == 409, r.text

    @property
    def head(self) -> int:
        return max((rev for rev, _ in self.accepted), default=0)


class Chats:
    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = 0
        self.failures: list[str] = []
        self.stopped = False

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=20) as http:
            i = 0
            while not self.stopped:
                i += 1
                body = {"model": MODEL, "max_tokens": 2, "stream": i % 2 == 0,
                        "messages": [{"role": "user", "content": f"chat {i}"}]}
                try:
                    r = await http.post(f"{self.url}/v1/chat/completions", json=body)
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                await asyncio.sleep(0.02)


async def _converged(routers: list[str], head: int, within: float) -> float:
    """Seconds until every live router (one that answers) applied ``head`` of the selection
    document, as each router itself reports it (``/health``'s applied revisions)."""
    t0 = time.monotonic()
    last: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=1) as http:
        while time.monotonic() - t0 < within:
            applied: dict[str, int] = {}
            for url in routers:
                try:
                    body = (await http.get(f"{url}/health")).json()
                except (httpx.HTTPError, ValueError):
                    continue  # killed (and not yet restarted): not live
                applied[url] = int(body["applied"].get(f"{MODEL}|selection", 0))
            last = applied
            if applied and all(rev >= head for rev in applied.values()):
                return time.monotonic() - t0
            await asyncio.sleep(0.05)
    raise AssertionError(f"routers not at head {head} within {within}s: {last}")


async def test_up_ha_survives_a_nats_node_a_control_plane_and_a_router(tmp_path: Path) -> None:
    ports = {"admin": free_port(), "router": free_port(), "nats": free_port(), "postgres": free_port()}
    # Keep every revision on the stream, so each accepted write can be found at its revision.
    up = Up(tmp_path, ports, extra=["--ha", "--workers", "2"], env={"RUDDER_HISTORY_DEPTH": "100000"})
    try:
        up.wait_for("rudder up: ready", timeout=240)
        creds = read_credentials(tmp_path / ".rudder" / "credentials")
        token = creds["RUDDER_TOKEN"]
        planes = [_process(tmp_path, f"controlplane-{i}")["url"] for i in (1, 2)]
        routers = {n: _process(tmp_path, n) for n in ("router-1", "router-2")}
        writers = Writers(planes, token)
        chats = Chats(routers["router-2"]["url"])
        tasks = [asyncio.create_task(writers.one(n)) for n in range(4)] + [asyncio.create_task(chats.run())]
        try:
            for victim in ("nats-n1", "controlplane-1", "router-1"):
                # Writes land first: 8 accepted since the last step (this was a fixed 2 s).
                since, deadline = len(writers.accepted), time.monotonic() + 30
                while len(writers.accepted) < since + 8:
                    assert time.monotonic() < deadline, f"no writes before killing {victim}"
                    await asyncio.sleep(0.05)
                before = len(writers.accepted)
                os.kill(_process(tmp_path, victim)["pid"], signal.SIGKILL)
                # Writes keep landing (some may be refused with 503 during an election).
                deadline = time.monotonic() + 30
                while len(writers.accepted) < before + 8:
                    assert time.monotonic() < deadline, f"no writes after killing {victim}"
                    await asyncio.sleep(0.1)
                writers.running.clear()
                await asyncio.sleep(0.3)  # let in-flight PATCHes finish
                print(f"converging after {victim}", flush=True)
                took = await _converged([r["url"] for r in routers.values()], writers.head, within=2.0)
                print(f"{victim}: routers at head {writers.head} after {took:.2f}s")
                writers.running.set()
        finally:
            writers.stopped = chats.stopped = True
            writers.running.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert chats.failures == [] and chats.ok > 0
        assert len({rev for rev, _ in writers.accepted}) == len(writers.accepted)

        # Every accepted write is in the stream, at its revision, with its event id ...
        authority = BusAuthority.open(tmp_path / ".rudder" / "bus", create=False)
        admin = authority.issue(Identity(IdentityKind.ADMIN), tmp_path / "admin.creds")
        nc = await connect(BusOptions(servers=tuple(creds["RUDDER_NATS_URL"].split(",")), creds=admin))
        try:
            js = nc.jetstream()
            for revision, event_id in writers.accepted:
                msg = await js.get_msg(STREAM_POLICY, revision)
                assert (msg.headers or {}).get(HDR_MSG_ID) == event_id
        finally:
            await nc.close()
        # ... and has its accepted decision in the audit log.
        engine = create_async_engine(creds["RUDDER_DATABASE_URL"])
        try:
            async with engine.connect() as conn:
                rows = await conn.execute(text(
                    "SELECT event_id::text FROM audit_log WHERE decision = 'accepted' AND model = :m"),
                    {"m": MODEL})
                audited = {row[0] for row in rows}
        finally:
            await engine.dispose()
        assert {event_id for _, event_id in writers.accepted} <= audited
    finally:
        assert up.stop() == 0, "".join(up.output)
