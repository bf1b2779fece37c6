"""``rudder bus``: the bus admin's commands (streams and NATS identities).

- ``rudder bus init``: with the admin identity (``RUDDER_NATS_CREDS``), create and update every
  stream and bucket with the configured replicas and history depth. The one-shot job compose and
  Kubernetes run beside the migration job; ``rudder up`` runs it itself.
- ``rudder bus creds``: issue a ``.creds`` file for one identity from the authority folder
  (``--home`` / ``RUDDER_BUS_HOME``: operator and account keys).
- ``rudder bus authority``: create the authority folder and print the server include to put in
  nats-server's config.
"""

from __future__ import annotations

import asyncio
import enum
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import app as shared
from cli.errors import CliError, ExitCode
from cli.output import print_json, say

app = shared.new_app("The bus: streams, NATS identities and credentials (bus admin only).")


class Kind(enum.StrEnum):
    ADMIN = "admin"
    CONTROLPLANE = "controlplane"
    ROUTER = "router"
    WORKER = "worker"


HomeOpt = Annotated[
    Path | None,
    typer.Option("--home", envvar="RUDDER_BUS_HOME", show_default=False,
                 help="Authority folder (operator and account keys) [default: .rudder/bus]."),
]


def _admin_settings(**overrides: Any) -> Any:
    from pydantic import ValidationError

    from bus.settings import BusAdminSettings

    try:
        return BusAdminSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        name = "RUDDER_" + str(first["loc"][0]).upper() if first["loc"] else "settings"
        raise CliError(ExitCode.USAGE, f"{name}: {first['msg']}") from None


@app.command("init")
def init(
    nats_url: Annotated[str | None, typer.Option("--nats-url", help="Server list (comma-separated).")] = None,
    replicas: Annotated[int | None, typer.Option("--replicas", help="Stream replicas.")] = None,
) -> None:
    """Create or update every stream and bucket (needs the admin identity's RUDDER_NATS_CREDS)."""
    from bus.admin import bus_init
    from controlplane.protocol.errors import RudderError

    s = _admin_settings(nats_url=nats_url, stream_replicas=replicas)
    layout = s.bus_layout(worker_ttl_s=s.worker_ttl_s, router_heartbeat_s=s.router_heartbeat_s)
    try:
        changed = asyncio.run(bus_init(s.bus_options("rudder-bus-init"), layout, timeout_s=s.init_timeout_s))
    except RudderError as exc:
        raise CliError(ExitCode.UNAVAILABLE if exc.status_code == 503 else ExitCode.ERROR, exc.message) from None
    if shared.json_mode():
        print_json({"changed": changed, "replicas": layout.replicas})
        return
    for line in changed or ["every stream and bucket already as configured"]:
        say(f"bus init: {line}")


@app.command("creds")
def creds(
    kind: Annotated[Kind, typer.Option("--kind", help="Identity kind.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the .creds file (mode 0600).")],
    home: HomeOpt = None,
    router_id: Annotated[str | None, typer.Option("--router-id", help="Router identity: its id.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Worker identity: its model.")] = None,
    instance_id: Annotated[int | None, typer.Option("--instance-id", help="Worker identity: its id.")] = None,
) -> None:
    """Issue credentials for one identity (a worker's are bound to its model and instance id)."""
    from bus.authority import BusAuthority
    from bus.identities import Identity, IdentityKind

    try:
        identity = Identity(IdentityKind(kind.value), router_id=router_id, model=model, instance_id=instance_id)
    except ValueError as exc:
        raise CliError(ExitCode.USAGE, str(exc)) from None
    try:
        authority = BusAuthority.open(home or Path(".rudder/bus"), create=False)
    except FileNotFoundError as exc:
        raise CliError(ExitCode.USAGE, f"{exc}; create it with `rudder bus authority`") from None
    path = authority.issue(identity, out)
    if shared.json_mode():
        print_json({"identity": identity.name, "path": str(path)})
    else:
        say(f"wrote credentials for {identity.name} to {path}")


@app.command("authority")
def authority_cmd(home: HomeOpt = None) -> None:
    """Create (or reuse) the authority folder; print the include for nats-server's config."""
    from bus.authority import BusAuthority

    authority = BusAuthority.open(home or Path(".rudder/bus"), create=True)
    if shared.json_mode():
        print_json({"home": str(authority.home), "server_include": str(authority.server_config),
                    "account": authority.account_public_key})
    else:
        say(f"authority in {authority.home}; add to nats-server's config: include \"{authority.server_config}\"")
