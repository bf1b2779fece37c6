"""``rudder up``: the whole stack on one machine, data under ``.rudder/``.

Starts NATS (JetStream, operator-mode auth; one identity per process) and PostgreSQL as real
servers (scram authentication; a schema owner role for the migrations and an app role for the
control plane, passwords in ``.rudder/db-roles``), applies the migrations as the owner, makes the
policy and the audit checkpoint signing keys (``.rudder/keys/{policy,checkpoint}.{seed,pub}``),
creates an admin token the first time (kept in
``.rudder/credentials``, mode 0600, reused later, with the app role's database URL: never the
owner's), then the control plane, routers and workers as child processes, each waited for until
healthy. It says "ready" and writes ``.rudder/credentials`` only once every router serves the
model with every worker joined. Then it supervises: a child that exits on its own is restarted
with backoff and the restart is printed (``rudder status`` shows each process, its state and
restarts). Ctrl-C or SIGTERM stops everything it started and exits 0.
"""

from __future__ import annotations

import contextlib
import enum
import os
import secrets
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Annotated

import httpx
import typer

from bus.identities import Identity, IdentityKind
from cli import admin
from cli.config import CREDENTIALS_FILE, read_credentials, write_credentials
from cli.embedded import free_port
from cli.errors import CliError, ExitCode
from cli.fleet import manifest_body
from cli.keys import ensure_keys
from cli.loader import available
from cli.output import note, report_error, say, show, table
from cli.stack import Child, Stack, UpLock, child_env, pick_port
from controlplane.protocol.signing import Purpose

DATABASE = "rudder"
TOKEN_NAME = "rudder-up-admin"
ROUTER_ENTRY = "router.app"
WORKER_ENTRY = "worker.agent"


class Engine(enum.StrEnum):
    MOCK = "mock"
    VLLM = "vllm"


