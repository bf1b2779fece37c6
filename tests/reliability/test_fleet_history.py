"""Fault runs checked by the history checker (issue 18, items 2 and 3): three CAS writers on the
admin API and a router applying every revision, while NATS is stopped and started again (same
store), or while the router process is paused (SIGSTOP/SIGCONT). Afterwards the reconciler
settles what the fault left ambiguous, and the history checker finds the CAS history
linearizable, every router apply in order, the router on the head within 2 s of the last fault (or
of the head's write), no acknowledged write missing, and no event on the stream or ACKed recorded
as rejected."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from bus.identities import Identity, IdentityKind
from cli.embedded import DatabaseAccess, EmbeddedNats, EmbeddedPostgres
from controlplane.audit.store import AuditStore
from controlplane.protocol.policy import PolicyKind
from migrations import upgrade_async
from tests import buskit
from tests.conftest import fresh_database
from tests.integration.cp_support import client, controlplane, make_tokens
from tests.policy_keys import session_keys
from tests.reliability.fleet_history import cas_writer, mono, read_back, start_router_process
from tests.reliability.history import Answer, Attempt, check
from tests.support_router.workers import InProcessRouter, router_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def db(postgres_server: EmbeddedPostgres | None) -> DatabaseAccess:
    """A database of this test's own: reconcile checks every decision in it against this test's
    NATS (each test here has its own)."""
    return fresh_database(postgres_server)


async def test_cas_writers_and_a_router_through_a_nats_restart(own_nats: EmbeddedNats, db: DatabaseAccess) -> None:
    database_url = db.app_url
    await upgrade_async(db.owner_url)
    tokens = await make_tokens(database_url)
    model = f"history/model-{uuid.uuid4().hex[:8]}"
    attempts: list[Attempt] = []
    stop = asyncio.Event()
    store = AuditStore.from_url(database_url)
    async with controlplane(own_nats.url, database_url, reconcile_grace_s=0.0) as cp, \
            client(cp, tokens.operator) as http:
        router = await InProcessRouter(router_settings(own_nats.url, model)).start()
        try:
            writers = [asyncio.create_task(cas_writer(http, model, f"w{i}", stop, attempts)) for i in range(3)]
            await asyncio.sleep(1.0)
            await asyncio.to_thread(own_nats.stop)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(own_nats.start)
            last_fault_at = mono()
            # The writers go on until one of them is accepted after the fault (the clients'
            # reconnection takes its own time: a fixed 1.5 s here was once too short in CI), and
            # a moment more.
            deadline = mono() + 20
            while not any(a.answer is Answer.ACCEPTED and a.invoked > last_fault_at for a in attempts):
                assert mono() < deadline, "no write accepted within 20 s of the fault"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*writers)

            nc = await buskit.connect_as(own_nats.url, Identity(IdentityKind.CONTROLPLANE))
            try:
                head = await session_keys().policy_log(nc).head(model, PolicyKind.SELECTION)
                assert head is not None
                # The router reaches the head, and its ACK of it is recorded.
                deadline = time.monotonic() + 15
                while True:
                    acks = await store.acks(router_id=router.settings.router_id, model=model, status="ACK", limit=1)
                    if acks and acks[0]["revision"] == head.revision:
                        break
                    assert time.monotonic() < deadline, (acks, head.revision)
                    await asyncio.sleep(0.1)
                await cp.controlplane.reconciler.resolve_pending(grace=timedelta(0))
                report = await cp.controlplane.reconciler.check()
                assert report.ok, report
                history = await read_back(nc, store, model, routers=[router.settings.router_id])
            finally:
                await nc.close()
        finally:
            await router.stop()
    await store.close()
    history.attempts = attempts
    history.last_fault_at = last_fault_at
    accepted = [a for a in attempts if a.answer is Answer.ACCEPTED]
    assert accepted and any(a.answer is Answer.CONFLICT for a in attempts), attempts[:5]
    assert any(a.invoked > last_fault_at for a in accepted), "no write accepted after the fault"
    verdict = check(history)
    counts = {answer.value: sum(a.answer is answer for a in attempts) for answer in Answer}
    assert verdict.ok, (str(verdict), counts)



async def test_cas_writers_and_a_paused_router(nats_url: str, db: DatabaseAccess, tmp_path: Path) -> None:
    """A router process stopped (SIGSTOP) for 2 s while writes go on, then continued: it catches
    up in order, without a duplicate, and is on the head within 2 s."""
    database_url = db.app_url
    await upgrade_async(db.owner_url)
    tokens = await make_tokens(database_url)
    model = f"history/paused-{uuid.uuid4().hex[:8]}"
    attempts: list[Attempt] = []
    stop = asyncio.Event()
    store = AuditStore.from_url(database_url)
    proc, router_id, url = start_router_process(nats_url, model, tmp_path / "router.log")
    try:
        async with controlplane(nats_url, database_url, reconcile_grace_s=0.0) as cp, \
                client(cp, tokens.operator) as http, httpx.AsyncClient(timeout=2) as probe:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get(f"{url}/live")).status_code == 200:
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # its policy consumer is subscribed
            writers = [asyncio.create_task(cas_writer(http, model, f"w{i}", stop, attempts)) for i in range(3)]
            await asyncio.sleep(1.0)
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(2.0)
            proc.send_signal(signal.SIGCONT)
            last_fault_at = mono()
            await asyncio.sleep(1.5)
            stop.set()
            await asyncio.gather(*writers)
            nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
            try:
                head = await session_keys().policy_log(nc).head(model, PolicyKind.SELECTION)
                assert head is not None
                deadline = time.monotonic() + 15
                while True:
                    acks = await store.acks(router_id=router_id, model=model, status="ACK", limit=1)
                    if acks and acks[0]["revision"] == head.revision:
                        break
                    assert time.monotonic() < deadline, (acks, head.revision)
                    await asyncio.sleep(0.1)
                await cp.controlplane.reconciler.resolve_pending(grace=timedelta(0))
                report = await cp.controlplane.reconciler.check()
                history = await read_back(nc, store, model, routers=[router_id])
            finally:
                await nc.close()
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        if proc.poll() is None:
            proc.kill()
        await store.close()
    history.attempts, history.last_fault_at = attempts, last_fault_at
    # Every write landed (the router's pause does not touch the write path) and was checked.
    assert report.ok, report
    assert all(a.answer in (Answer.ACCEPTED, Answer.CONFLICT) for a in attempts), attempts
    verdict = check(history)
    assert verdict.ok, str(verdict)
