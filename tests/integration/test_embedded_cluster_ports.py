"""``rudder up --ha``'s bus (cli.embedded.LocalBus with 3 nodes) when a port it picked is taken
by another process before its node binds it: the node exits at start, and the cluster starts again
on fresh ports instead of failing (a flake of the HA test before)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from cli.embedded import LocalBus, free_port
from tests import buskit


def test_free_ports_handed_out_in_a_row_are_distinct() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_a_cluster_whose_route_port_is_taken_starts_on_fresh_ports(tmp_path: Path) -> None:
    bus = LocalBus(tmp_path, authority=buskit.authority(), nodes=3)
    cluster = bus.servers[1].cluster
    assert cluster is not None
    taken = cluster[1]
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    try:
        bus.start()
        try:
            routes = [s.cluster[1] for s in bus.servers if s.cluster is not None]
            assert taken not in routes and len(set(routes)) == 3
            assert all(s.running for s in bus.servers)

            async def ping() -> None:
                nc = await bus.admin_connect()
                try:
                    info = await nc.jetstream().account_info()
                    assert info.streams >= 1  # bus init ran on the cluster
                finally:
                    await nc.close()

            asyncio.run(ping())
        finally:
            bus.stop()
    finally:
        squatter.close()
