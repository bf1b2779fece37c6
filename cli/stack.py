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
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cli.config import parse_credentials
from cli.embedded import (
    DatabaseAccess,
    DatabaseRole,
    EmbeddedNats,
    EmbeddedPostgres,
    die_with_parent,
    free_port,
    new_password,
    port_is_free,
    write_secret,
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

    def start(self, cwd: Path | None = None) -> None:
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

    def terminate(self) -> None:
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
    children: list[Child] = field(default_factory=list)

    # -- servers -----------------------------------------------------------------------------
    def start_nats(self, port: int) -> EmbeddedNats:
        nats = EmbeddedNats(self.data_dir / "nats", port=port, tie_to_parent=True)
        began = time.monotonic()
        try:
            nats.start()
        except RuntimeError as exc:
            raise CliError(ExitCode.ERROR, f"nats-server: {exc}") from exc
        self.nats = nats
        self.progress(f"nats-server   {nats.url}   ready in {time.monotonic() - began:.1f}s")
        return nats

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
    def start_child(self, child: Child, timeout: float) -> None:
        child.start()
        self.children.append(child)
        took = child.wait_healthy(timeout)
        self.progress(f"{child.name:<13} {child.url}   ready in {took:.1f}s (pid {child.pid})")

    def first_exited(self) -> Child | None:
        for child in self.children:
            if child.exited is not None:
                return child
        return None

    # -- stop --------------------------------------------------------------------------------
    def stop(self, timeout: float = 15.0) -> None:
        """Stop every child, in tiers (workers, routers, control plane), then NATS, PostgreSQL."""
        for kind in ("worker", "router", "controlplane"):
            tier = [c for c in self.children if c.kind == kind]
            for child in tier:
                child.terminate()
            for child in tier:
                child.reap(timeout)
        self.children.clear()
        if self.nats is not None:
            self.nats.stop()
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
