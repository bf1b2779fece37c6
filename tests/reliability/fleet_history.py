"""Recording a fault run for the history checker (tests/reliability/history.py): CAS writers that
record every attempt, and the read-back of the stream, the audit log and the router ACKs.

Times are on this process's monotonic clock; ACK times (router wall clock, same machine) are
mapped onto it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx
from nats.aio.client import Client as NATS

from cli.embedded import free_port
from controlplane.audit.records import AuditStage
from controlplane.audit.store import AuditStore
from controlplane.protocol.policy import PolicyKind
from tests import buskit
from tests.policy_keys import session_keys
from tests.reliability.history import Answer, Apply, Attempt, Decision, History

#: Monotonic minus wall clock, fixed at import (both clocks run at the same rate).
_OFFSET = time.monotonic() - time.time()


def mono() -> float:
    return time.monotonic()


def to_mono(at: str | datetime) -> float:
    when = datetime.fromisoformat(at) if isinstance(at, str) else at
    return when.timestamp() + _OFFSET


def document(model: str) -> str:
    return f"{model}/{PolicyKind.SELECTION.value}"


async def cas_writer(http: httpx.AsyncClient, model: str, name: str, stop: asyncio.Event,
                     attempts: list[Attempt]) -> None:
    """PATCH the selection document with compare-and-set until ``stop``; every attempt recorded.
    After a conflict the next attempt expects the head the answer named."""
    expected, i = 0, 0
    doc = document(model)
    while not stop.is_set():
        i += 1
        t0 = mono()
        try:
            r = await http.patch("/router_policy", json={
                "model": model, "expected_revision": expected,
                "parameters": {"router_temperature": round((hash(name) % 50 + i % 50) / 100, 2)}})
        except httpx.HTTPError:
            attempts.append(Attempt(name, doc, expected, Answer.UNKNOWN, t0, None))
            await asyncio.sleep(0.05)
            continue
        t1 = mono()
        body = r.json()
        if r.status_code == 200:
            attempts.append(Attempt(name, doc, expected, Answer.ACCEPTED, t0, t1,
                                    new_revision=body["revision"], event_id=body["event_id"]))
            expected = body["revision"]
            continue
        error = body.get("error", {})
        code = error.get("code")
        if r.status_code == 409:
            attempts.append(Attempt(name, doc, expected, Answer.CONFLICT, t0, t1,
                                    head_revision=error.get("head_revision")))
            expected = int(error.get("head_revision") or expected)
        elif code == "decision_unrecorded":
            attempts.append(Attempt(name, doc, expected, Answer.ACCEPTED, t0, t1,
                                    new_revision=error["new_revision"], event_id=error["event_id"]))
            expected = error["new_revision"]
        elif code == "log_ambiguous":
            attempts.append(Attempt(name, doc, expected, Answer.UNKNOWN, t0, None, event_id=error.get("event_id")))
            await asyncio.sleep(0.05)
        else:  # a definite refusal: nothing was published
            attempts.append(Attempt(name, doc, expected, Answer.REFUSED, t0, t1))
            await asyncio.sleep(0.05)


async def audit_decisions(store: AuditStore, model: str) -> list[Decision]:
    """Every recorded decision of ``model``'s writes (dry runs aside), oldest first."""
    out: list[Decision] = []
    cursor: str | None = None
    while True:
        rows, cursor = await store.query(model=model, limit=1000, cursor=cursor)
        out += [Decision(str(row.event_id), str(row.decision), row.reason_code, row.new_revision) for row in rows
                if row.stage == AuditStage.DECISION.value and not row.dry_run and row.event_id is not None]
        if cursor is None:
            return out


async def read_back(nc: NATS, store: AuditStore, model: str, *, routers: list[str]) -> History:
    """The stream, the audit decisions and the router ACKs of ``model``'s selection document."""
    doc = document(model)
    h = History()
    held = {s.revision: s.msg_id or "" async for s in
            session_keys().policy_log(nc).history(model, PolicyKind.SELECTION)}
    h.stream[doc] = held
    if held:
        h.retired_below[doc] = min(held)
    h.audit.extend(await audit_decisions(store, model))
    for router in routers:
        for ack in await store.acks(router_id=router, model=model, limit=1000):
            if ack["event_id"]:
                h.acked_events.add(ack["event_id"])
            if ack["status"] == "ACK":
                h.applies.append(Apply(router, doc, int(ack["revision"]), to_mono(ack["at"])))
    h.live_routers = set(routers)
    return h


def start_router_process(nats_url: str, model: str, log_path: Path, *,
                         prefix: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    """A router as its own process (``rudder serve router``) so that it can be paused, killed or
    run under another clock (``prefix``: e.g. ``faketime -f +1h``); returns it, its id and URL."""
    router_id = f"r-{uuid.uuid4().hex[:10]}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUDDER_")}
    env.update({"RUDDER_NATS_URL": nats_url, "RUDDER_NATS_CREDS": str(buskit.router_creds(router_id)),
                "RUDDER_ROUTER_ID": router_id, "RUDDER_POLICY_VERIFY_KEYS": str(session_keys().verify_path),
                "RUDDER_HEARTBEAT_S": "0.5", "PYTHONUNBUFFERED": "1"})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "cli.main", "serve", "router",
                                 "--model", model, "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    return proc, router_id, f"http://127.0.0.1:{port}"
