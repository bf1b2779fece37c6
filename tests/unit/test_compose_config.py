"""compose.yaml, checked without a container engine.

Compose's own one-shot jobs that make files (bus-setup: authority, NATS include, TLS, one
credential per identity; policy-keys: the signing key) are run for real, through the ``rudder``
command, with their volumes mapped to a temporary folder. Then each Rudder service's command is
parsed by the real CLI, each ``RUDDER_*`` variable must be a field of the settings class of that
process, and the settings object must build from the service's environment with those files
where the service mounts them (volumes and ``/run/secrets``); each NATS service's arguments and
configuration pass the real ``nats-server -t``. (Running the fleet as processes is a separate,
slower test: tests/integration/test_compose.py.)
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from cli.embedded import nats_server_binary
from cli.main import app
from controlplane.settings import ControlPlaneSettings
from tests.unit.deploy_checks import (
    BUILDS_SETTINGS,
    SETTINGS_OF,
    allowed_names,
    build_settings,
    command_path,
    names_a_field,
)
from tests.unit.test_kubernetes import PENDING_COMMANDS, PENDING_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
RUDDER_IMAGE = "rudder:local"
Service = dict[str, Any]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "compose.yaml").read_text()))  # resolves `<<:` merges


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Service]:
    return dict(compose["services"])


def _rudder_services(services: dict[str, Service]) -> dict[str, Service]:
    found = {n: s for n, s in services.items() if s.get("image") == RUDDER_IMAGE}
    assert {"migrate", "controlplane", "router-1", "router-2", "worker-1", "worker-2"} <= set(found)
    return found


def _argvs(name: str, service: Service) -> list[list[str]]:
    """The ``rudder`` invocations a service runs: its command (the image's entry point is
    ``rudder``), or the ``rudder ...`` steps of an ``sh -c`` script."""
    if "command" not in service:
        assert name == "cli", f"{name}: no command"  # the tool service: `compose run cli ...`
        return []
    if service.get("entrypoint") == ["sh", "-c"]:
        (script,) = service["command"]
        steps = [shlex.split(step) for step in str(script).split("&&")]
        found = [step[1:] for step in steps if step[0] == "rudder"]
        assert found, f"{name}: the script runs no rudder command"
        return found
    assert "entrypoint" not in service, f"{name}: keep the image's entry point (rudder)"
    return [[str(a) for a in service["command"]]]


def _env(service: Service) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


@dataclass
class Files:
    """Where compose's volumes and secrets are, here."""

    root: Path
    secrets_dir: Path  # ./.secrets, written by bus-setup

    def volume(self, source: str) -> Path:
        if source.startswith("./.secrets"):
            return self.secrets_dir / source[len("./.secrets"):].lstrip("/")
        if source.startswith("./"):
            return ROOT / source[2:]
        return self.root / "volumes" / source  # a named volume

    def mapping(self, compose: dict[str, Any], service: Service) -> dict[str, Path]:
        """Container path → host path, for the service's volumes and secrets."""
        out = {}
        for volume in service.get("volumes", []):
            source, target = str(volume).split(":")[:2]
            out[target] = self.volume(source)
        for secret in service.get("secrets", []):
            out[f"/run/secrets/{secret}"] = self.volume(compose["secrets"][secret]["file"])
        return out


def _in_here(value: str, mapping: dict[str, Path]) -> str:
    for target in sorted(mapping, key=len, reverse=True):
        if value == target or value.startswith(target.rstrip("/") + "/"):
            return str(mapping[target]) + value[len(target.rstrip("/")):]
    return value


@pytest.fixture(scope="module")
def files(compose: dict[str, Any], services: dict[str, Service],
          tmp_path_factory: pytest.TempPathFactory) -> Files:
    """Run the file-making jobs (bus-setup, policy-keys) as compose would, volumes mapped here."""
    root = tmp_path_factory.mktemp("compose")
    here = Files(root, root / "secrets")
    for name in ("bus-setup", "policy-keys"):
        service = services[name]
        mapping = here.mapping(compose, service)
        for host in mapping.values():
            host.mkdir(parents=True, exist_ok=True)
        for argv in _argvs(name, service):
            if "--uid" in argv:  # chown to the image's user: needs root, and is no part of the check
                at = argv.index("--uid")
                argv = argv[:at] + argv[at + 2:]
            result = CliRunner().invoke(app, [_in_here(a, mapping) for a in argv])
            assert result.exit_code == 0, f"{name}: {result.output}"
    return here


