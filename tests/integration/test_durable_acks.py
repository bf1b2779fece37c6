"""Router ACK/NACKs through the RUDDER_ACKS stream into the ACK table (issue 8, item 3).

Real routers, real control planes, real JetStream and PostgreSQL: an ACK sent while no control
plane runs is recorded once one starts; with two control planes sharing the fleet's durable
consumer, every ACK is stored exactly once; a redelivered ACK (same stream sequence) is not
written twice.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import nats
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS

from bus.client import Bus
from bus.identities import Identity, IdentityKind
from bus.tasks import Tasks
from controlplane.acks import AckConsumer
from controlplane.audit.ack_chain import ACK_CHAIN_LOCK_KEY
from controlplane.audit.store import AckRecord, AuditStore, Chain
from controlplane.protocol.events import AckStatus, ApplyAck
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import STREAM_ACKS, acks_subject, policy_subject
from tests import buskit
from tests.integration.cp_support import controlplane
from tests.support_router.policy import publish_policy
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[NATS]:
    nc = await buskit.admin_connect(nats_url)
    yield nc
    await nc.close()


@pytest.fixture
async def store(db: str) -> AsyncIterator[AuditStore]:
    s = AuditStore.from_url(db)
    yield s
    await s.close()


def ack(router_id: str, revision: int) -> ApplyAck:
    return ApplyAck(router_id=router_id, model="m", kind=PolicyKind.SELECTION, revision=revision,
                    status=AckStatus.ACK, at=datetime.now(UTC))


async def test_an_ack_sent_while_no_control_plane_runs_is_recorded_when_one_starts(
        nats_url: str, db: str, client: NATS, store: AuditStore) -> None:
    model = f"acks/{uuid.uuid4().hex[:6]}"
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    router_id = router.runtime.settings.router_id
    js = client.jetstream()
    try:
        revision = await publish_policy(js, model, {"router_temperature": 0.5}, expected_revision=0)

        async def in_stream() -> bool:
            info = await js.stream_info(STREAM_ACKS, subjects_filter=acks_subject(router_id))
            return bool(info.state.subjects) and info.state.subjects.get(acks_subject(router_id), 0) >= 1

        await wait_for(in_stream)  # the router published it, and nobody has consumed it
    finally:
        await router.stop()
    assert await store.acks(router_id=router_id) == []  # no control plane ran: not recorded yet

    async with controlplane(nats_url, db):
        async def recorded() -> bool:
            return len(await store.acks(router_id=router_id)) == 1

        await wait_for(recorded, within=15)
    [row] = await store.acks(router_id=router_id)
    assert (row["revision"], row["status"], row["model"]) == (revision, "ACK", model)
    assert (await store.verify(chain=Chain.ACKS)).ok


async def test_two_control_planes_store_each_ack_once(
        nats_url: str, db: str, client: NATS, store: AuditStore) -> None:
    router_id = f"r-{uuid.uuid4().hex[:8]}"
    js = client.jetstream()
    n = 300
    # Revisions that exist (signed events): an ACK for one never written is refused (issue 17).
    model = f"acks/{uuid.uuid4().hex[:6]}"
    revisions = [0]
    for i in range(n):
        revisions.append(await publish_policy(js, model, {"router_temperature": i / n},
                                              expected_revision=revisions[-1]))
    revisions = revisions[1:]
    async with controlplane(nats_url, db) as a, controlplane(nats_url, db) as b:
        # Exactly what a router's PolicyConsumer publishes, many of them, to the stream.
        for revision in revisions:
            ack = ApplyAck(router_id=router_id, model=model, kind=PolicyKind.SELECTION, revision=revision,
                           status=AckStatus.ACK, at=datetime.now(UTC))
            await js.publish(acks_subject(router_id), ack.to_bytes())

        async def all_recorded() -> bool:
            return len(await store.acks(router_id=router_id, limit=1000)) >= n

        await wait_for(all_recorded, within=30)
        # Both replicas fetch from the same durable consumer: nothing left pending.
        info = await js.consumer_info(STREAM_ACKS, a.controlplane.settings.acks_consumer)

        async def drained() -> bool:
            i = await js.consumer_info(STREAM_ACKS, a.controlplane.settings.acks_consumer)
            return i.num_ack_pending == 0 and i.num_pending == 0

        await wait_for(drained, within=15)
        written = a.controlplane.acks.recorded + b.controlplane.acks.recorded
    rows = await store.acks(router_id=router_id, limit=1000)
    assert len(rows) == n
    assert sorted(r["revision"] for r in rows) == revisions
    assert written >= n  # the two replicas wrote these (and possibly earlier tests' ACKs) ...
    assert info.config.durable_name == a.controlplane.settings.acks_consumer
    assert (await store.verify(chain=Chain.ACKS)).ok  # ... as one chain


async def test_a_redelivered_ack_is_written_once(db: str, store: AuditStore) -> None:
    # Redelivery (a control plane died between commit and ack) or two consumers racing: the same
    # stream sequence from two stores at once is one row.
    other = AuditStore.from_url(db)
    base = 10**9 + uuid.uuid4().int % 10**6 * 100
    router_id = f"r-{uuid.uuid4().hex[:8]}"
    batch = [AckRecord(ApplyAck(router_id=router_id, model="m", kind=PolicyKind.SELECTION,
                                revision=i, status=AckStatus.ACK, at=datetime.now(UTC)),
                       stream_seq=base + i) for i in range(20)]
    try:
        written = await asyncio.gather(store.record_acks(batch), other.record_acks(batch),
                                       store.record_acks(batch[:5] + batch[:5]))
    finally:
        await other.close()
    assert sum(written) == 20
    assert len(await store.acks(router_id=router_id)) == 20
    assert (await store.verify(chain=Chain.ACKS)).ok


async def test_acks_redelivered_to_another_replica_while_the_first_is_stuck_are_stored_once(
        nats_url: str, db: str, client: NATS, store: AuditStore) -> None:
    """Two consumers on one durable with a short ack_wait; the ACK chain's lock is held by someone
    else for longer than ack_wait, so JetStream redelivers what the first fetched to the second.
    Both then write the same stream sequences: one row each."""
    router_id = f"r-{uuid.uuid4().hex[:8]}"
    durable = f"redelivery-{uuid.uuid4().hex[:6]}"
    js = client.jetstream()
    stores = [AuditStore.from_url(db, timeout_s=5.0) for _ in range(2)]
    consumers = [AckConsumer(Bus(client), s, durable=durable, ack_wait_s=0.5, batch=50) for s in stores]
    tasks = Tasks("test")
    blocker = await asyncpg.connect(db.replace("postgresql+asyncpg://", "postgresql://", 1))
    n = 50
    # Only this test's ACKs on the stream (earlier tests' would be fetched first by a new durable).
    await js.purge_stream(STREAM_ACKS)
    try:
        await blocker.execute("SELECT pg_advisory_lock($1)", ACK_CHAIN_LOCK_KEY)
        for i in range(n):
            await js.publish(acks_subject(router_id), ack(router_id, i + 1).to_bytes())
        for c in consumers:
            tasks.spawn(c.run(), name="ack-consumer")

        async def redelivered() -> bool:
            try:
                return (await js.consumer_info(STREAM_ACKS, durable)).num_redelivered > 0
            except nats.js.errors.NotFoundError:  # not created by the consumers yet
                return False

        await wait_for(redelivered, within=10)
        await blocker.execute("SELECT pg_advisory_unlock($1)", ACK_CHAIN_LOCK_KEY)

        async def drained() -> bool:
            info = await js.consumer_info(STREAM_ACKS, durable)
            return info.num_ack_pending == 0 and info.num_pending == 0

        await wait_for(drained, within=20)
    finally:
        await blocker.close()
        await tasks.close()
        for s in stores:
            await s.close()
    rows = await store.acks(router_id=router_id, limit=1000)
    assert sorted(r["revision"] for r in rows) == list(range(1, n + 1))  # each once
    assert sum(c.recorded for c in consumers) >= n
    assert (await store.verify(chain=Chain.ACKS)).ok


async def test_a_back_dated_ack_and_one_for_a_revision_never_written_are_not_believed(
        nats_url: str, db: str, client: NATS, store: AuditStore) -> None:
    """Issue 17 item 7: a router (its own credential, its own ACK subject) stamps its ACK a year
    back, and ACKs revisions that were never written: the row carries the time the stream stored
    the ACK, and the others are refused and counted."""
    model = f"acks/{uuid.uuid4().hex[:6]}"
    router_id = f"r-{uuid.uuid4().hex[:8]}"
    js = client.jetstream()
    good = await publish_policy(js, model, {"router_temperature": 0.5}, expected_revision=0)
    junk = int((await js.publish(policy_subject(model, "selection"), b"junk")).seq)
    other = await publish_policy(js, f"{model}-other", {"router_temperature": 0.5}, expected_revision=0)
    last = (await js.stream_info("RUDDER_POLICY")).state.last_seq
    year_ago = datetime.now(UTC) - timedelta(days=365)

    def ack(revision: int, status: AckStatus = AckStatus.ACK) -> ApplyAck:
        return ApplyAck(router_id=router_id, model=model, kind=PolicyKind.SELECTION, revision=revision,
                        status=status, at=year_ago)

    router_nc = await buskit.connect_as(nats_url, Identity(IdentityKind.ROUTER, router_id=router_id))
    async with controlplane(nats_url, db) as cp:
        try:
            sent = datetime.now(UTC)
            for a in (ack(good), ack(junk, AckStatus.NACK), ack(junk), ack(last + 1000),
                      ack(other), ack(last + 1000, AckStatus.NACK)):
                await router_nc.publish(acks_subject(router_id), a.to_bytes())
            await router_nc.flush()
        finally:
            await router_nc.close()
        drops = cp.controlplane.fleet.drops.totals

        async def settled() -> bool:
            return (len(await store.acks(router_id=router_id)) == 2
                    and drops.get(("ack", "unknown_revision"), 0) >= 4)

        await wait_for(settled, within=15)
    rows = await store.acks(router_id=router_id)
    assert sorted((r["revision"], r["status"]) for r in rows) == [(good, "ACK"), (junk, "NACK")]
    for row in rows:  # the stream's time, not the router's claim
        assert datetime.fromisoformat(row["at"]) >= sent - timedelta(seconds=5)
    assert drops[("ack", "unknown_revision")] >= 4  # (the shared durable may hold earlier tests' too)
