"""The fleet harness's TCP proxy (tests/reliability/tcpproxy.py) does what a partition does: in
STALL nothing moves (and what was held flows on PASS), in DROP open connections close and new ones
are closed at once. And the nodes behind it can be told not to advertise each other."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cli.embedded import nats_server_config
from tests.reliability.tcpproxy import Mode, TcpProxy

pytestmark = pytest.mark.timeout(20)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    writer.close()


async def test_the_proxy_passes_stalls_and_drops() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = TcpProxy(("127.0.0.1", port))
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"one")
        assert await asyncio.wait_for(reader.read(3), 2) == b"one"

        proxy.set(Mode.STALL)
        writer.write(b"two")
        pending = asyncio.ensure_future(reader.read(3))
        done, _ = await asyncio.wait({pending}, timeout=0.3)
        assert not done  # nothing came back while stalled
        proxy.set(Mode.PASS)
        assert await asyncio.wait_for(pending, 2) == b"two"  # held, then delivered

        proxy.set(Mode.DROP)
        assert await asyncio.wait_for(reader.read(3), 2) == b""  # the open connection is closed
        again_r, _ = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(again_r.read(3), 2) == b""  # a new one too
        writer.close()
    finally:
        await proxy.close()
        server.close()


def test_cluster_nodes_can_be_told_not_to_advertise(tmp_path: Path) -> None:
    def config(**kw: bool) -> str:
        return nats_server_config(port=1, monitor_port=2, store_dir=tmp_path, auth_include=None,
                                  cluster=("c", 3, [3, 4, 5]), **kw)
    assert "no_advertise" not in config()
    assert "no_advertise: true" in config(no_advertise=True)
