"""The fleet harness (issue 18, item 2): the production shape as real processes on loopback, driven
by clients that record everything (tests/reliability/fleet_traffic.py), with fault injectors; used
by tests/reliability/test_fleet.py and bench/reliability.py.

The fleet: a 3-node NATS JetStream cluster (R3 streams, fsync always; ``cli.embedded.LocalBus``),
PostgreSQL (``EmbeddedPostgres``), two control planes, three routers and four workers (the real
``worker.agent`` with the mock engine), each started as ``rudder serve ...`` the way ``rudder up``
starts it (``cli.stack.Child``). One router reaches NATS only through a TCP proxy per node
(:mod:`tests.reliability.tcpproxy`; the nodes do not advertise each other's addresses, so it
cannot go around it): the partition injector.

The faults (:data:`FAULTS`): SIGKILL and restart of a control plane, a router, a worker, the stream
leader's NATS node and PostgreSQL; SIGSTOP/SIGCONT of a router and of PostgreSQL; the whole NATS
cluster restarted; the proxied router's link dropped or stalled; a burst of KV events on a
worker's subject faster than a router takes them (its rate limits drop the excess).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bus.identities import Identity, IdentityKind
from bus.streams import BusLayout
from cli.embedded import DatabaseAccess, EmbeddedPostgres, LocalBus, free_port
from cli.stack import Child
from cli.up import worker_allow_list
from controlplane.protocol.events import KvEvent, KvStored, StoredBlock
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import STREAM_POLICY, kv_subject
from migrations import upgrade_async
from tests import buskit
from tests.conftest import TEST_APP, TEST_OWNER
from tests.integration.cp_support import AUDIT_KEY, make_tokens
from tests.policy_keys import session_keys
from tests.reliability.fleet_history import mono
from tests.reliability.tcpproxy import Mode, TcpProxy

MODEL = "fleet-model"
KINDS = (PolicyKind.SELECTION, PolicyKind.BUSY_THRESHOLD)


def doc(kind: PolicyKind) -> str:
    return f"{MODEL}/{kind.value}"


@dataclass
class FaultRecord:
    """One injected fault: ``began`` when it was injected, ``back`` when the harness had undone it
    (the process healthy again, the link passing again), monotonic seconds."""

    name: str
    target: str
    began: float
    back: float
    election_s: float | None = None  # JetStream leader election, where the fault forced one


class Fleet:
    """The processes of one fleet under ``root``; :meth:`start` and :meth:`stop` (always)."""

    def __init__(self, root: Path, *, planes: int = 2, routers: int = 3, workers: int = 4,
                 history_depth: int = 100_000) -> None:
        self.root = root
        self.history_depth = history_depth
        self.n_planes, self.n_routers, self.n_workers = planes, routers, workers
        self.bus = LocalBus(root, authority=buskit.authority(), nodes=3)
        for server in self.bus.servers:
            server.no_advertise = True  # the proxied router must not learn the nodes' own addresses
        self.postgres = EmbeddedPostgres(root / "pgdata")
        self.children: dict[str, Child] = {}
        self.proxies: list[TcpProxy] = []
        self.proxied = f"router-{routers}"  # the router behind the proxies
        self.database_url = ""
        self.tokens: dict[str, str] = {}
        self.instance_ids: dict[str, int] = {}

    # -- start and stop ----------------------------------------------------------------------
    async def start(self, within: float = 120.0) -> None:
        def database() -> DatabaseAccess:
            self.postgres.start()
            return self.postgres.provision("rudder", owner=TEST_OWNER, app=TEST_APP)

        # The bus and PostgreSQL start side by side (neither needs the other).
        _, access = await asyncio.gather(
            asyncio.to_thread(self.bus.start, BusLayout(replicas=3, history_depth=self.history_depth)),
            asyncio.to_thread(database))
        await upgrade_async(access.owner_url)
        self.database_url = access.app_url
        t = await make_tokens(access.app_url)
        self.tokens = {"operator": t.operator, "admin": t.admin}
        for server in self.bus.servers:
            proxy = TcpProxy(("127.0.0.1", server.port))
            await proxy.start()
            self.proxies.append(proxy)
        keys = session_keys()
        base = {k: v for k, v in os.environ.items() if not k.startswith("RUDDER_")}
        base.update({"PYTHONUNBUFFERED": "1", "RUDDER_POLICY_VERIFY_KEYS": str(keys.verify_path),
                     "RUDDER_STREAM_REPLICAS": "3", "RUDDER_HISTORY_DEPTH": str(self.history_depth)})
        logs = self.root / "logs"
        for i in range(self.n_planes):
            port = free_port()
            self._add(Child(
                name=f"controlplane-{i + 1}", kind="controlplane", url=f"http://127.0.0.1:{port}",
                health_url=f"http://127.0.0.1:{port}/readyz", args=["serve", "controlplane"],
                env={**base, **self.bus.env(Identity(IdentityKind.CONTROLPLANE)),
                     "RUDDER_DATABASE_URL": access.app_url, "RUDDER_ADMIN_HOST": "127.0.0.1",
                     "RUDDER_ADMIN_PORT": str(port), "RUDDER_POLICY_SIGNING_KEY": str(keys.seed_path),
                     "RUDDER_AUDIT_SIGNING_KEY": str(AUDIT_KEY), "RUDDER_RECONCILE_INTERVAL_S": "2",
                     "RUDDER_RECONCILE_GRACE_S": "1"},
                log_path=logs / f"controlplane-{i + 1}.log"))
        worker_ports = [free_port() for _ in range(self.n_workers)]
        proxied_url = ",".join(f"nats://{p.address}" for p in self.proxies)
        for i in range(self.n_routers):
            name, port = f"router-{i + 1}", free_port()
            bus_env = self.bus.env(Identity(IdentityKind.ROUTER, router_id=name))
            if name == self.proxied:
                bus_env["RUDDER_NATS_URL"] = proxied_url
            self._add(Child(
                name=name, kind="router", url=f"http://127.0.0.1:{port}", health_url=f"http://127.0.0.1:{port}/live",
                args=["serve", "router", "--model", MODEL, "--port", str(port)],
                # Debug headers on: the KV check (fleet_traffic.kv_truth) reads each answer's
                # predicted cached tokens and worker.
                env={**base, **bus_env, "RUDDER_ROUTER_ID": name, "RUDDER_DEBUG_HEADERS": "true",
                     "RUDDER_WORKER_URL_ALLOW": worker_allow_list(worker_ports)},
                log_path=logs / f"{name}.log"))
        for i, port in enumerate(worker_ports):
            name, instance_id = f"worker-{i + 1}", 1000 + i
            self.instance_ids[name] = instance_id
            self._add(Child(
                name=name, kind="worker", url=f"http://127.0.0.1:{port}", health_url=f"http://127.0.0.1:{port}/health",
                args=["serve", "worker", "--engine", "mock", "--model", MODEL, "--port", str(port)],
                env={**base, **self.bus.env(Identity(IdentityKind.WORKER, model=MODEL, instance_id=instance_id)),
                     "RUDDER_INSTANCE_ID": str(instance_id)},
                log_path=logs / f"{name}.log"))
        # Every process at once: none needs another to start (each waits for NATS and PostgreSQL,
        # which are up); wait_workers below waits until every router lists every worker.
        for child in self.children.values():
            child.start()
        for child in self.children.values():
            await asyncio.to_thread(child.wait_healthy, within)
        await self.wait_workers(self.n_workers, within=within)

    def _add(self, child: Child) -> None:
        self.children[child.name] = child

    async def stop(self) -> None:
        # Every process at once (what was measured is read back already): workers, routers and
        # control planes each stop on their own.
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGCONT)  # a paused one must hear the TERM
            child.terminate()
        for child in self.children.values():
            await asyncio.to_thread(child.reap, 10)
        for proxy in self.proxies:
            await proxy.close()
        await asyncio.to_thread(self.bus.stop)
        with contextlib.suppress(ProcessLookupError, OSError):
            self._signal_postgres(signal.SIGCONT)
        await asyncio.to_thread(self.postgres.stop, mode="immediate")

    # -- views -------------------------------------------------------------------------------
    def urls(self, kind: str) -> list[str]:
        return [c.url for c in self.children.values() if c.kind == kind]

    def names(self, kind: str) -> list[str]:
        return [c.name for c in self.children.values() if c.kind == kind]

    async def wait_workers(self, count: int, *, within: float) -> None:
        """Until every router lists ``count`` workers of the model."""
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=2) as http:
            for url in self.urls("router"):
                while True:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        body = (await http.get(f"{url}/v1/models")).json()
                        if max((int(m.get("workers", 0)) for m in body["data"] if m["id"] == MODEL),
                               default=0) >= count:
                            break
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{url} does not see {count} workers after {within}s")
                    await asyncio.sleep(0.1)

    async def admin(self) -> Any:
        """A bus admin connection to every node directly (never through the proxies)."""
        return await buskit.admin_connect(self.bus.url)

    async def stream_leader(self, nc: Any) -> str | None:
        info = await asyncio.wait_for(nc.jetstream().stream_info(STREAM_POLICY), 1.0)
        return info.cluster.leader if info.cluster else None

    # -- process faults ------------------------------------------------------------------------
    async def kill_restart(self, name: str, *, down_s: float = 0.5, within: float = 60.0) -> FaultRecord:
        """SIGKILL one child, start it again after ``down_s`` (a supervisor's backoff); back when
        healthy again."""
        child = self.children[name]
        began = mono()
        assert child.proc is not None
        child.proc.kill()
        await asyncio.to_thread(child.proc.wait, 10)
        await asyncio.sleep(down_s)
        child.restarts += 1
        child.start()
        await asyncio.to_thread(child.wait_healthy, within)
        return FaultRecord("kill", name, began, mono())

    async def pause(self, name: str, *, down_s: float) -> FaultRecord:
        child = self.children[name]
        assert child.proc is not None
        began = mono()
        child.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(down_s)
        child.proc.send_signal(signal.SIGCONT)
        return FaultRecord("pause", name, began, mono())

    # -- NATS ------------------------------------------------------------------------------------
    async def kill_leader_node(self, *, down_s: float = 1.0) -> FaultRecord:
        """SIGKILL the policy stream's leader node; the election is timed from the kill until a
        surviving node answers ``stream_info`` with a new leader. The node is started again after
        ``down_s`` (same store); back when it is healthy."""
        nc = await self.admin()
        try:
            leader = await self.stream_leader(nc)
            assert leader is not None
            node = next(s for s in self.bus.servers if s.server_name == leader)
            survivor = next(s for s in self.bus.servers if s.server_name != leader)
        finally:
            await nc.close()
        watch = await buskit.admin_connect(survivor.url)
        try:
            began = mono()
            assert node.proc is not None
            node.proc.kill()
            await asyncio.to_thread(node.proc.wait, 10)
            election = await self._until_leader(watch, not_=leader, began=began)
        finally:
            await watch.close()
        await asyncio.sleep(max(0.0, down_s - (mono() - began)))
        node.restarts += 1
        await asyncio.to_thread(node.launch)
        await asyncio.to_thread(node.wait_healthy, 30)
        return FaultRecord("nats_node_kill", leader, began, mono(), election_s=election)

    async def _until_leader(self, nc: Any, *, not_: str | None, began: float, within: float = 60.0) -> float:
        while mono() - began < within:
            with contextlib.suppress(Exception):
                leader = await self.stream_leader(nc)
                if leader is not None and leader != not_:
                    return mono() - began
            await asyncio.sleep(0.02)
        raise AssertionError(f"no stream leader within {within}s")

    async def restart_cluster(self, *, down_s: float = 0.5) -> FaultRecord:
        """Every node SIGKILLed, then all started again (same stores); the election is timed from
        the start of the nodes until the stream answers with a leader."""
        began = mono()
        for server in self.bus.servers:
            server.stop(kill=True)
        await asyncio.sleep(down_s)
        for server in self.bus.servers:
            server.restarts += 1
            server.launch()
        relaunched = mono()
        for server in self.bus.servers:
            await asyncio.to_thread(server.wait_healthy, 30)
        nc = await self.admin()
        try:
            election = await self._until_leader(nc, not_=None, began=relaunched)
        finally:
            await nc.close()
        return FaultRecord("nats_cluster_restart", "nats", began, mono(), election_s=election)

    # -- PostgreSQL --------------------------------------------------------------------------------
    def _postgres_pids(self) -> list[int]:
        postmaster = self.postgres.pid
        if postmaster is None:
            return []
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                        children.append(int(entry.name))
        return [postmaster, *children]

    def _signal_postgres(self, sig: signal.Signals) -> None:
        for pid in self._postgres_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    async def kill_postgres(self, *, down_s: float = 0.5) -> FaultRecord:
        began = mono()
        pids = self._postgres_pids()
        self._signal_postgres(signal.SIGKILL)
        await asyncio.sleep(down_s)
        # Until the killed processes are gone (not even zombies): a new postmaster refuses to start
        # while the pid in postmaster.pid still exists.
        while any(_exists(pid) for pid in pids):
            assert mono() - began < 30, f"postgres processes {pids} outlived SIGKILL"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.postgres.start)
        return FaultRecord("postgres_kill", "postgres", began, mono())

    async def pause_postgres(self, *, down_s: float) -> FaultRecord:
        began = mono()
        self._signal_postgres(signal.SIGSTOP)
        await asyncio.sleep(down_s)
        self._signal_postgres(signal.SIGCONT)
        return FaultRecord("postgres_stop", "postgres", began, mono())

    # -- the network, and a flood ---------------------------------------------------------------------
    async def partition(self, mode: Mode, *, down_s: float) -> FaultRecord:
        began = mono()
        for proxy in self.proxies:
            proxy.set(mode)
        await asyncio.sleep(down_s)
        for proxy in self.proxies:
            proxy.set(Mode.PASS)
        return FaultRecord(f"partition_{mode.value}", self.proxied, began, mono())

    async def kv_burst(self, *, down_s: float, worker: str = "worker-1") -> FaultRecord:
        """KV events as fast as this process can publish them, on one worker's subject with its
        credentials (what a runaway engine, or a stolen worker credential, does)."""
        instance_id = self.instance_ids[worker]
        nc = await buskit.connect_as(self.bus.url, Identity(IdentityKind.WORKER, model=MODEL,
                                                            instance_id=instance_id))
        template = KvEvent(instance_id=instance_id, event_id=0, data=KvStored(blocks=[
            StoredBlock(block_hash=i + 1, tokens_hash=i) for i in range(200)])).to_bytes()
        subject = kv_subject(MODEL, instance_id)
        began = mono()
        sent = 0
        try:
            while mono() - began < down_s:
                for _ in range(50):
                    sent += 1
                    data = template.replace(b'"event_id":0,', f'"event_id":{10**9 + sent},'.encode(), 1)
                    await nc.publish(subject, data)
                await nc.flush()
        finally:
            await nc.close()
        return FaultRecord("kv_burst", f"{worker} ({sent} events)", began, mono())

    async def dropped_kv(self) -> int:
        """KV events the routers dropped at the edge for the rate limit (their metrics, summed)."""
        total = 0.0
        async with httpx.AsyncClient(timeout=5) as http:
            for url in self.urls("router"):
                with contextlib.suppress(httpx.HTTPError):
                    for line in (await http.get(f"{url}/metrics")).text.splitlines():
                        if (line.startswith("rudder_router_bus_dropped_total") and 'kind="kv"' in line
                                and 'reason="rate_limited"' in line):
                            total += float(line.rsplit(" ", 1)[1])
        return int(total)


def _exists(pid: int) -> bool:
    """Whether ``pid`` is still taken (a zombie, not yet reaped, holds it too)."""
    return Path(f"/proc/{pid}").exists()


#: Fault injectors by name: each takes the fleet and how long the fault lasts.
Fault = Callable[[Fleet, float], Awaitable[FaultRecord]]
FAULTS: dict[str, Fault] = {
    "controlplane_kill": lambda f, s: f.kill_restart("controlplane-1", down_s=s),
    "router_kill": lambda f, s: f.kill_restart("router-1", down_s=s),
    "worker_kill": lambda f, s: f.kill_restart("worker-2", down_s=s),
    "nats_node_kill": lambda f, s: f.kill_leader_node(down_s=s),
    "nats_cluster_restart": lambda f, s: f.restart_cluster(down_s=s),
    "postgres_kill": lambda f, s: f.kill_postgres(down_s=s),
    "postgres_stop": lambda f, s: f.pause_postgres(down_s=s),
    "router_stop": lambda f, s: f.pause("router-2", down_s=s),
    "partition_drop": lambda f, s: f.partition(Mode.DROP, down_s=s),
    "partition_stall": lambda f, s: f.partition(Mode.STALL, down_s=s),
    "kv_burst": lambda f, s: f.kv_burst(down_s=s),
}
