"""Run ``compose.yaml`` without a container engine: every service as a local process, with the
command and environment written in the file (DESIGN: there is no Docker on these machines).

- Host names: each ``(service, port)`` a service listens on or is reached at is mapped to
  ``127.0.0.1:<free port>``; URLs, ``--host/--port`` options, ``RUDDER_ADMIN_HOST/PORT``,
  ``RUDDER_ADVERTISE_HOST``, host lists and ``--tls-host`` are rewritten accordingly.
- Files: each service gets a root folder in which its volumes, bind mounts and secrets
  (``/run/secrets/<name>``) appear at their container paths (symlinks); absolute container paths
  in its command, environment and NATS config are rewritten into that root.
- Images: ``rudder:local`` runs ``python -m cli.main`` (the image's entrypoint ``rudder``);
  ``nats:*`` runs the nats-server binary with the service's config file; ``postgres:*`` is an
  embedded PostgreSQL given the image's ``POSTGRES_USER/PASSWORD/DB``.
- Order and conditions: ``depends_on`` with ``service_started``, ``service_healthy`` (NATS:
  its monitor's JetStream health; PostgreSQL: accepting connections) and
  ``service_completed_successfully`` (exit 0). Profiles other than the default are not started.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cli.config import parse_credentials
from cli.embedded import EmbeddedPostgres, free_port, nats_server_binary

ROOT = Path(__file__).resolve().parents[1]
_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:[-?])(?P<arg>[^}]*))?\}")
_URL = re.compile(r"(?P<pre>//(?:[^@/\s,]*@)?)(?P<host>[A-Za-z0-9_-]+):(?P<port>\d+)")



def load_compose(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    postgres: EmbeddedPostgres | None = None
    log: Path | None = None

    @property
    def image(self) -> str:
        return str(self.spec.get("image", ""))


@dataclass
class ComposeFleet:
    project: Path            # the folder holding compose.yaml (relative sources resolve there)
    work: Path               # where services' roots, volumes and logs go
    compose: dict[str, Any] = field(init=False)
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    services: dict[str, Service] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.compose = load_compose(self.project / "compose.yaml")
        self.names = set(self.compose["services"])
        dotenv = self.project / ".env"
        self.dotenv = parse_credentials(dotenv.read_text()) if dotenv.exists() else {}
        (self.work / "logs").mkdir(parents=True, exist_ok=True)

    # -- mapping ---------------------------------------------------------------------------
    def port(self, service: str, port: int) -> int:
        key = (service, port)
        if key not in self.ports:
            self.ports[key] = free_port()
        return self.ports[key]

    def url_of(self, service: str, port: int, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port(service, port)}"

    def _hosts(self, text: str) -> str:
        def sub(m: re.Match[str]) -> str:
            if m["host"] not in self.names:
                return m.group(0)
            return f"{m['pre']}127.0.0.1:{self.port(m['host'], int(m['port']))}"
        return _URL.sub(sub, text)

    def _mounts(self, svc: Service) -> list[tuple[str, Path]]:
        """(container path, host path) of every volume, bind mount and secret of ``svc``."""
        out: list[tuple[str, Path]] = []
        for entry in svc.spec.get("volumes", []):
            source, target = str(entry).split(":")[:2]
            if source.startswith((".", "/")):
                host = (self.project / source).resolve() if source.startswith(".") else Path(source)
                if not host.exists():  # as docker does: a missing bind-mount source becomes a folder
                    host.mkdir(parents=True)
            else:
                host = self.work / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            out.append((target, host))
        for name in svc.spec.get("secrets", []):
            out.append((f"/run/secrets/{name}", (self.project / self.compose["secrets"][name]["file"]).resolve()))
        return out

    def _materialise(self, svc: Service) -> None:
        for target, host in self._mounts(svc):
            link = svc.root / target.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                continue
            link.symlink_to(host)

    def _paths(self, svc: Service, text: str) -> str:
        for target, _ in sorted(self._mounts(svc), key=lambda m: -len(m[0])):
            text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?=$|[/\s\"',:])", str(svc.root) + target, text)
        return text

    def _rewrite(self, svc: Service, text: str) -> str:
        return self._paths(svc, self._hosts(text))

    def command(self, svc: Service) -> list[str]:
        cmd = [str(c) for c in svc.spec.get("command", [])]
        out: list[str] = []
        i = 0
        while i < len(cmd):
            arg = cmd[i]
            if arg in ("--host",) and i + 1 < len(cmd):
                out += [arg, "127.0.0.1"]
                i += 2
                continue
            if arg == "--port" and i + 1 < len(cmd):
                out += [arg, str(self.port(svc.name, int(cmd[i + 1])))]
                i += 2
                continue
            if arg == "--tls-host" and i + 1 < len(cmd):
                out += [arg, "127.0.0.1" if cmd[i + 1] in self.names else cmd[i + 1]]
                i += 2
                continue
            if " " in arg:  # a shell command string (entrypoint sh -c)
                arg = re.sub(r"--tls-host\s+([A-Za-z0-9_-]+)",
                             lambda m: "--tls-host " + ("127.0.0.1" if m[1] in self.names else m[1]), arg)
            out.append(self._rewrite(svc, arg))
            i += 1
        return out

    def interpolate(self, text: str) -> str:
        """``${NAME}``, ``${NAME:-default}`` and ``${NAME:?message}`` from the environment, then
        the project's ``.env``, as compose does (a missing ``:?`` variable is an error)."""
        def sub(m: re.Match[str]) -> str:
            name, op, arg = m["name"], m["op"], m["arg"] or ""
            value = os.environ.get(name) or self.dotenv.get(name)
            if value:
                return value
            if op == ":?":
                raise AssertionError(f"compose: required variable {name} is not set: {arg}")
            return arg if op == ":-" else ""
        return _VAR.sub(sub, text)

    def environment(self, svc: Service) -> dict[str, str]:
        env: dict[str, str] = {}
        for key, value in (svc.spec.get("environment") or {}).items():
            text = self.interpolate(str(value))
            if key.endswith("_HOST") and (text in self.names or text == "0.0.0.0"):
                text = "127.0.0.1"
            elif key == "RUDDER_ADMIN_PORT":
                text = str(self.port(svc.name, int(text)))
            elif "," in text and all(p.strip() in self.names for p in text.split(",")):
                text = ",".join("127.0.0.1" for _ in text.split(","))
            env[key] = self._rewrite(svc, text)
        return env

    # -- running ---------------------------------------------------------------------------
    def order(self) -> list[str]:
        """Default-profile services in dependency order."""
        active = {n for n, s in self.compose["services"].items() if not s.get("profiles")}
        done: list[str] = []

        def visit(name: str, stack: tuple[str, ...] = ()) -> None:
            assert name not in stack, f"dependency cycle through {name}"
            if name in done:
                return
            for dep in (self.compose["services"][name].get("depends_on") or {}):
                visit(dep, (*stack, name))
            done.append(name)

        for name in sorted(active):
            visit(name)
        return done

    def start_all(self, *, timeout: float = 120.0) -> None:
        for name in self.order():
            spec = self.compose["services"][name]
            for dep, cond in (spec.get("depends_on") or {}).items():
                self.wait(dep, cond.get("condition", "service_started"), timeout=timeout)
            self.start(name)

    def start(self, name: str) -> Service:
        spec = self.compose["services"][name]
        svc = self.services.get(name) or Service(name, spec, self.work / "roots" / name)
        self.services[name] = svc
        svc.root.mkdir(parents=True, exist_ok=True)
        self._materialise(svc)
        svc.log = self.work / "logs" / f"{name}.log"
        image = svc.image
        env = {**os.environ, **self.environment(svc), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        if image.startswith("postgres"):
            svc.postgres = EmbeddedPostgres(self.work / "pg" / name, port=self.port(name, 5432))
            svc.postgres.start()
            e = self.environment(svc)
            user, password, db = e["POSTGRES_USER"], e["POSTGRES_PASSWORD"], e.get("POSTGRES_DB", e["POSTGRES_USER"])
            if user != svc.postgres.superuser:  # the image's superuser is the embedded one here
                svc.postgres.execute(f"CREATE ROLE \"{user}\" LOGIN SUPERUSER PASSWORD '{password}'")
            if db != "postgres":
                svc.postgres.execute(f'CREATE DATABASE "{db}" OWNER "{user}"')
            self._initdb_scripts(svc, env)
            return svc
        if image.startswith("nats"):
            args = [nats_server_binary(), *self._nats_args(svc)]
        else:
            entry = spec.get("entrypoint")
            if entry:  # e.g. ["sh", "-c"] + one command string using `rudder`
                args = [*entry, *self.command(svc)]
                env["PATH"] = f"{self._rudder_shim()}:{env['PATH']}"
            else:
                args = [sys.executable, "-m", "cli.main", *self.command(svc)]
        with open(svc.log, "ab") as log:
            svc.proc = subprocess.Popen(args, env=env, cwd=svc.root, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        return svc

    def _initdb_scripts(self, svc: Service, env: dict[str, str]) -> None:
        """What the image does on a fresh data folder: run /docker-entrypoint-initdb.d/*.sh as the
        superuser (here the embedded server's, over TCP with its password in the environment)."""
        assert svc.postgres is not None
        for target, host in sorted(self._mounts(svc)):
            if not target.startswith("/docker-entrypoint-initdb.d/") or not target.endswith(".sh"):
                continue
            pg_bin = Path(svc.postgres._bin("psql")).parent
            run_env = {**env, "PGHOST": "127.0.0.1", "PGPORT": str(svc.postgres.port),
                       "PGPASSWORD": svc.postgres.superuser_password, "POSTGRES_USER": svc.postgres.superuser,
                       "PATH": f"{pg_bin}:{env['PATH']}"}
            done = subprocess.run(["sh", str(host)], env=run_env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{target}: {done.stderr}"

    def _rudder_shim(self) -> Path:
        shim = self.work / "bin"
        shim.mkdir(exist_ok=True)
        script = shim / "rudder"
        if not script.exists():
            script.write_text(f"#!/bin/sh\nexec {sys.executable} -m cli.main \"$@\"\n")
            script.chmod(0o755)
        return shim

    def _nats_args(self, svc: Service) -> list[str]:
        cmd = [str(c) for c in svc.spec["command"]]
        i = cmd.index("-c")
        conf_in = svc.root / cmd[i + 1].lstrip("/")
        text = conf_in.read_text()
        # listen / http / cluster listen: 0.0.0.0:<port> or the container's own 127.0.0.1:<port>
        # (the monitor answers inside the container only) → this service's mapped ports
        text = re.sub(r"(?:0\.0\.0\.0|127\.0\.0\.1):(\d+)",
                      lambda m: f"127.0.0.1:{self.port(svc.name, int(m[1]))}", text)
        text = self._rewrite(svc, text)
        conf_out = conf_in.parent / f"mapped-{conf_in.name}"
        conf_out.write_text(text)
        return ["-c", str(conf_out)]

    def wait(self, name: str, condition: str, *, timeout: float) -> None:
        svc = self.services[name]
        deadline = time.monotonic() + timeout
        while True:
            if condition == "service_completed_successfully":
                assert svc.proc is not None
                code = svc.proc.poll()
                if code is not None:
                    assert code == 0, f"{name} exited with {code}:\n{self.log_tail(name)}"
                    return
            elif condition == "service_healthy":
                if svc.postgres is not None:
                    return
                if svc.image.startswith("nats") and self._nats_healthy(svc):
                    return
                assert svc.proc is not None and svc.proc.poll() is None, self.log_tail(name)
            else:
                return
            assert time.monotonic() < deadline, f"{name} not {condition} after {timeout}s:\n{self.log_tail(name)}"
            time.sleep(0.1)

    def _nats_healthy(self, svc: Service) -> bool:
        url = f"http://127.0.0.1:{self.port(svc.name, 8222)}/healthz?js-enabled-only=true"
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=1) as resp:
                return bool(resp.status == 200)
        return False

    def run_once(self, name: str, *, timeout: float = 120.0) -> None:
        """``docker compose run --rm <name>``: start it and wait for exit 0."""
        self.start(name)
        self.wait(name, "service_completed_successfully", timeout=timeout)

    def log_tail(self, name: str, lines: int = 30) -> str:
        svc = self.services.get(name)
        if svc is None or svc.log is None or not svc.log.exists():
            return ""
        return "\n".join(svc.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, name: str) -> None:
        svc = self.services[name]
        assert svc.proc is not None
        svc.proc.kill()
        svc.proc.wait(10)

    def stop(self) -> None:
        for name in reversed(list(self.services)):
            svc = self.services[name]
            if svc.proc is not None and svc.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, 15)
        for svc in self.services.values():
            if svc.proc is not None:
                try:
                    svc.proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(svc.proc.pid, 9)
            if svc.postgres is not None:
                svc.postgres.stop(mode="immediate")


def copy_project(dest: Path) -> Path:
    """The files compose.yaml refers to, in a fresh folder (so ./.secrets is the test's own), and
    the ``.env`` with the database passwords the compose file's header tells an operator to make."""
    import secrets

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "compose.yaml", dest / "compose.yaml")
    shutil.copytree(ROOT / "deploy", dest / "deploy")
    (dest / ".env").write_text("".join(
        f"{name}={secrets.token_urlsafe(24)}\n"
        for name in ("RUDDER_PG_SUPERUSER_PASSWORD", "RUDDER_DB_OWNER_PASSWORD", "RUDDER_DB_APP_PASSWORD")))
    return dest
