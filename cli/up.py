"""``rudder up``: the whole stack on one machine, data under ``.rudder/``.

Starts NATS (JetStream) and PostgreSQL as real servers (scram authentication; a schema owner
role for the migrations and an app role for the control plane, passwords in ``.rudder/db-roles``),
applies the migrations as the owner, makes the audit checkpoint signing key
(``.rudder/audit-signing.key``), creates an admin token the first time (kept in
``.rudder/credentials``, mode 0600, reused later, with the app role's database URL: never the
owner's), then the control plane, routers and workers as child processes, each waited for until
healthy. Ctrl-C or SIGTERM
stops everything it started and exits 0; a child that dies on its own stops the rest and exits 1
(a half-running stack is harder to notice than a stopped one).
"""

from __future__ import annotations

import contextlib
import enum
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Annotated

import httpx
import typer

from cli import admin
from cli.config import CREDENTIALS_FILE, read_credentials, write_credentials
from cli.embedded import free_port
from cli.errors import CliError, ExitCode
from cli.loader import available, load
from cli.output import note, report_error, say, show, table
from cli.stack import Child, Stack, UpLock, child_env, pick_port

DATABASE = "rudder"
TOKEN_NAME = "rudder-up-admin"
ROUTER_ENTRY = "router.app"
WORKER_ENTRY = "worker.agent"


class Engine(enum.StrEnum):
    MOCK = "mock"
    VLLM = "vllm"


class _StopRequested(Exception):
    """Raised from the SIGINT/SIGTERM handler to unwind into the cleanup."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def _token_works(server: str, token: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        resp = httpx.get(f"{server}/router_policy", params={"model": "-"},
                         headers={"authorization": f"Bearer {token}"}, timeout=5)
        return resp.status_code != 401
    return False


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
               routers=0 if no_router else routers, workers=0 if no_workers else workers,
               engine=engine, model=model, timeout=timeout)
        say("rudder up: ready (Ctrl-C to stop)")
        while True:
            died = stack.first_exited()
            if died is not None:
                raise CliError(ExitCode.ERROR,
                               f"{died.name} exited with {died.exited}; stopping everything. "
                               f"log {died.log_path}:\n{died.log_tail()}")
            time.sleep(0.25)
    except _StopRequested as stop:
        note(f"{stop}: stopping")
    except CliError as err:
        report_error(err, json_mode=False)
        code = err.exit_code
    finally:
        for sig in previous:  # a second Ctrl-C must not interrupt the cleanup
            signal.signal(sig, signal.SIG_IGN)
        try:
            stack.stop()
            note("stopped" if code == ExitCode.OK else "stopped after an error")
        finally:
            lock.release()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if code != ExitCode.OK:
        raise typer.Exit(int(code))


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
) -> None:
    admin_port = pick_port(admin_port, 8080, "admin API")
    nats = stack.start_nats(pick_port(nats_port, 4222, "NATS"))
    access = stack.start_postgres(pick_port(postgres_port, 5432, "PostgreSQL"), DATABASE)
    began = time.monotonic()
    admin.upgrade(access.owner_url, app_role=access.app.name)  # the owner's URL: here only
    say(f"migrations    applied in {time.monotonic() - began:.1f}s")
    database_url = access.app_url  # what the control plane and the CLI use
    signing_key = data_dir / "audit-signing.key"
    load("controlplane.checkpoints", "generate_key_file")(signing_key)

    creds_path = data_dir / "credentials"
    token = read_credentials(creds_path).get("RUDDER_TOKEN") or ""
    fresh = not token
    if fresh:
        token = admin.create_token(database_url, TOKEN_NAME, "admin")

    env = child_env({"RUDDER_NATS_URL": nats.url, "RUDDER_DATABASE_URL": database_url,
                     "RUDDER_AUDIT_SIGNING_KEY": str(signing_key)})
    env.pop("RUDDER_DATABASE_OWNER_URL", None)  # no child needs the owner's password
    logs = data_dir / "logs"
    server = f"http://127.0.0.1:{admin_port}"
    stack.start_child(Child(
        name="controlplane", kind="controlplane", url=server, health_url=f"{server}/readyz",
        args=["serve", "controlplane"],
        env={**env, "RUDDER_ADMIN_HOST": "127.0.0.1", "RUDDER_ADMIN_PORT": str(admin_port)},
        log_path=logs / "controlplane.log",
    ), timeout)
    if not fresh and not _token_works(server, token):
        note("the stored admin token is not known to this database; creating a new one")
        token = admin.create_token(database_url, TOKEN_NAME, "admin")
    write_credentials(creds_path, {
        "RUDDER_SERVER": server, "RUDDER_TOKEN": token,
        "RUDDER_DATABASE_URL": database_url, "RUDDER_NATS_URL": nats.url,
    })

    if workers and not available(WORKER_ENTRY):
        note(f"workers: {WORKER_ENTRY} is not in this installation; starting no workers")
        workers = 0
    if routers and not available(ROUTER_ENTRY):
        note(f"routers: {ROUTER_ENTRY} is not in this installation; starting no routers")
        routers = 0
    # Routers first: they are listening when the workers' join events arrive, which spares them
    # a full KV dump per worker.
    next_port = 8000 if router_port is None else router_port
    for i in range(routers):
        port = pick_port(next_port if router_port is not None else None, next_port, "router")
        next_port = port + 1
        url = f"http://127.0.0.1:{port}"
        stack.start_child(Child(
            name=f"router-{i + 1}", kind="router", url=url, health_url=f"{url}/live",
            args=["serve", "router", "--model", model, "--port", str(port)],
            env=env, log_path=logs / f"router-{i + 1}.log",
        ), timeout)
    worker_timeout = max(timeout, 600.0) if engine is Engine.VLLM else timeout
    for i in range(workers):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        stack.start_child(Child(
            name=f"worker-{i + 1}", kind="worker", url=url, health_url=f"{url}/health",
            args=["serve", "worker", "--engine", engine.value, "--model", model,
                  "--port", str(port)],
            env=env, log_path=logs / f"worker-{i + 1}.log",
        ), worker_timeout)

    rows: list[tuple[str, str, str, str]] = [
        ("nats", nats.url, str(nats.proc.pid if nats.proc else "-"), str(data_dir / "nats"))]
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
