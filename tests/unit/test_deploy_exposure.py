"""What the deployments expose to a stolen credential (issue 17 item 7), read offline.

- The NATS monitor (``/connz`` lists every client, ``/varz`` the configuration) binds loopback in
  compose and Kubernetes; no Service or NetworkPolicy exposes port 8222; probes ask it from inside.
- No compose service runs as root: every ``rudder:local`` service, the one-shot jobs too
  (``bus-setup`` included: it writes ./.secrets as the image's user), runs as the image's user.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"


def _monitor(conf: Path) -> str:
    found = re.search(r"^http:\s*(\S+)", conf.read_text(), re.MULTILINE)
    assert found is not None, conf
    return found.group(1)


def test_the_nats_monitor_binds_loopback() -> None:
    confs = [*sorted((ROOT / "deploy" / "nats").glob("n*.conf")), KUBE / "base" / "nats.conf"]
    assert len(confs) == 4
    assert {_monitor(c) for c in confs} == {"127.0.0.1:8222"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


def test_no_kubernetes_object_exposes_the_monitor_port() -> None:
    for path in KUBE.rglob("*.yaml"):
        for doc in _docs(path):
            text = yaml.safe_dump(doc)
            if doc.get("kind") in ("Service", "NetworkPolicy"):
                assert "8222" not in text, f"{path}: {doc['metadata']['name']}"
            for probe in re.finditer(r"httpGet:.*?port: (\S+)", text, re.DOTALL):
                assert probe.group(1) not in ("monitor", "8222"), path


def test_no_compose_service_runs_as_root() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    as_root = {name for name, s in services.items() if str(s.get("user", "")).split(":")[0] in ("0", "root")}
    assert as_root == set()
    # The image's user (Dockerfile USER rudder, uid 10001) unless a service names another non-root one.
    assert "USER rudder" in (ROOT / "Dockerfile").read_text()
    ours = {name for name, s in services.items() if s.get("image") == "rudder:local"}
    assert "bus-setup" in ours and all(str(services[n].get("user", "10001")) != "0" for n in ours)
    assert "--uid" not in services["bus-setup"]["command"]  # (a chown needs root)
    assert services["bus-setup"]["restart"] == "no"


def test_each_compose_service_mounts_at_most_its_own_credential() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    creds = {name for name, spec in compose["secrets"].items() if str(spec.get("file", "")).endswith(".creds")}
    for name, service in compose["services"].items():
        mounted = [s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])]
        held = [s for s in mounted if s in creds]
        assert len(held) <= 1, f"{name} mounts {held}"
        if held:
            assert service["environment"]["RUDDER_NATS_CREDS"] == f"/run/secrets/{held[0]}", name


def test_bus_setup_refuses_a_folder_it_cannot_write_naming_it(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(app, ["bus", "setup", "--out", str(blocker / "secrets"), "--identity", "admin"])
    assert result.exit_code == 2, result.output
    assert "--out" in result.output and "install -d -o" in result.output