def test_rudder_services_run_real_commands(services: dict[str, Service]) -> None:
    seen = set()
    for name, service in _rudder_services(services).items():
        for argv in _argvs(name, service):
            seen.add(command_path(argv, PENDING_COMMANDS)[0])
    assert {("db", "upgrade"), ("bus", "setup"), ("bus", "init"), ("keys", "new"),
            ("serve", "controlplane"), ("serve", "router"), ("serve", "worker")} <= seen


def test_rudder_variables_are_real_settings(compose: dict[str, Any], services: dict[str, Service],
                                            files: Files) -> None:
    unknown = []
    for name, service in _rudder_services(services).items():
        env = {k: v for k, v in _env(service).items() if k.startswith("RUDDER_")}
        paths = [command_path(argv, PENDING_COMMANDS)[0] for argv in _argvs(name, service)]
        # The tool service runs any command, database ones too; a `keys` step reads only its
        # options' variables (no settings object).
        classes = [SETTINGS_OF[p] for p in paths if p in SETTINGS_OF] or \
            ([ControlPlaneSettings] if not paths else [])
        allowed = frozenset().union(*[allowed_names(p) for p in paths]) if paths else allowed_names(())
        for var in env:
            if var in allowed or var in PENDING_SETTINGS:
                continue
            if not classes or not all(names_a_field(c, var) for c in classes):
                unknown.append(f"{name}: {var} is read by none of {[c.__name__ for c in classes]}")
        mapping = files.mapping(compose, service)
        for path in paths:
            if path in BUILDS_SETTINGS:
                build_settings(SETTINGS_OF[path], {k: _in_here(v, mapping) for k, v in env.items()})
    assert not unknown, "\n".join(unknown)


def test_replicas_and_servers_agree(services: dict[str, Service]) -> None:
    nats = sorted(n for n, s in services.items() if str(s.get("image", "")).startswith("nats:"))
    assert len(nats) == 3
    for name, service in _rudder_services(services).items():
        env = _env(service)
        paths = [command_path(argv, PENDING_COMMANDS)[0] for argv in _argvs(name, service)]
        if not any(SETTINGS_OF.get(p) is not None and p in BUILDS_SETTINGS for p in paths):
            continue  # the migration, the key job, the tool service
        hosts = sorted(u.split("://", 1)[1].split(":", 1)[0] for u in env["RUDDER_NATS_URL"].split(","))
        assert hosts == nats, name
        # bus-init creates the streams with it; every service refuses streams that differ.
        assert env.get("RUDDER_STREAM_REPLICAS") == "3", name


def test_nats_services_pass_nats_server_t(compose: dict[str, Any], services: dict[str, Service],
                                          files: Files, tmp_path: Path) -> None:
    """Each NATS node as compose starts it, with what the bus-setup job wrote to ./.secrets."""
    for name, service in services.items():
        if not str(service.get("image", "")).startswith("nats:"):
            continue
        root = tmp_path / name
        mapping = files.mapping(compose, service)
        for target, host in mapping.items():
            inside = root / target.lstrip("/")
            if host.is_dir() or not host.exists():  # a directory, or an empty named volume
                if host.is_dir():
                    shutil.copytree(host, inside)
                inside.mkdir(parents=True, exist_ok=True)
            else:
                inside.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(host, inside)
        pattern = re.compile("|".join(re.escape(m.rstrip("/")) + r"(?=/|\b)" for m in
                                      sorted(mapping, key=len, reverse=True)))
        for conf in root.rglob("*.conf"):
            conf.write_text(pattern.sub(lambda m, r=root: f"{r}{m.group(0)}", conf.read_text()))
        argv = [pattern.sub(lambda m, r=root: f"{r}{m.group(0)}", str(a)) for a in service["command"]]
        proc = subprocess.run([nats_server_binary(), *argv, "-t"], capture_output=True, text=True,
                              env=dict(os.environ), timeout=30, check=False)
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
