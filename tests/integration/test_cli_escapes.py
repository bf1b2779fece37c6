"""``rudder workers list`` prints what a worker said on the bus without its terminal escape
sequences (issue 17 item 7): a record published with a worker's own credential whose engine
carries OSC 52 (writes the clipboard) and a CSI sequence, read back through a real control plane."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from nats.aio.client import Client as NATS

from bus.identities import Identity, IdentityKind
from controlplane.protocol.events import MembershipEvent, MembershipOp, WorkerRecord
from controlplane.protocol.subjects import membership_subject
from tests import buskit
from tests.integration.test_cli import Env, env  # noqa: F401 - the module's control plane fixture
from tests.support_router.workers import wait_for
from worker.settings import random_instance_id

pytestmark = pytest.mark.timeout(60)

EVIL = "mock\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\u202e\x9b31m"


async def test_escape_codes_in_a_workers_record_are_not_printed(env: Env, nats_url: str) -> None:  # noqa: F811
    model = f"esc/{uuid.uuid4().hex[:6]}"
    wid = random_instance_id()
    rec = WorkerRecord(instance_id=wid, model=model, url="http://127.0.0.1:9", engine=EVIL, block_size=16,
                       kv_total_blocks=64, max_num_batched_tokens=512, started_at=datetime.now(UTC))
    nc: NATS = await buskit.connect_as(nats_url, Identity(IdentityKind.WORKER, model=model, instance_id=wid))
    try:
        event = MembershipEvent(op=MembershipOp.JOIN, worker=rec, at=datetime.now(UTC))
        await nc.jetstream().publish(membership_subject(model, wid), event.to_bytes())
    finally:
        await nc.close()
    await wait_for(lambda: any(w["instance_id"] == wid for w in env.ok("workers", "list")), within=15)
    result = env.run("workers", "list", json_out=False)
    assert result.exit_code == 0, result.stderr
    assert str(wid) in result.stdout and "mock]52;c;cm0gLXJmIH4=[2J31m" in result.stdout
    for ch in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert ch not in result.stdout, repr(result.stdout)
