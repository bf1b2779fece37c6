"""The test session's bus authority: every test server refuses anonymous connections, and every
test process connects with credentials issued here for its own identity (DESIGN §9).

One authority (operator and account keys) serves the whole session, so any server started by a
fixture trusts the same credentials; a helper asks for the identity it stands for:
``creds_for(Identity(IdentityKind.ROUTER, router_id=...))``. The admin identity is what tests
use to play the bus admin (create streams) or an attacker holding full NATS rights.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
import threading
from pathlib import Path

from nats.aio.client import Client as NATS

from bus.admin import bus_init
from bus.authority import BusAuthority
from bus.connect import BusOptions, connect
from bus.identities import Identity, IdentityKind
from bus.streams import BusLayout

_lock = threading.Lock()
_authority: BusAuthority | None = None
_issued: dict[Identity, Path] = {}


def authority() -> BusAuthority:
    global _authority
    with _lock:
        if _authority is None:
            home = Path(tempfile.mkdtemp(prefix="rudder-test-bus-"))
            atexit.register(shutil.rmtree, home, True)
            _authority = BusAuthority.open(home)
        return _authority


def creds_for(identity: Identity) -> Path:
    """Credentials for ``identity`` (issued once per session and reused)."""
    auth = authority()
    with _lock:
        path = _issued.get(identity)
        # Re-issued when gone: LocalBus.start removes the admin credentials after bus init, and
        # test_bus_tls starts a LocalBus on this session's authority.
        if path is None or not path.exists():
            path = _issued[identity] = auth.issue(identity)
        return path


def admin_creds() -> Path:
    return creds_for(Identity(IdentityKind.ADMIN))


def controlplane_creds() -> Path:
    return creds_for(Identity(IdentityKind.CONTROLPLANE))


def router_creds(router_id: str) -> Path:
    return creds_for(Identity(IdentityKind.ROUTER, router_id=router_id))


def worker_creds(model: str, instance_id: int) -> Path:
    return creds_for(Identity(IdentityKind.WORKER, model=model, instance_id=instance_id))


def options(url: str, creds: Path, *, name: str = "rudder-test", ca: Path | None = None) -> BusOptions:
    return BusOptions.from_settings(nats_url=url, nats_creds=creds, nats_ca=ca, name=name)


async def admin_connect(url: str, **kw: object) -> NATS:
    """A connection with full rights (the bus admin, or an attacker who stole its credentials)."""
    return await connect(options(url, admin_creds(), name="rudder-test-admin"))


async def connect_as(url: str, identity: Identity) -> NATS:
    return await connect(options(url, creds_for(identity), name=f"rudder-test-{identity.name}"))


def init_streams(url: str, layout: BusLayout | None = None) -> list[str]:
    """``rudder bus init`` against ``url`` (from sync code: a fixture), in a thread of its own."""
    result: list[list[str]] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(bus_init(options(url, admin_creds(), name="rudder-test-init"),
                                               layout or BusLayout(), timeout_s=30)))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def worker_settings(**values: object) -> object:
    """A WorkerSettings whose instance id is bound to credentials issued for it."""
    from worker.settings import WorkerSettings, random_instance_id

    values.setdefault("instance_id", random_instance_id())
    values.setdefault("nats_creds", worker_creds(str(values["model"]), int(values["instance_id"])))  # type: ignore[call-overload]
    return WorkerSettings(**values)  # type: ignore[arg-type]


def worker_env(model: str, instance_id: int) -> dict[str, str]:
    """Environment for a worker process: its instance id and the credentials bound to it."""
    return {"RUDDER_INSTANCE_ID": str(instance_id),
            "RUDDER_NATS_CREDS": str(worker_creds(model, instance_id))}
