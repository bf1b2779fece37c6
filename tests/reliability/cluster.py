"""A real 3-node NATS JetStream cluster on loopback (one config file per node, fsync always),
trusting the test session's bus authority (anonymous connections refused)."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from pathlib import Path

from cli.embedded import free_port, nats_server_binary, nats_server_config
from tests import buskit


class NatsCluster:
    def __init__(self, root: Path, size: int = 3) -> None:
        self.root = root
        self.names = [f"n{i + 1}" for i in range(size)]
        self.client_ports = {n: free_port() for n in self.names}
        self.http_ports = {n: free_port() for n in self.names}
        self.route_ports = {n: free_port() for n in self.names}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.client_ports.values())

    def _config(self, name: str) -> Path:
        path = self.root / f"{name}.conf"
        path.write_text(nats_server_config(
            server_name=name, port=self.client_ports[name], monitor_port=self.http_ports[name],
            store_dir=self.root / name, sync_always=True,
            cluster=("c1", self.route_ports[name], list(self.route_ports.values())),
            auth_include=buskit.authority().server_config,
        ))
        return path

    def start_node(self, name: str) -> None:
        log = open(self.root / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([nats_server_binary(), "-c", str(self._config(name))],
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def wait_healthy(self, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_ports[name]}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.05)
        raise RuntimeError(f"{name} not healthy")

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            self.start_node(name)
        for name in self.names:
            self.wait_healthy(name)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
