"""Kill the JetStream stream leader of a 3-node cluster (R3, fsync always) under a stream of
policy writes: writes get 503 while a new leader is elected, then succeed; no accepted write is lost
and the audit log and the stream agree."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from bus.streams import BusLayout
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import STREAM_POLICY
from migrations import upgrade_async
from tests import buskit
from tests.integration.cp_support import client, controlplane, make_tokens
from tests.policy_keys import session_keys
from tests.reliability.cluster import NatsCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_leader_killed_under_writes_loses_nothing(tmp_path: Path, database_url: str,
                                                        database_owner_url: str) -> None:
    cluster = NatsCluster(tmp_path / "cluster")
    await asyncio.to_thread(cluster.start)
    try:
        await upgrade_async(database_owner_url)
        tokens = await make_tokens(database_url)
        model = f"ha/{uuid.uuid4().hex[:6]}"
        # The bus admin creates the R3 streams (retrying until the cluster has formed).
        await asyncio.to_thread(buskit.init_streams, cluster.url, BusLayout(replicas=3, history_depth=100_000))
        cp_ctx = controlplane(cluster.url, database_url, stream_replicas=3, history_depth=100_000)
        running = await cp_ctx.__aenter__()
        try:
            accepted: list[int] = []
            unavailable = 0
            async with client(running, tokens.operator) as http:
                nc = await buskit.admin_connect(cluster.url)
                info = await nc.jetstream().stream_info(STREAM_POLICY)
                assert info.config.num_replicas == 3
                revision = 0
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 15
                killed, kill_at = False, 0
                # Until 20 writes were accepted after the kill (the new leader took over), at most 15 s.
                while loop.time() < deadline and not (killed and len(accepted) >= kill_at + 20):
                    if not killed and len(accepted) >= 20:
                        info = await nc.jetstream().stream_info(STREAM_POLICY)
                        leader = info.cluster.leader if info.cluster else None
                        assert leader in cluster.names
                        await asyncio.to_thread(cluster.kill, leader)
                        killed = True
                        kill_at = len(accepted)
                    r = await http.patch("/router_policy", json={
                        "model": model, "expected_revision": revision,
                        "parameters": {"router_temperature": (len(accepted) % 100) / 100}})
                    if r.status_code == 200:
                        revision = r.json()["revision"]
                        accepted.append(revision)
                    elif r.status_code == 409:  # an ambiguous write did land: continue from the head
                        revision = r.json()["error"]["head_revision"]
                    else:
                        assert r.status_code == 503, r.text
                        unavailable += 1
                        await asyncio.sleep(0.1)
                assert killed and len(accepted) > kill_at, (len(accepted), unavailable)
                stored = [s.revision async for s in session_keys().policy_log(nc).history(model, PolicyKind.SELECTION)]
                assert set(accepted) <= set(stored), "an acknowledged write was lost"
                await running.controlplane.reconciler.resolve_pending(grace=__import__("datetime").timedelta(0))
                report = await running.controlplane.reconciler.check()
                assert report.ok, report
                await nc.close()
        finally:
            await cp_ctx.__aexit__(None, None, None)
    finally:
        await asyncio.to_thread(cluster.stop)
