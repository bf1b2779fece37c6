"""``rudder up --ha``'s bus (cli.embedded.LocalBus with 3 nodes): when a port it picked is taken by
another process before its node binds it, the node exits at start and the cluster starts again on
fresh ports instead of failing (a flake of the HA test before); its routes run mutual TLS, so a
server that reaches a route port without a certificate of the bus CA does not join."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, cast

import pytest

from bus.tls import TlsFiles, make_server_tls
from cli.embedded import LocalBus, free_port, nats_server_binary, nats_server_config
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


def _routes(monitor_port: int) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/routez", timeout=2) as resp:
        routes: list[dict[str, object]] = json.load(resp).get("routes") or []
    return routes


def _dial(tmp_path: Path, name: str, tls: TlsFiles, route_to: int) -> tuple[subprocess.Popen[bytes], Path]:
    """Another nats-server whose cluster block dials ``route_to`` with ``tls`` (its route cert)."""
    route_port = free_port()
    conf = tmp_path / f"{name}.conf"
    conf.write_text(nats_server_config(
        port=free_port(), monitor_port=free_port(), store_dir=tmp_path / name, auth_include=None,
        server_name=name, route_tls=tls, cluster=("rudder", route_port, [route_port, route_to]),
    ))
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def test_routes_run_mutual_tls_a_server_without_the_bus_ca_cannot_join(tmp_path: Path) -> None:
    """A server with a certificate of its own CA is refused at node 1's route port; one with the
    bus CA's certificate (the control) joins, so the refusal is the CA's doing."""
    bus = LocalBus(tmp_path / "bus", authority=buskit.authority(), nodes=3)
    bus.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        first = bus.servers[0]
        assert first.cluster is not None and first.route_tls is not None
        assert {str(r.get("remote_name")) for r in _routes(first.monitor_port)} == {"n2", "n3"}
        intruder, log = _dial(tmp_path, "intruder", make_server_tls(tmp_path / "other-ca"), first.cluster[1])
        friend, _ = _dial(tmp_path, "friend", first.route_tls, first.cluster[1])
        procs += [intruder, friend]
        deadline = time.monotonic() + 20
        while "friend" not in {str(r.get("remote_name")) for r in _routes(first.monitor_port)}:
            assert friend.poll() is None and time.monotonic() < deadline, "the control never joined"
            time.sleep(0.05)
        while "handshake error" not in log.read_text(errors="replace"):  # the intruder's dial failed
            assert intruder.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert "intruder" not in {str(r.get("remote_name")) for r in _routes(first.monitor_port)}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        bus.stop()


def test_bus_init_on_a_cluster_still_electing_its_leader_does_not_wait_out_a_request_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A cluster forming leaves JetStream requests unanswered until it has a meta leader (well
    within a second here); bus init asks with a short timeout until one answers, then does the work
    with timeouts that grow from there, instead of spending its 5 s request timeout on a request
    the cluster leaves unanswered (the 3-node start took 6 s, now about 1). Shown by what bus init
    waited for each unanswered request, not by a wall-clock bound."""
    caplog.set_level(logging.INFO, logger="bus.streams")
    bus = LocalBus(tmp_path / "bus", authority=buskit.authority(), nodes=3)
    done = bus.start()  # launches the nodes, waits until each is up, then runs bus init at once
    try:
        assert any(line.startswith("created stream") for line in done), done
        unanswered = [r for r in caplog.records if r.name == "bus.streams" and "not" in r.msg and "yet" in r.msg]
        waits = [cast(tuple[Any, float], r.args)[1] for r in unanswered]
        assert all(w < 5.0 for w in waits), [r.getMessage() for r in unanswered]
    finally:
        bus.stop()
