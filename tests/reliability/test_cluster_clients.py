"""A router and a worker given a 3-node cluster as a comma-separated RUDDER_NATS_URL connect, and
keep serving when the node they were connected to is killed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus.streams import BusLayout
from tests import buskit
from tests.reliability.cluster import NatsCluster
from tests.support_router.fleet import chat, mock_fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MODEL = "cluster/model"


async def test_router_and_worker_on_a_cluster_url_list(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "cluster")
    await asyncio.to_thread(cluster.start)
    try:
        assert "," in cluster.url
        await asyncio.to_thread(buskit.init_streams, cluster.url, BusLayout(replicas=3))
        async with mock_fleet(cluster.url, MODEL, workers=1, stream_replicas=3) as router:
            assert (await chat(router.url, MODEL))["usage"]["completion_tokens"] == 3
            nc = router.runtime.bus.nc
            assert nc is not None and nc.is_connected
            connected_port = nc.connected_url.port if nc.connected_url else None
            victim = next(n for n, p in cluster.client_ports.items() if p == connected_port)
            await asyncio.to_thread(cluster.kill, victim)
            # The router reconnects to another node; chats keep working throughout.
            for _ in range(100):
                if nc.is_connected and nc.connected_url and nc.connected_url.port != connected_port:
                    break
                await asyncio.sleep(0.1)
            assert nc.connected_url is not None and nc.connected_url.port != connected_port
            assert (await chat(router.url, MODEL, "after the kill"))["usage"]["completion_tokens"] == 3
    finally:
        await asyncio.to_thread(cluster.stop)