class _StopRequested(KeyboardInterrupt):
    """Raised from the SIGINT/SIGTERM handler to unwind into the cleanup. A KeyboardInterrupt, as
    Ctrl-C's own is: raised wherever the main thread is, it must not be taken for an error by an
    ``except Exception`` on the way, nor by an event loop (asyncio logs and drops any other
    exception raised in a callback). As an ``Exception`` it was, now and then: a stop signal that
    arrived during the NATS store probe (``asyncio.run``) was lost, the handler had already
    switched to ignoring further signals, and ``rudder up --ha`` ran on (test_up_ha, CI)."""


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Later stop signals while stopping. (A Python handler, not SIG_IGN: a signal already pending
    when its handler becomes SIG_IGN raises OSError "ignored due to race condition".)"""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # The first signal starts the cleanup; later ones are ignored from here on (the handler is
    # replaced before anything else runs), so a second Ctrl-C cannot escape as a traceback from
    # the "stopping" line or interrupt the cleanup. `up` restores the previous handlers after it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    raise _StopRequested(signal.Signals(signum).name)


def _token_works(server: str, token: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        resp = httpx.get(f"{server}/router_policy", params={"model": "-"},
                         headers={"authorization": f"Bearer {token}"}, timeout=5)
        return resp.status_code != 401
    return False


def issue_mock_manifest(server: str, token: str, *, instance_id: int, model: str, url: str) -> None:
    """Issue the manifest of a mock worker this stack starts (through the admin API, so it is
    signed and audited like any other): exactly the capacity its settings give it, at exactly
    its address. Raises CliError when the control plane refuses it."""
    from worker.settings import WorkerSettings  # the worker package is present (checked by the caller)

    s = WorkerSettings(model=model, instance_id=instance_id)
    host_port = url.removeprefix("http://")
    body = manifest_body(model=model, role=s.role.value, dp_size=s.dp_size, block_size=s.mock.block_size,
                         kv_blocks=s.mock.num_blocks, engine="mock", url_allow=host_port)
    try:
        resp = httpx.put(f"{server}/workers/{instance_id}/manifest", json=body,
                         headers={"authorization": f"Bearer {token}"}, timeout=10)
    except httpx.HTTPError as exc:
        raise CliError(ExitCode.UNAVAILABLE, f"manifest of worker {instance_id} not issued: {exc}") from exc
    if resp.status_code != 200:
        raise CliError(ExitCode.ERROR, f"manifest of worker {instance_id} refused: HTTP {resp.status_code} "
                                       f"{resp.text[:300]}")


def up(
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="Where NATS, PostgreSQL, logs and credentials live.")
    ] = Path(".rudder"),
    admin_port: Annotated[
        int | None,
        typer.Option("--admin-port", help="Admin API port [default: 8080, or a free one]."),
    ] = None,
    router_port: Annotated[
        int | None,
        typer.Option("--router-port",
                     help="First router's port, next ones count up [default: 8000, or free]."),
    ] = None,
    nats_port: Annotated[
        int | None, typer.Option("--nats-port", help="[default: 4222, or a free one]")
    ] = None,
    postgres_port: Annotated[
        int | None, typer.Option("--postgres-port", help="[default: 5432, or a free one]")
    ] = None,
    routers: Annotated[int, typer.Option("--routers", min=0, help="Router replicas.")] = 1,
    workers: Annotated[int, typer.Option("--workers", min=0, help="Workers.")] = 2,
    engine: Annotated[Engine, typer.Option("--engine", help="Worker engine.")] = Engine.MOCK,
    model: Annotated[str, typer.Option("--model", help="Model the fleet serves.")] = "mock-model",
    no_router: Annotated[bool, typer.Option("--no-router", help="Start no router.")] = False,
    no_workers: Annotated[bool, typer.Option("--no-workers", help="Start no worker.")] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to wait for each process to be healthy.")
    ] = 120.0,
    tls: Annotated[
        bool, typer.Option("--tls", help="TLS on every NATS connection (a private CA under the data dir).")
    ] = False,
    ha: Annotated[
        bool, typer.Option("--ha", help="Production shape: 3-node JetStream cluster (R3, fsync always), "
                           "2 control planes, 2 routers.")
    ] = False,
) -> None:
    """Start NATS, PostgreSQL, the control plane, routers and workers; Ctrl-C stops them all."""
    data_dir = data_dir.absolute()
    lock = UpLock(data_dir)
    lock.acquire()
    stack = Stack(data_dir=data_dir, progress=say)
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = ExitCode.OK
    try:
        _start(stack, data_dir=data_dir, admin_port=admin_port, router_port=router_port,
               nats_port=nats_port, postgres_port=postgres_port,
               routers=0 if no_router else (max(routers, 2) if ha else routers),
               workers=0 if no_workers else workers,
               engine=engine, model=model, timeout=timeout, tls=tls, ha=ha)
        stack.ready = True
        stack.write_status()
        say("rudder up: ready (Ctrl-C to stop)")
        while True:
            stack.supervise()
            time.sleep(0.25)
    except _StopRequested as stop:
        note(f"{stop}: stopping")
    except CliError as err:
        report_error(err, json_mode=False)
        code = err.exit_code
    finally:
        for sig in previous:  # a second Ctrl-C must not interrupt the cleanup
            signal.signal(sig, _ignore)
        try:
            stack.stop()
            note("stopped" if code == ExitCode.OK else "stopped after an error")
        finally:
            lock.release()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if code != ExitCode.OK:
        raise typer.Exit(int(code))


def worker_allow_list(ports: list[int]) -> str:
    """The routers' RUDDER_WORKER_URL_ALLOW under ``rudder up``: exactly the addresses it starts
    workers on (never the control plane's, nor any other port of this host). Without workers
    nothing is allowed (a port no one listens on) until RUDDER_WORKER_URL_ALLOW says otherwise."""
    return ",".join(f"127.0.0.1:{p}" for p in ports) or "127.0.0.1:1"


def _start(
    stack: Stack,
    *,
    data_dir: Path,
    admin_port: int | None,
    router_port: int | None,
    nats_port: int | None,
    postgres_port: int | None,
    routers: int,
    workers: int,
    engine: Engine,
    model: str,
    timeout: float,
    tls: bool = False,
    ha: bool = False,
) -> None:
    admin_port = pick_port(admin_port, 8080, "admin API")
    stack.start_nats(pick_port(nats_port, 4222, "NATS"), tls=tls, nodes=3 if ha else 1)
    assert stack.bus is not None
    nats_url = stack.bus.url
    access = stack.start_postgres(pick_port(postgres_port, 5432, "PostgreSQL"), DATABASE)
    began = time.monotonic()
    admin.upgrade(access.owner_url, app_role=access.app.name)  # the owner's URL: here only
    say(f"migrations    applied in {time.monotonic() - began:.1f}s")
    database_url = access.app_url  # what the control plane and the CLI use
    # Audit checkpoints are signed with a key of their own (`rudder keys ... --purpose
    # checkpoint`); an earlier version's .rudder/audit-signing.key is taken over, converted.
    checkpoint_seed, checkpoint_pub, _ = ensure_keys(data_dir / "keys", Purpose.CHECKPOINT,
                                                     legacy_seed=data_dir / "audit-signing.key")

    creds_path = data_dir / "credentials"
    token = read_credentials(creds_path).get("RUDDER_TOKEN") or ""
    fresh = not token
    if fresh:
        token = admin.create_token(database_url, TOKEN_NAME, "admin")

    # Policy events are signed (DESIGN §9): one key pair under .rudder/keys, made on the first
    # start and reused after; `rudder keys rotate` replaces it without a restart.
    seed, verify_keys, made = ensure_keys(data_dir / "keys")
    say(f"policy keys   {'made' if made else 'reused'}: {seed} (signing), {verify_keys} (verify)")
    # (A stream-leader election on the cluster holds every heartbeat back for about 5 s; routers
    # measure ages against the newest heartbeat heard, so the election stales no worker.)
    env = child_env({"RUDDER_POLICY_VERIFY_KEYS": str(verify_keys),
                     "RUDDER_STREAM_REPLICAS": "3" if ha else "1",
                     "RUDDER_AUDIT_SIGNING_KEY": str(checkpoint_seed),
                     "RUDDER_AUDIT_VERIFY_KEYS": str(checkpoint_pub)})
    # Database settings go to the control plane only: a router's or a worker's environment never
    # holds the database password (issue 17), nor does any child hold the owner's.
    for name in [k for k in env if k.startswith("RUDDER_DATABASE")]:
        env.pop(name)
    logs = data_dir / "logs"
    server = f"http://127.0.0.1:{admin_port}"
    planes = [admin_port] + ([pick_port(None, admin_port + 1, "admin API")] if ha else [])
    if workers and not available(WORKER_ENTRY):
        note(f"workers: {WORKER_ENTRY} is not in this installation; starting no workers")
        workers = 0
    if routers and not available(ROUTER_ENTRY):
        note(f"routers: {ROUTER_ENTRY} is not in this installation; starting no routers")
        routers = 0
    # Two tiers, each started side by side and ready when its slowest member is: the control
    # planes with the routers (a router needs only the bus), then the workers, whose manifests the
    # control plane issues. Routers are listening when the workers' join events arrive, which
    # spares them a full KV dump per worker. The workers' ports are picked now: the routers'
    # worker-URL allow-list is exactly those addresses, so a worker (or a stolen worker
    # credential) cannot point routers at the control plane or anything else on this host.
    worker_ports = [free_port() for _ in range(workers)]
    allow = os.environ.get("RUDDER_WORKER_URL_ALLOW") or worker_allow_list(worker_ports)
    tier: list[Child] = []
    for i, port in enumerate(planes):
        name = "controlplane" if len(planes) == 1 else f"controlplane-{i + 1}"
        url = f"http://127.0.0.1:{port}"
        tier.append(Child(
            name=name, kind="controlplane", url=url, health_url=f"{url}/readyz",
            args=["serve", "controlplane"],
            env={**env, **stack.bus_env(Identity(IdentityKind.CONTROLPLANE)),
                 "RUDDER_DATABASE_URL": database_url,
                 "RUDDER_ADMIN_HOST": "127.0.0.1", "RUDDER_ADMIN_PORT": str(port),
                 "RUDDER_POLICY_SIGNING_KEY": str(seed)},
            log_path=logs / f"{name}.log",
        ))
    next_port = 8000 if router_port is None else router_port
    for i in range(routers):
        # The first router gets --router-port exactly; the next ones count up, or any free port.
        port = pick_port(next_port if router_port is not None and i == 0 else None, next_port, "router")
        while port in planes:  # not bound yet: the control planes start beside the routers
            if router_port is not None and i == 0:
                raise CliError(ExitCode.USAGE, f"router port {port} is the admin API's")
            port = pick_port(None, port + 1, "router")
        next_port = port + 1
        url = f"http://127.0.0.1:{port}"
        tier.append(Child(
            name=f"router-{i + 1}", kind="router", url=url, health_url=f"{url}/live",
            args=["serve", "router", "--model", model, "--port", str(port)],
            env={**env, **stack.bus_env(Identity(IdentityKind.ROUTER, router_id=f"router-{i + 1}")),
                 "RUDDER_ROUTER_ID": f"router-{i + 1}", "RUDDER_WORKER_URL_ALLOW": allow},
            log_path=logs / f"router-{i + 1}.log",
        ))
    stack.start_children(tier, timeout)
    if not fresh and not _token_works(server, token):
        note("the stored admin token is not known to this database; creating a new one")
        token = admin.create_token(database_url, TOKEN_NAME, "admin")
    worker_timeout = max(timeout, 600.0) if engine is Engine.VLLM else timeout
    tier = []
    for i, port in enumerate(worker_ports):
        instance_id = secrets.randbelow(2**63) + 1  # bound to its credentials below
        url = f"http://127.0.0.1:{port}"
        if engine is Engine.MOCK:  # what it may claim is issued before it announces itself
            issue_mock_manifest(server, token, instance_id=instance_id, model=model, url=url)
        tier.append(Child(
            name=f"worker-{i + 1}", kind="worker", url=url, health_url=f"{url}/health",
            args=["serve", "worker", "--engine", engine.value, "--model", model,
                  "--port", str(port)],
            env={**env, **stack.bus_env(Identity(IdentityKind.WORKER, model=model, instance_id=instance_id)),
                 "RUDDER_INSTANCE_ID": str(instance_id)},
            log_path=logs / f"worker-{i + 1}.log",
        ))
    if engine is Engine.VLLM:  # one at a time: each vLLM sizes its KV cache by the memory it finds free
        for child in tier:
            stack.start_children([child], worker_timeout)
    else:
        stack.start_children(tier, worker_timeout)

    routers_started = [c for c in stack.children if c.kind == "router"]
    if routers_started and workers:
        _wait_fleet(routers_started, model, workers, timeout)
    # Only now: a script that waits for this file finds a fleet that can serve.
    write_credentials(creds_path, {
        "RUDDER_SERVER": server, "RUDDER_TOKEN": token,
        "RUDDER_DATABASE_URL": database_url, "RUDDER_NATS_URL": nats_url,
    })

    rows: list[tuple[str, str, str, str]] = [
        (f"nats-{n.server_name}" if n.server_name else "nats", n.url, str(n.proc.pid if n.proc else "-"),
         str(n.data_dir)) for n in stack.bus.servers]
    if stack.postgres is not None:
        shown = f"postgresql://{access.app.name}@127.0.0.1:{stack.postgres.port}/{DATABASE}"
        rows.append(("postgres", shown, "-", str(stack.postgres.data_dir)))
    rows += [(c.name, c.url, str(c.pid), str(c.log_path)) for c in stack.children]
    show(table(["process", "url", "pid", "data / log"], rows))
    say(f"admin token:  {token}")
    if creds_path == (Path.cwd() / CREDENTIALS_FILE).absolute():
        say(f"credentials:  {creds_path} (read by the rudder CLI in this directory)")
    else:
        say(f"credentials:  {creds_path} (export its lines to use the rudder CLI elsewhere)")
    if stack.children and any(c.kind == "router" for c in stack.children):
        router_url = next(c.url for c in stack.children if c.kind == "router")
        say(f"try:          curl {router_url}/v1/models ; rudder policy list")


def _wait_fleet(routers: list[Child], model: str, workers: int, timeout: float) -> None:
    """Wait until every router lists ``model`` with ``workers`` workers (its discovery view)."""
    deadline = time.monotonic() + timeout
    for router in routers:
        seen = -1
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                body = httpx.get(f"{router.url}/v1/models", timeout=2).json()
                seen = max((int(m.get("workers", 0)) for m in body["data"] if m["id"] == model), default=0)
                if seen >= workers:
                    break
            if time.monotonic() > deadline:
                raise CliError(ExitCode.UNAVAILABLE,
                               f"{router.name} sees {max(seen, 0)} of {workers} workers of {model} after "
                               f"{timeout:g}s; log {router.log_path}:\n{router.log_tail()}")
            time.sleep(0.1)
    say(f"fleet         every router sees {workers} worker(s) of {model}")


def status(
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="The folder `rudder up` runs on.")
    ] = Path(".rudder"),
) -> None:
    """Show what `rudder up` runs: each process, its state, pid and restarts (exit 6 if not running)."""
    import json

    from cli import app as shared
    from cli.output import print_json
    from cli.stack import pid_alive

    path = data_dir.absolute() / "status.json"
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        body = None
    if not body or not pid_alive(int(body.get("pid", 0))):
        raise CliError(ExitCode.NOT_FOUND, f"rudder up is not running on {data_dir.absolute()}")
    if shared.json_mode():
        print_json(body)
        return
    rows = [(p["name"], p["state"], str(p.get("pid") or "-"), str(p.get("restarts", 0)),
             "-" if p.get("last_exit") is None else str(p["last_exit"]), p.get("url") or "-")
            for p in body["processes"]]
    show(table(["process", "state", "pid", "restarts", "last exit", "url"], rows))
    say(f"rudder up (pid {body['pid']}) {'ready' if body.get('ready') else 'starting'} on {body['data_dir']}")
