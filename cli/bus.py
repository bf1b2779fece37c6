"""``rudder bus``: the bus admin's commands (streams and NATS identities).

- ``rudder bus init``: with the admin identity (``RUDDER_NATS_CREDS``), create and update every
  stream and bucket with the configured replicas and history depth. The one-shot job compose and
  Kubernetes run beside the migration job; ``rudder up`` runs it itself.
- ``rudder bus creds``: issue a ``.creds`` file for one identity from the authority folder
  (``--home`` / ``RUDDER_BUS_HOME``: operator and account keys).
- ``rudder bus authority``: create the authority folder and print the server include to put in
  nats-server's config.
- ``rudder bus revoke``: revoke one user's credentials (a ``.creds`` file, or a user public key)
  in the account JWT of the server include; nats-server applies it when it restarts (each node,
  one at a time), then refuses them. Credentials issued afterwards for the identity are valid.
- ``rudder bus setup``: everything a deployment needs before its first start, in one folder: the
  authority, the NATS auth include, TLS material for the NATS host names and one ``.creds`` file
  per identity (compose mounts each as its service's secret; Kubernetes makes Secrets of them).
"""

from __future__ import annotations

import asyncio
import enum
import os
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


@app.command("revoke")
def revoke(
    creds: Annotated[Path | None, typer.Option("--creds", help="The .creds file to revoke.")] = None,
    user: Annotated[str | None, typer.Option("--user", help="Or the user's public key (U...).")] = None,
    home: HomeOpt = None,
) -> None:
    """Revoke one user's credentials (stolen, or of a retired process); restart nats-server to apply."""
    from bus import jwt
    from bus.authority import BusAuthority

    if (creds is None) == (user is None):
        raise CliError(ExitCode.USAGE, "give one of --creds FILE or --user PUBLIC_KEY")
    name = ""
    if creds is not None:
        try:
            user, name, _ = jwt.creds_user(creds.read_text())
        except (OSError, ValueError) as exc:
            raise CliError(ExitCode.USAGE, f"--creds {creds}: {exc}") from None
    assert user is not None
    try:
        authority = BusAuthority.open(home or Path(".rudder/bus"), create=False)
        at = authority.revoke(user, name=name)
    except FileNotFoundError as exc:
        raise CliError(ExitCode.USAGE, f"{exc}; create it with `rudder bus authority`") from None
    except ValueError as exc:
        raise CliError(ExitCode.USAGE, f"--user: {exc}") from None
    if shared.json_mode():
        print_json({"user": user, "name": name, "revoked_at": at, "server_include": str(authority.server_config)})
    else:
        say(f"revoked {name or user} ({user}): its credentials issued up to {at} (epoch s) are refused once "
            f"nats-server restarts with {authority.server_config} (each node, one at a time; a reload does "
            "not apply it). Issue new credentials for the identity with `rudder bus creds`.")


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


def parse_identity(text: str) -> Any:
    """``admin`` | ``controlplane`` | ``router:<router_id>`` | ``worker:<model>:<instance_id>``."""
    from bus.identities import Identity, IdentityKind

    kind, _, rest = text.partition(":")
    try:
        if kind == "router":
            return Identity(IdentityKind.ROUTER, router_id=rest)
        if kind == "worker":
            model, _, iid = rest.rpartition(":")
            return Identity(IdentityKind.WORKER, model=model, instance_id=int(iid))
        if kind in ("admin", "controlplane") and not rest:
            return Identity(IdentityKind(kind))
    except ValueError as exc:
        raise typer.BadParameter(f"{text!r}: {exc}", param_hint="--identity") from None
    raise typer.BadParameter(
        f"{text!r}: expected admin, controlplane, router:<id> or worker:<model>:<instance_id>",
        param_hint="--identity")


def check_writable(out: Path) -> None:
    """Refuse (exit 2, naming ``--out``) a folder this user cannot create or write: compose's
    bus-setup runs as the image's user (10001), never root, so ./.secrets must be its."""
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        uid = os.getuid()
        raise CliError(ExitCode.USAGE, f"--out {out}: {probe} is not a folder this user (uid {uid}) may write; "
                                       f"create it for this user first, e.g. `install -d -o {uid} {out}` "
                                       "(compose: `install -d -o 10001 .secrets`)")


@app.command("setup")
def setup(
    out: Annotated[Path, typer.Option("--out", help="Folder for authority, TLS and credentials.")],
    identity: Annotated[list[str], typer.Option(
        "--identity", help="admin | controlplane | router:<id> | worker:<model>:<instance_id> (repeatable).")],
    tls_host: Annotated[list[str] | None, typer.Option(
        "--tls-host", help="NATS host name or IP for the server certificate (repeatable).")] = None,
    uid: Annotated[int | None, typer.Option(
        "--uid", help="Give the credentials files to this user id (needs root; compose runs this job as "
                      "the image's user instead, whose files they are).")] = None,
) -> None:
    """Create (or reuse) the authority under OUT and issue credentials for every identity."""
    import shutil

    from bus.authority import BusAuthority
    from bus.tls import make_server_tls

    identities = [parse_identity(text) for text in identity]
    check_writable(out)
    authority = BusAuthority.open(out / "authority", create=True)
    shutil.copyfile(authority.server_config, out / "nats-auth.conf")
    tls = make_server_tls(out / "tls", hosts=tuple(tls_host)) if tls_host else None
    written = [str(authority.issue(who, out / f"{who.name}.creds")) for who in identities]
    if uid is not None:
        import os

        for path in written:
            os.chown(path, uid, -1)
        if tls is not None:
            os.chown(tls.key, uid, -1)
    if shared.json_mode():
        print_json({"authority": str(authority.home), "nats_auth": str(out / "nats-auth.conf"),
                    "tls_ca": str(tls.ca) if tls else None, "credentials": written})
        return
    say(f"authority     {authority.home} (keep it offline: it can mint any identity)")
    say(f"nats include  {out / 'nats-auth.conf'}")
    if tls is not None:
        say(f"tls           CA {tls.ca}, server {tls.cert}")
    for path in written:
        say(f"credentials   {path}")
