"""What the deployments expose to a stolen credential (issue 17 item 7), read offline.

- The NATS monitor (``/connz`` lists every client, ``/varz`` the configuration) binds loopback in
  compose and Kubernetes; no Service or NetworkPolicy exposes port 8222; probes ask it from inside.
- No long-running compose service runs as root, and of the one-shot jobs only ``bus-setup`` does
  (it writes the host's ./.secrets bind mount and gives each file to the image's user).
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


def test_no_compose_service_runs_as_root_but_the_secrets_job() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    as_root = {name for name, s in services.items() if str(s.get("user", "")).split(":")[0] in ("0", "root")}
    assert as_root == {"bus-setup"}
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
