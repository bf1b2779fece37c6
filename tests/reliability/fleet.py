"""The fleet harness (issue 18, item 2): the production shape as real processes on loopback, driven
by clients that record everything, with fault injectors; used by tests/reliability/test_fleet.py
and bench/reliability.py.

The fleet: a 3-node NATS JetStream cluster (R3 streams, fsync always; ``cli.embedded.LocalBus``),
PostgreSQL (``EmbeddedPostgres``), two control planes, three routers and four workers (the real
``worker.agent`` with the mock engine), each started as ``rudder serve ...`` the way ``rudder up``
starts it (``cli.stack.Child``). One router reaches NATS only through a TCP proxy per node
(:mod:`tests.reliability.tcpproxy`; the nodes do not advertise each other's addresses, so it
cannot go around it): the partition injector.

The traffic (:class:`Traffic`): compare-and-set writers on the selection document (patches and
rollbacks) and on the busy-threshold document (partial writes: one threshold at a time), failing
over between the control planes; chat clients through the routers, failing over between routers
that do not answer. Every attempt and every chat is recorded; after the run the stream, the audit
log and the routers' ACKs are read back into a :class:`tests.reliability.history.History`.

The faults (:data:`FAULTS`): SIGKILL and restart of a control plane, a router, a worker, the stream
leader's NATS node and PostgreSQL; SIGSTOP/SIGCONT of a router and of PostgreSQL; the whole NATS
cluster restarted; the proxied router's link dropped or stalled; a burst of KV events on a
worker's subject faster than a router takes them (its rate limits drop the excess).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from bus.identities import Identity, IdentityKind
from bus.streams import BusLayout
from cli.embedded import EmbeddedPostgres, LocalBus, free_port
from cli.stack import Child
from cli.up import worker_allow_list
from controlplane.audit.records import AuditStage
from controlplane.audit.store import AuditStore
from controlplane.audit.tables import router_acks
from controlplane.protocol.events import KvEvent, KvStored, StoredBlock
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import STREAM_POLICY, kv_subject
from migrations import upgrade_async
from tests import buskit
from tests.conftest import TEST_APP, TEST_OWNER
from tests.integration.cp_support import AUDIT_KEY, make_tokens
from tests.policy_keys import session_keys
from tests.reliability.fleet_history import mono, to_mono
from tests.reliability.history import Answer, Apply, Attempt, Chat, Decision, History
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
        await asyncio.to_thread(self.bus.start, BusLayout(replicas=3, history_depth=self.history_depth))
        await asyncio.to_thread(self.postgres.start)
        access = await asyncio.to_thread(self.postgres.provision, "rudder", owner=TEST_OWNER, app=TEST_APP)
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
                env={**base, **bus_env, "RUDDER_ROUTER_ID": name,
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
        for kind in ("controlplane", "router", "worker"):  # each tier in parallel
            tier = [c for c in self.children.values() if c.kind == kind]
            for child in tier:
                child.start()
            for child in tier:
                await asyncio.to_thread(child.wait_healthy, within)
        await self.wait_workers(self.n_workers, within=within)

    def _add(self, child: Child) -> None:
        self.children[child.name] = child

    async def stop(self) -> None:
        for kind in ("worker", "router", "controlplane"):
            tier = [c for c in self.children.values() if c.kind == kind]
            for child in tier:
                if child.proc is not None and child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGCONT)  # a paused one must hear the TERM
                child.terminate()
            for child in tier:
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


# -- traffic ---------------------------------------------------------------------------------------


class Traffic:
    """Writers and chat clients, recording every attempt and every chat."""

    def __init__(self, fleet: Fleet, *, pace_s: float = 0.02) -> None:
        self.fleet = fleet
        self.pace_s = pace_s
        self.attempts: list[Attempt] = []
        self.chats: list[Chat] = []
        self.unexpected: list[str] = []  # write answers that are neither an outcome nor a clean refusal
        self.passed_over: list[tuple[str, str]] = []  # (router, why) a chat went on to the next router
        self.unknown_why: Counter[str] = Counter()  # why attempts had no definite answer
        self.known: dict[PolicyKind, list[int]] = {kind: [] for kind in KINDS}  # accepted revisions
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, *, writers: int = 2, chat_clients: int = 2) -> None:
        self._tasks += [asyncio.create_task(self._selection_writer(f"w{i}", i)) for i in range(writers)]
        self._tasks.append(asyncio.create_task(self._threshold_writer("t0")))
        self._tasks += [asyncio.create_task(self._chatter(i)) for i in range(chat_clients)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self._tasks)

    def _record(self, client: str, kind: PolicyKind, expected: int, t0: float,
                r: httpx.Response | Exception) -> int:
        """Record one attempt; returns the revision the next attempt should expect."""
        d = doc(kind)
        if isinstance(r, httpx.ConnectError):  # never reached a control plane: nothing happened
            self.attempts.append(Attempt(client, d, expected, Answer.REFUSED, t0, mono()))
            return expected
        if isinstance(r, Exception):  # sent, no answer: it may have taken effect
            self.unknown_why[type(r).__name__] += 1
            self.attempts.append(Attempt(client, d, expected, Answer.UNKNOWN, t0, None))
            return expected
        t1 = mono()
        try:
            body = r.json()
        except ValueError:
            body = {}
        error = body.get("error", {}) if isinstance(body, dict) else {}
        code = error.get("code")
        if r.status_code == 200 and body.get("changed") is False:
            # A threshold write that changed nothing published nothing (the head stays).
            self.attempts.append(Attempt(client, d, expected, Answer.REFUSED, t0, t1))
            return int(body["revision"])
        if r.status_code == 200:
            self.attempts.append(Attempt(client, d, expected, Answer.ACCEPTED, t0, t1,
                                         new_revision=body["revision"], event_id=body["event_id"]))
            self.known[kind].append(int(body["revision"]))
            return int(body["revision"])
        if r.status_code == 409:
            head = error.get("head_revision")
            self.attempts.append(Attempt(client, d, expected, Answer.CONFLICT, t0, t1, head_revision=head))
            return int(head) if head is not None else expected
        if code == "decision_unrecorded":
            self.attempts.append(Attempt(client, d, expected, Answer.ACCEPTED, t0, t1,
                                         new_revision=error["new_revision"], event_id=error["event_id"]))
            self.known[kind].append(int(error["new_revision"]))
            return int(error["new_revision"])
        if r.status_code in (429, 503) and code in _DEFINITE:
            self.attempts.append(Attempt(client, d, expected, Answer.REFUSED, t0, t1))
            return expected
        self.unknown_why[f"{r.status_code} {code}"] += 1
        if code != "log_ambiguous":  # no answer a client can act on: a finding of its own
            self.unexpected.append(f"{client} ({d} expecting @{expected}): {r.status_code} {r.text[:300]}")
        self.attempts.append(Attempt(client, d, expected, Answer.UNKNOWN, t0, None, event_id=error.get("event_id")))
        return expected

    async def _write_loop(self, name: str, plane: int, kind: PolicyKind,
                          request: Callable[[httpx.AsyncClient, str, int, int], Awaitable[httpx.Response]]) -> None:
        planes = self.fleet.urls("controlplane")
        headers = {"authorization": f"Bearer {self.fleet.tokens['operator']}"}
        expected, i = 0, 0
        async with httpx.AsyncClient(timeout=httpx.Timeout(10, connect=1), headers=headers) as http:
            while not self.stop.is_set():
                i += 1
                t0 = mono()
                try:
                    r: httpx.Response | Exception = await request(http, planes[plane % len(planes)], expected, i)
                except httpx.HTTPError as exc:
                    r = exc
                before = len(self.attempts)
                expected = self._record(name, kind, expected, t0, r)
                if self.attempts[before].answer in (Answer.REFUSED, Answer.UNKNOWN):
                    plane += 1  # that control plane is away or in trouble: use the other
                    await asyncio.sleep(0.05)
                await asyncio.sleep(self.pace_s)

    async def _selection_writer(self, name: str, plane: int) -> None:
        async def request(http: httpx.AsyncClient, url: str, expected: int, i: int) -> httpx.Response:
            known = self.known[PolicyKind.SELECTION]
            if i % 7 == 0 and len(known) >= 3:  # now and then a rollback to an earlier revision
                return await http.post(f"{url}/router_policy/rollback", json={
                    "model": MODEL, "kind": "selection", "to_revision": known[-3],
                    "expected_revision": expected})
            return await http.patch(f"{url}/router_policy", json={
                "model": MODEL, "kind": "selection", "expected_revision": expected,
                "parameters": {"router_temperature": round((hash(name) % 50 + i % 50) / 100, 2)}})
        await self._write_loop(name, plane, PolicyKind.SELECTION, request)

    async def _threshold_writer(self, name: str) -> None:
        async def request(http: httpx.AsyncClient, url: str, expected: int, i: int) -> httpx.Response:
            # Partial: one threshold per write, the other keeps its value.
            value: dict[str, float] = ({"active_decode_blocks_threshold": 0.5 + i % 100_000 / 1e6} if i % 2
                                       else {"active_prefill_tokens_threshold": 1000 + i})
            return await http.post(f"{url}/router_policy/busy_threshold", json={
                "model": MODEL, "expected_revision": expected, **value})
        await self._write_loop(name, 1, PolicyKind.BUSY_THRESHOLD, request)

    async def _chatter(self, n: int) -> None:
        routers = self.fleet.urls("router")
        names = self.fleet.names("router")
        i = n
        async with httpx.AsyncClient(timeout=httpx.Timeout(3, connect=1)) as http:
            while not self.stop.is_set():
                i += 1
                body = {"model": MODEL, "max_tokens": 4, "stream": i % 2 == 0,
                        "messages": [{"role": "user", "content": f"chat {n}-{i} " + "x" * (i % 300)}]}
                t0 = mono()
                tried: list[str] = []
                outcome: Chat | None = None
                for k in range(len(routers)):
                    # A router that does not answer, or answers 503, is passed over (as a load
                    # balancer retries the next upstream); the chat fails only if every one does.
                    j = (i + k) % len(routers)
                    tried.append(names[j])
                    outcome = await self._one_chat(http, routers[j], body, t0, tuple(tried))
                    if outcome is not None and not outcome.reason.startswith("503"):
                        break
                    self.passed_over.append((names[j], outcome.reason if outcome else "no answer"))
                if outcome is None:
                    outcome = Chat(t0, mono(), False, "no router answered", tried=tuple(tried))
                self.chats.append(outcome)
                await asyncio.sleep(self.pace_s)

    async def _one_chat(self, http: httpx.AsyncClient, url: str, body: dict[str, Any], t0: float,
                        tried: tuple[str, ...]) -> Chat | None:
        """The chat through one router; None when that router did not answer (try the next)."""
        started = False
        try:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        code = r.json().get("error", {}).get("code")
                    except ValueError:
                        code = raw[:80].decode(errors="replace")
                    return Chat(t0, mono(), False, f"{r.status_code} {code}", tried=tried)
                started = True
                async for _ in r.aiter_bytes():
                    pass
            return Chat(t0, mono(), True, tried=tried)
        except httpx.HTTPError as exc:
            if started:
                return Chat(t0, mono(), False, type(exc).__name__, streamed=True, tried=tried)
            return None


#: Refusals that say for certain nothing was published.
_DEFINITE = frozenset({"audit_unavailable", "log_unavailable", "service_unavailable", "rate_limited"})


# -- a run, and what it measured ----------------------------------------------------------------------


@dataclass
class RunResult:
    history: History
    faults: list[FaultRecord]
    reconcile: dict[str, Any]
    verify: dict[str, Any]
    started_at: float
    ended_at: float
    unexpected: list[str] = field(default_factory=list)
    passed_over: list[tuple[str, str]] = field(default_factory=list)
    unknown_why: dict[str, int] = field(default_factory=dict)


async def run(fleet: Fleet, schedule: list[tuple[str, float]], *, gap_s: float = 2.0, tail_s: float = 2.0,
              pace_s: float = 0.02, writers: int = 2, chat_clients: int = 2) -> RunResult:
    """Traffic on a started fleet; the faults of ``schedule`` ((name, duration) pairs) one after
    another, ``gap_s`` apart; traffic goes on ``tail_s`` after the last; then the read-back."""
    traffic = Traffic(fleet, pace_s=pace_s)
    started_at = mono()
    traffic.start(writers=writers, chat_clients=chat_clients)
    faults: list[FaultRecord] = []
    try:
        for name, duration in schedule:
            await asyncio.sleep(gap_s)
            faults.append(await FAULTS[name](fleet, duration))
        await asyncio.sleep(tail_s)
    finally:
        await traffic.finish()
    ended_at = mono()
    history = await read_back(fleet)
    history.attempts = traffic.attempts
    history.chats = traffic.chats
    history.last_fault_at = max((f.back for f in faults), default=started_at)
    # The routers reach the head; give them (and the ACK path into PostgreSQL) a bounded while.
    deadline = mono() + 15
    heads = {d: max(held) for d, held in history.stream.items() if held}
    while mono() < deadline and not _on_heads(history, heads):
        await asyncio.sleep(0.25)
        history.applies = (await read_back(fleet)).applies
    history.applies = _incarnations(history.applies, faults)
    history.live_routers = {_incarnation(name, faults, math.inf) for name in fleet.names("router")}
    await asyncio.sleep(1.5)  # past the reconciler's grace
    reconcile, verify = await _audit_checks(fleet)
    return RunResult(history, faults, reconcile, verify, started_at, ended_at,
                     unexpected=traffic.unexpected, passed_over=traffic.passed_over,
                     unknown_why=dict(traffic.unknown_why))


def _on_heads(history: History, heads: dict[str, int]) -> bool:
    newest: dict[tuple[str, str], int] = {}
    for ap in history.applies:
        newest[(ap.router, ap.document)] = max(newest.get((ap.router, ap.document), 0), ap.revision)
    routers = {ap.router for ap in history.applies}
    return bool(routers) and all(newest.get((r, d), 0) >= h for r in routers for d, h in heads.items())


def _incarnation(router: str, faults: list[FaultRecord], at: float) -> str:
    """``router#k``: its k-th run (a restarted router applies the head again: not a duplicate)."""
    k = sum(1 for f in faults if f.name == "kill" and f.target == router and f.began <= at)
    return f"{router}#{k}"


