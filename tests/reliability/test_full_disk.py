"""B2: a NATS server that cannot store (its disk full) is noticed and, under ``rudder up``,
restarted.

The store lives on a small tmpfs; a filler file leaves a few MB, which JetStream then fills, so
its writes fail on a real "no space left on device". Freeing the space does not heal a running
nats-server (its writes keep failing): the control plane's /readyz says ``cannot_store``
throughout, and ``rudder up``'s supervision restarts the node, after which writes work."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from cli.embedded import EmbeddedNats, LocalBus
from cli.stack import Stack
from migrations import upgrade_async
from tests import buskit
from tests.integration.cp_support import client, controlplane
from tests.reliability.diskfull import fill_stream, occupy, small_disk

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_readyz_is_not_ready_while_nats_cannot_store(tmp_path: Path, database_url: str,
                                                           database_owner_url: str) -> None:
    await upgrade_async(database_owner_url)
    with small_disk(tmp_path / "disk", 16) as disk:
        server = EmbeddedNats(disk / "nats", auth=buskit.authority().server_config)
        server.start()
        try:
            await asyncio.to_thread(buskit.init_streams, server.url)
            async with controlplane(server.url, database_url) as cp, client(cp, None) as http:
                ready = await http.get("/readyz")
                assert ready.status_code == 200, ready.text
                assert ready.json()["checks"]["nats_store"] == "ok"
                filler = occupy(disk, leave_mb=3)
                admin = await buskit.admin_connect(server.url)
                try:
                    assert await fill_stream(admin) > 0
                finally:
                    await admin.close()
                ready = await http.get("/readyz")
                assert ready.status_code == 503, ready.text
                checks = ready.json()["checks"]
                assert checks["nats_store"] == "cannot_store" and checks["nats"] == "ok", checks
                filler.unlink()
                # Reads still work and the connection is up: only a write tells.
                ready = await http.get("/readyz")
                assert ready.json()["checks"]["nats"] == "ok"
        finally:
            server.stop(kill=True)


def test_up_restarts_a_nats_that_cannot_store(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 16) as disk:
        lines: list[str] = []
        stack = Stack(data_dir=disk, progress=lines.append)
        stack.start_nats(0)
        bus = stack.bus
        assert isinstance(bus, LocalBus)
        try:
            [server] = bus.servers
            assert bus.probe_store(server) is None
            filler = occupy(disk, leave_mb=3)

            async def fill() -> int:
                admin = await bus.admin_connect()
                try:
                    return await fill_stream(admin)
                finally:
                    await admin.close()

            assert asyncio.run(fill()) > 0
            assert bus.probe_store(server) is not None
            filler.unlink()  # space is free again; the running server does not notice
            pid = server.proc.pid if server.proc else None
            deadline = time.monotonic() + 60
            while server.restarts == 0:
                assert time.monotonic() < deadline, lines
                stack.supervise(probe_every_s=0.2, store_failures=2)
                time.sleep(0.05)
            assert server.proc is not None and server.proc.pid != pid
            assert any("cannot store" in line for line in lines), lines
            deadline = time.monotonic() + 30
            while (why := bus.probe_store(server)) is not None:
                assert time.monotonic() < deadline, why
                time.sleep(0.2)
            stack.write_status()
            status = (disk / "status.json").read_text()
            assert '"restarts": 1' in status
        finally:
            stack.stop()
