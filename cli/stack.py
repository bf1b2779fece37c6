"""The embedded stack behind ``rudder up``: servers and fleet processes as children of one parent.

Start order: NATS, PostgreSQL, migrations, control plane, routers, workers. Stop order is the
reverse of the processes' dependencies: workers and routers first (they announce ``leave`` and
stop publishing), then the control plane, then NATS and PostgreSQL, so nothing loses its servers
while it still runs. Python children are started as ``python -m cli.main serve ...`` with their
settings in ``RUDDER_*`` variables, each in its own session (a Ctrl-C reaches ``rudder up`` only,
which then stops them in order) and tied to the parent on Linux (``PR_SET_PDEATHSIG``) so a killed
``rudder up`` leaves no orphans behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bus.authority import write_secret
from bus.identities import Identity
from cli.config import parse_credentials
from cli.embedded import (
    DatabaseAccess,
    DatabaseRole,
    EmbeddedNats,
    EmbeddedPostgres,
    LocalBus,
    die_with_parent,
    free_port,
    new_password,
    port_is_free,
)
from cli.errors import CliError, ExitCode

Progress = Callable[[str], None]


def pick_port(requested: int | None, preferred: int, what: str) -> int:
    """An explicit port must be free (else a usage error); the default is taken if free,
    otherwise any free port."""
    if requested is not None:
        if requested and not port_is_free(requested):
            raise CliError(ExitCode.USAGE, f"{what} port {requested} is already in use")
        return requested or free_port()
    return preferred if port_is_free(preferred) else free_port()


@dataclass
class Child:
    """One Python process of the fleet started by ``rudder up``."""

    name: str
    kind: str  # controlplane | router | worker
    url: str
    health_url: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    state: str = "starting"  # starting | running | exited | restarting | stopped
    last_exit: int | None = None
    restart_at: float | None = None  # monotonic time of the next restart (backoff)
    started_at: float = 0.0
    healthy_at: float | None = None  # monotonic time it last became healthy (this run)
    streak: int = 0  # restarts in a row without a healthy run of ``healthy_reset_s`` between

    def start(self, cwd: Path | None = None) -> None:
        self.started_at = time.monotonic()
        self.healthy_at = None
        self.state = "starting"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", *self.args],
                env=self.env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
            )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout: float) -> float:
        """Poll the health URL until 200; raises ``CliError`` if the child dies or times out."""
        started = time.monotonic()
        deadline = started + timeout
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < deadline:
                code = self.exited
                if code is not None:
                    raise CliError(ExitCode.ERROR,
                                   f"{self.name} exited with {code} while starting; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(self.health_url).status_code == 200:
                        return time.monotonic() - started
                time.sleep(0.1)
        raise CliError(ExitCode.UNAVAILABLE,
                       f"{self.name} was not healthy at {self.health_url} after {timeout:g}s; "
                       f"log {self.log_path}:\n{self.log_tail()}")

    def healthy_now(self) -> bool:
        """One health probe (no waiting): used while supervising."""
        try:
            return httpx.get(self.health_url, timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    def status(self) -> dict[str, object]:
        return {"name": self.name, "kind": self.kind, "url": self.url, "pid": self.pid,
                "state": self.state, "restarts": self.restarts, "last_exit": self.last_exit,
                "log": str(self.log_path)}

    def terminate(self) -> None:
        self.state = "stopped"
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def reap(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(5)


@dataclass
class Stack:
    """Everything one ``rudder up`` started, in start order, and how to stop it."""

    data_dir: Path
    progress: Progress
    nats: EmbeddedNats | None = None
    postgres: EmbeddedPostgres | None = None
    bus: LocalBus | None = None
    children: list[Child] = field(default_factory=list)
    ready: bool = False
    extra_status: list[Callable[[], dict[str, object]]] = field(default_factory=list)
    # Supervision of the servers: NATS store probes (failures in a row per node), PostgreSQL.
    _probe_at: float = 0.0
    _store_failures: dict[str, int] = field(default_factory=dict)
    _pg_check_at: float = 0.0
    _pg_restart_at: float | None = None
    _pg_streak: int = 0

    # -- servers -----------------------------------------------------------------------------
    def start_nats(self, port: int, *, tls: bool = False, nodes: int = 1) -> EmbeddedNats:
        """Start nats-server (``nodes=3``: a JetStream cluster, R3 streams, fsync always) with the
        bus authority's decentralised auth (anonymous connections refused), optionally TLS, then
        create the streams as the bus admin (``rudder bus init``)."""
        from bus.settings import BusAdminSettings
        from controlplane.protocol.errors import RudderError

        bus = LocalBus(self.data_dir, tls=tls, port=port, tie_to_parent=True, nodes=nodes)
        # The same RUDDER_* settings the children read (history depth, TTLs), replicas by shape.
        admin = BusAdminSettings(stream_replicas=3 if nodes >= 3 else 1)
        began = time.monotonic()
        try:
            changed = bus.start(admin.bus_layout(worker_ttl_s=admin.worker_ttl_s,
                                                 router_heartbeat_s=admin.router_heartbeat_s))
        except RuntimeError as exc:
            raise CliError(ExitCode.ERROR, f"nats-server: {exc}") from exc
        except RudderError as exc:
            raise CliError(ExitCode.ERROR, f"bus init: {exc.message}") from exc
        finally:
            self.nats = bus.server
        self.bus = bus
        secured = "auth on, TLS on" if bus.tls else "auth on, TLS off (--tls to turn it on)"
        self.progress(f"nats-server   {bus.url}   ready in {time.monotonic() - began:.1f}s ({secured}; "
                      f"bus init: {len(changed)} change(s))")
        return bus.server

    def bus_env(self, identity: Identity) -> dict[str, str]:
        """The bus settings of one child: its own credentials (a file path, never the secret)."""
        assert self.bus is not None
        return self.bus.env(identity)

    def start_postgres(self, port: int, database: str) -> DatabaseAccess:
        """PostgreSQL with scram authentication and two roles: ``rudder_owner`` owns the schema
        (migrations only), ``rudder_app`` is the control plane's. Their passwords are made once
        and kept in ``<data-dir>/db-roles`` (0600), never in ``credentials``."""
        pg = EmbeddedPostgres(self.data_dir / "pgdata", port=port)
        began = time.monotonic()
        try:
            if pg.stop_leftover():
                self.progress("postgres      stopped a server left running by an earlier run")
            pg.start()
            self.postgres = pg
            owner, app = self._database_roles()
            access = pg.provision(database, owner=owner, app=app)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            text = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
            raise CliError(ExitCode.ERROR,
                           f"postgres failed to start: {exc} {text.strip()} "
                           f"(log {pg.data_dir / 'server.log'})") from exc
        self.progress(f"postgres      127.0.0.1:{port}/{database}   ready in "
                      f"{time.monotonic() - began:.1f}s")
        return access

    def _database_roles(self) -> tuple[DatabaseRole, DatabaseRole]:
        path = self.data_dir / "db-roles"
        try:
            known = parse_credentials(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            known = {}
        owner = known.get("OWNER_PASSWORD") or new_password()
        app = known.get("APP_PASSWORD") or new_password()
        if known.get("OWNER_PASSWORD") != owner or known.get("APP_PASSWORD") != app:
            write_secret(path, "# rudder up: database role passwords (the owner's is for "
                         f"migrations only)\nOWNER_PASSWORD={owner}\nAPP_PASSWORD={app}\n")
        return DatabaseRole("rudder_owner", owner), DatabaseRole("rudder_app", app)

    # -- fleet processes ---------------------------------------------------------------------
    def start_children(self, children: list[Child], timeout: float) -> None:
        """Start every one of ``children`` (one tier: processes that do not wait for each other),
        then wait until each is healthy: the tier takes as long as its slowest start, not the
        sum of them. Raises ``CliError`` as :meth:`Child.wait_healthy` does (the ones started are
        in :attr:`children`, so stopping the stack stops them)."""
        began = time.monotonic()
        for child in children:
            child.start()
            self.children.append(child)
        for child in children:
            child.wait_healthy(timeout)
            child.state = "running"
            child.healthy_at = time.monotonic()
            self.write_status()
            # "ready in": since its tier started, which is its own start to a tenth of a second.
            self.progress(f"{child.name:<13} {child.url}   ready in {child.healthy_at - began:.1f}s (pid {child.pid})")

    def supervise(self, *, backoff_s: float = 0.5, max_backoff_s: float = 10.0,
                  healthy_reset_s: float = 5.0, probe_every_s: float = 5.0,
                  store_failures: int = 3, pg_check_s: float = 1.0) -> None:
        """One supervision pass, printed, never fatal. Call it every fraction of a second while
        ``rudder up`` runs.

        - A child that exited is restarted after a backoff that doubles with each restart in a
          row; the streak resets once a run was healthy for ``healthy_reset_s``.
        - A NATS node that exited is restarted (same store); one that runs but cannot store (a
          probe write every ``probe_every_s`` fails ``store_failures`` times in a row: a full
          disk leaves nats-server failing writes until it restarts) is restarted too.
        - PostgreSQL: a postmaster that is gone (``kill -9``) is started again (checked every
          ``pg_check_s``, with the same backoff)."""
        now = time.monotonic()
        changed = self._supervise_nats(now, probe_every_s=probe_every_s, store_failures=store_failures)
        changed = self._supervise_postgres(now, pg_check_s=pg_check_s, backoff_s=backoff_s,
                                           max_backoff_s=max_backoff_s) or changed
        for child in self.children:
            code = child.exited
            if child.state == "restarting" and child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                child.start()
                self.progress(f"{child.name:<13} restarted (pid {child.pid}, restart {child.restarts})")
                changed = True
            elif code is not None and child.state in ("starting", "running"):
                child.last_exit = code
                up_for = now - child.started_at
                if child.healthy_at is not None and now - child.healthy_at >= healthy_reset_s:
                    child.streak = 0
                delay = min(max_backoff_s, backoff_s * (2 ** min(child.streak, 8)))
                child.streak += 1
                child.state = "restarting"
                child.restart_at = now + delay
                self.progress(f"{child.name:<13} exited with {code} after {up_for:.1f}s; "
                              f"restarting in {delay:.1f}s. log {child.log_path}")
                changed = True
            elif child.state == "starting" and code is None and child.healthy_now():
                child.state = "running"
                child.healthy_at = now
                changed = True
        if changed:
            self.write_status()

    def _supervise_nats(self, now: float, *, probe_every_s: float, store_failures: int) -> bool:
        if self.bus is None:
            return False
        changed = False
        for server in self.bus.restart_dead():
            self.progress(f"nats {server.server_name or ''}   {server.url} exited; restarted (same store)")
            changed = True
        if now < self._probe_at:
            return changed
        self._probe_at = now + probe_every_s
        for server in self.bus.servers:
            if not server.running:
                continue
            why = self.bus.probe_store(server)
            key = server.url
            if why is None:
                self._store_failures.pop(key, None)
                continue
            failures = self._store_failures[key] = self._store_failures.get(key, 0) + 1
            self.progress(f"nats {server.server_name or ''}   {server.url} cannot store ({why}); "
                          f"{failures} of {store_failures}")
            if failures >= store_failures:
                self._store_failures.pop(key, None)
                self.bus.restart(server)
                self.progress(f"nats {server.server_name or ''}   {server.url} restarted: it could not "
                              "store (free disk space if it still cannot)")
                changed = True
        return changed

    def _supervise_postgres(self, now: float, *, pg_check_s: float, backoff_s: float,
                            max_backoff_s: float) -> bool:
        pg = self.postgres
        if pg is None:
            return False
        if self._pg_restart_at is not None:
            if now < self._pg_restart_at:
                return False
            self._pg_restart_at = None
            try:
                pg.start()
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
                delay = min(max_backoff_s, backoff_s * (2 ** min(self._pg_streak, 8)))
                self._pg_streak += 1
                self._pg_restart_at = time.monotonic() + delay
                self.progress(f"postgres      restart failed ({exc}); again in {delay:.1f}s. "
                              f"log {pg.data_dir / 'server.log'}")
                return False
            pg.restarts += 1
            self._pg_streak = 0
            self.progress(f"postgres      restarted (pid {pg.pid}, restart {pg.restarts})")
            return True
        if now < self._pg_check_at:
            return False
        self._pg_check_at = now + pg_check_s
        if pg.running:
            return False
        self._pg_restart_at = now
        self.progress(f"postgres      127.0.0.1:{pg.port} is not running; restarting")
        return True

    def write_status(self) -> None:
        """``<data-dir>/status.json``: what ``rudder status`` shows (atomically replaced)."""
        rows: list[dict[str, object]] = []
        for server in self.bus.servers if self.bus is not None else []:
            rows.append({"name": f"nats-{server.server_name}" if server.server_name else "nats",
                         "kind": "nats", "url": server.url,
                         "pid": server.proc.pid if server.proc else None,
                         "state": "running" if server.running else "exited",
                         "restarts": server.restarts, "last_exit": server.last_exit,
                         "log": str(server.data_dir / "nats.log")})
        if self.postgres is not None:
            pg = self.postgres
            rows.append({"name": "postgres", "kind": "postgres", "url": f"127.0.0.1:{pg.port}",
                         "pid": pg.pid, "state": "restarting" if self._pg_restart_at is not None else "running",
                         "restarts": pg.restarts, "last_exit": None,
                         "log": str(pg.data_dir / "server.log")})
        for extra in self.extra_status:
            rows.append(extra())
        rows += [c.status() for c in self.children]
        body = {"pid": os.getpid(), "data_dir": str(self.data_dir), "ready": self.ready,
                "processes": rows}
        tmp = self.data_dir / "status.json.tmp"
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, self.data_dir / "status.json")

    # -- stop --------------------------------------------------------------------------------
    def stop(self, timeout: float = 15.0) -> None:
        """Stop every child, in tiers (workers, routers, control plane), then NATS, PostgreSQL."""
        for kind in ("worker", "router", "controlplane"):
            tier = [c for c in self.children if c.kind == kind]
            for child in tier:
                child.terminate()
            for child in tier:
                child.reap(timeout)
        self.ready = False
        with contextlib.suppress(OSError):
            (self.data_dir / "status.json").unlink()
        self.children.clear()
        if self.bus is not None:
            self.bus.stop()
            self.bus = None
            self.nats = None
        if self.postgres is not None:
            self.postgres.stop(mode="fast")
            self.postgres = None


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class UpLock:
    """``<data-dir>/up.pid``: one ``rudder up`` per data folder at a time."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "up.pid"

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError, ValueError):
            other = int(self.path.read_text().strip())
            if other != os.getpid() and pid_alive(other):
                raise CliError(ExitCode.ERROR,
                               f"rudder up is already running on {self.path.parent} "
                               f"(pid {other}); stop it first")
        self.path.write_text(f"{os.getpid()}\n")

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            if int(self.path.read_text().strip()) == os.getpid():
                self.path.unlink()