def _incarnations(applies: list[Apply], faults: list[FaultRecord]) -> list[Apply]:
    return [Apply(_incarnation(ap.router, faults, ap.at), ap.document, ap.revision, ap.at) for ap in applies]


async def read_back(fleet: Fleet) -> History:
    """The stream (both documents), the audit decisions and every router ACK."""
    h = History()
    nc = await buskit.connect_as(fleet.bus.url, Identity(IdentityKind.CONTROLPLANE))
    try:
        log = session_keys().policy_log(nc)
        for kind in KINDS:
            held = {s.revision: s.msg_id or "" async for s in log.history(MODEL, kind)}
            h.stream[doc(kind)] = held
            if held:  # (fewer than the history depth held: nothing was retired)
                h.retired_below[doc(kind)] = 0 if len(held) < fleet.history_depth else min(held)
    finally:
        await nc.close()
    store = AuditStore.from_url(fleet.database_url)
    try:
        cursor: str | None = None
        while True:
            rows, cursor = await store.query(model=MODEL, limit=1000, cursor=cursor)
            for row in rows:
                if row.stage == AuditStage.DECISION.value and not row.dry_run and row.event_id is not None:
                    h.audit.append(Decision(str(row.event_id), str(row.decision), row.reason_code, row.new_revision))
            if cursor is None:
                break
        async with store.engine.connect() as conn:
            c = router_acks.c
            result = await conn.execute(select(c.router_id, c.kind, c.revision, c.status, c.event_id, c.at)
                                        .where(c.model == MODEL))
            for router_id, kind, revision, status, event_id, at in result:
                if event_id is not None:
                    h.acked_events.add(str(event_id))
                if status == "ACK":
                    h.applies.append(Apply(router_id, f"{MODEL}/{kind}", int(revision), to_mono(at)))
    finally:
        await store.close()
    return h


