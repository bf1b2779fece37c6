"""compose.yaml, checked without a container engine: each Rudder service's command is parsed by
the real ``rudder`` command, each ``RUDDER_*`` variable must be a field of the settings class of
that process (and build it), and each NATS service's arguments and configuration, with the files
compose's own bus-setup service writes, pass the real ``nats-server -t``. (Running the fleet as
processes is a separate, slower test.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from cli.embedded import nats_server_binary
from cli.main import app
from controlplane.settings import ControlPlaneSettings
from tests.unit.deploy_checks import SETTINGS_OF, build_settings, cli_envvars, command_path, names_a_field
from tests.unit.test_kubernetes import PENDING_COMMANDS, PENDING_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
RUDDER_IMAGE = "rudder:local"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())  # resolves the `<<:` merges
    return dict(compose["services"])


def _rudder_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found = {n: s for n, s in services.items() if s.get("image") == RUDDER_IMAGE}
    assert {"migrate", "controlplane", "router-1", "router-2", "worker-1", "worker-2"} <= set(found)
    return found


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _settings_of(name: str, service: dict[str, Any]) -> type[Any]:
    if "command" not in service:  # the `cli` tool service: any command, database commands too
        return ControlPlaneSettings
    path, _ = command_path([str(a) for a in service["command"]], PENDING_COMMANDS)
    assert path in SETTINGS_OF, f"{name}: {path} has no settings class in deploy_checks"
    return SETTINGS_OF[path]


def test_rudder_services_run_real_commands(services: dict[str, dict[str, Any]]) -> None:
    seen = set()
    for name, service in _rudder_services(services).items():
        if "command" in service:
            path, _ = command_path([str(a) for a in service["command"]], PENDING_COMMANDS)
            seen.add(path)
        else:
            assert name == "cli", f"{name}: no command"
    assert {("db", "upgrade"), ("serve", "controlplane"), ("serve", "router"),
            ("serve", "worker")} <= seen


def test_rudder_variables_are_real_settings(services: dict[str, dict[str, Any]]) -> None:
    cli_names = cli_envvars()
    unknown = []
    for name, service in _rudder_services(services).items():
        settings = _settings_of(name, service)
        env = _env(service)
        for var in env:
            if var.startswith("RUDDER_") and var not in cli_names | PENDING_SETTINGS \
                    and not names_a_field(settings, var):
                unknown.append(f"{name}: {var} is not a field of {settings.__name__}")
        build_settings(settings, {k: v for k, v in env.items() if k.startswith("RUDDER_")})
    assert not unknown, "\n".join(unknown)


def test_replicas_and_servers_agree(services: dict[str, dict[str, Any]]) -> None:
    nats = sorted(n for n, s in services.items() if str(s.get("image", "")).startswith("nats:"))
    assert len(nats) == 3
    for name, service in _rudder_services(services).items():
        env = _env(service)
        if "RUDDER_NATS_URL" not in env:
            assert _settings_of(name, service) is ControlPlaneSettings and "command" in service
            continue  # the migration job: PostgreSQL only
        hosts = sorted(u.split("://", 1)[1].split(":", 1)[0] for u in env["RUDDER_NATS_URL"].split(","))
        assert hosts == nats, name
        # bus-init creates the streams with it; every service refuses streams that differ.
        assert env.get("RUDDER_STREAM_REPLICAS") == "3", name


def test_nats_services_pass_nats_server_t(services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """Each NATS node as compose starts it, with what the bus-setup service writes to ./.secrets."""
    setup = services["bus-setup"]
    ((source, target),) = [str(v).split(":")[:2] for v in setup["volumes"]]
    assert source == "./.secrets"
    secrets = tmp_path / "secrets"
    args = [str(a) for a in setup["command"]]
    uid = args.index("--uid")  # chown to the image's user: needs root, and is no part of the check
    args = [str(secrets) if a == target else a for a in args[:uid] + args[uid + 2:]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for name, service in services.items():
        if not str(service.get("image", "")).startswith("nats:"):
            continue
        root = tmp_path / name
        mounts = []
        for volume in service.get("volumes", []):
            source, target = str(volume).split(":")[:2]
            inside = root / target.lstrip("/")
            mounts.append(target)
            if source.startswith("./"):
                host = secrets / source[len("./.secrets/"):] if source.startswith("./.secrets") \
                    else ROOT / source[2:]
                inside.parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if host.is_dir() else shutil.copyfile)(host, inside)
            else:  # a named volume
                inside.mkdir(parents=True, exist_ok=True)
        pattern = re.compile("|".join(re.escape(m.rstrip("/")) + r"(?=/|\b)" for m in
                                      sorted(mounts, key=len, reverse=True)))
        for conf in root.rglob("*.conf"):
            conf.write_text(pattern.sub(lambda m, r=root: f"{r}{m.group(0)}", conf.read_text()))
        argv = [pattern.sub(lambda m, r=root: f"{r}{m.group(0)}", str(a)) for a in service["command"]]
        proc = subprocess.run([nats_server_binary(), *argv, "-t"], capture_output=True, text=True,
                              env=dict(os.environ), timeout=30, check=False)
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
