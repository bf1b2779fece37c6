"""compose.yaml, checked without a container engine: each Rudder service's command is parsed by
the real ``rudder`` command, each ``RUDDER_*`` variable must be a field of the settings class of
that process (and build it), and each NATS service's arguments and configuration pass the real
``nats-server -t``. (Running the fleet as processes is a separate, slower test.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.embedded import nats_server_binary
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
        for var in ("RUDDER_POLICY_REPLICAS", "RUDDER_STREAM_REPLICAS", "RUDDER_MEMBERSHIP_REPLICAS"):
            if var in env:
                assert env[var] == "3", f"{name}: {var}={env[var]}"
        if "RUDDER_NATS_URL" in env:
            hosts = sorted(u.split("://", 1)[1].split(":", 1)[0] for u in env["RUDDER_NATS_URL"].split(","))
            assert hosts == nats, name
    settings_needing_replicas = {"controlplane": "RUDDER_POLICY_REPLICAS",
                                 "router-1": "RUDDER_STREAM_REPLICAS",
                                 "worker-1": "RUDDER_MEMBERSHIP_REPLICAS"}
    for name, var in settings_needing_replicas.items():
        assert var in _env(services[name]), f"{name} states no {var}"


def test_nats_services_pass_nats_server_t(services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    for name, service in services.items():
        if not str(service.get("image", "")).startswith("nats:"):
            continue
        mounts = {}
        for volume in service.get("volumes", []):
            source, _, target = str(volume).partition(":")
            if source.startswith("./"):
                mounts[target.rsplit(":", 1)[0]] = ROOT / source[2:]
        args = [str(mounts.get(a, a)) for a in service["command"]]
        conf = Path(args[args.index("-c") + 1])
        # /data is the service's named volume.
        local = tmp_path / f"{name}.conf"
        local.write_text(conf.read_text().replace("/data/", f"{tmp_path}/{name}-data/"))
        args[args.index("-c") + 1] = str(local)
        proc = subprocess.run([nats_server_binary(), *args, "-t"], capture_output=True, text=True,
                              env=dict(os.environ), timeout=30, check=False)
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