async def _audit_checks(fleet: Fleet) -> tuple[dict[str, Any], dict[str, Any]]:
    """``rudder audit reconcile`` and ``rudder audit verify`` as the API answers them (a 503 is
    asked again, as an operator would, for up to 10 s; the last answer counts)."""
    headers = {"authorization": f"Bearer {fleet.tokens['admin']}"}
    answers: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=fleet.urls("controlplane")[0], headers=headers, timeout=60) as http:
        for method, path in (("POST", "/audit/reconcile"), ("GET", "/audit/verify")):
            deadline = mono() + 10
            while True:
                r = await http.request(method, path)
                if r.status_code != 503 or mono() > deadline:
                    break
                await asyncio.sleep(0.5)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            answers.append({"status": r.status_code, **body})
    return answers[0], answers[1]


# -- measures for the report ---------------------------------------------------------------------------


def writes_refused_s(attempts: list[Attempt], fault: FaultRecord) -> float:
    """From the first attempt after the fault began that was not answered (200 or 409) to the
    first answered after it (0 when none was refused)."""
    after = sorted((a for a in attempts if a.invoked >= fault.began), key=lambda a: a.invoked)
    first_bad = next((a for a in after if a.answer in (Answer.REFUSED, Answer.UNKNOWN)), None)
    if first_bad is None:
        return 0.0
    first_good = next((a for a in after if a.invoked > first_bad.invoked
                       and a.answer in (Answer.ACCEPTED, Answer.CONFLICT)), None)
    end = first_good.completed if first_good is not None and first_good.completed else after[-1].invoked
    return max(0.0, end - first_bad.invoked)


def convergence_s(history: History, fault: FaultRecord, routers: list[str]) -> float | None:
    """From the fault's end until every router applied the first write accepted after it (or a
    later revision of that document); None when no write was accepted after it."""
    first = min((a for a in history.attempts if a.answer is Answer.ACCEPTED and a.invoked >= fault.back
                 and a.new_revision is not None), key=lambda a: a.invoked, default=None)
    if first is None or first.new_revision is None:
        return None
    worst = 0.0
    for router in routers:
        times = [ap.at for ap in history.applies if ap.router.split("#")[0] == router
                 and ap.document == first.document and ap.revision >= first.new_revision]
        if not times:
            return math.inf
        worst = max(worst, min(times) - fault.back)
    return worst


def percentiles(values: list[float]) -> dict[str, float | None]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"p50": None, "p99": None, "max": None}
    p99 = vals[min(len(vals) - 1, math.ceil(0.99 * len(vals)) - 1)]
    return {"p50": round(statistics.median(vals), 3), "p99": round(p99, 3), "max": round(vals[-1], 3)}
