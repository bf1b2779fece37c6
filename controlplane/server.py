"""Wires one control-plane process: NATS, the audit store, the fleet view, the write path, the
reconciler and the admin API, all opened in the lifespan and closed in reverse order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from nats.aio.client import Client as NATS

from bus.connect import connect
from bus.streams import CONTROLPLANE_STREAMS, check, wait_ready
from controlplane.acks import AckConsumer
from controlplane.api import build_app
from controlplane.audit.store import AuditStore
from controlplane.auth import AuthFailureLimiter, TokenStore, failure_entry
from controlplane.checkpoints import (
    Checkpointer,
    CheckpointLog,
    KeyFileError,
    load_signer,
    load_verify_keys,
)
from controlplane.eventlog import PolicyLog
from controlplane.failpoints import Failpoints
from controlplane.fleet import FleetView
from controlplane.protocol.errors import ConfigurationError, KeyFileInvalid, RudderError
from controlplane.protocol.signing import Keyring, KeyringFile, SigningKeyFile
from controlplane.queries import Queries
from controlplane.reconcile import Reconciler
from controlplane.settings import ControlPlaneSettings
from controlplane.tasks import cancel_all
from controlplane.writepath import WritePath

log = logging.getLogger(__name__)


class ControlPlane:
    """The process's services. ``start`` opens them; ``stop`` closes them in reverse."""

    def __init__(self, settings: ControlPlaneSettings, *, failpoints: Failpoints | None = None) -> None:
        self.settings = settings
        armed = [f for f in os.environ.get("RUDDER_FAILPOINTS", "").split(",") if f]
        self.failpoints = failpoints or Failpoints(armed)
        self._tasks: list[asyncio.Task[None]] = []
        self.auth_failures = AuthFailureLimiter(
            limit=settings.auth_failure_limit, window_s=settings.auth_failure_window_s,
            max_sources=settings.auth_failure_max_sources)

    async def start(self) -> None:
        s = self.settings
        assert s.policy_signing_key is not None  # the settings refuse to exist without it
        self.signing_key = SigningKeyFile(s.policy_signing_key, field="RUDDER_POLICY_SIGNING_KEY")
        self.verify_keys = (KeyringFile(s.policy_verify_keys, field="RUDDER_POLICY_VERIFY_KEYS")
                            if s.policy_verify_keys is not None else None)
        self.nc: NATS = await connect(s.bus_options("rudder-controlplane"))
        self.log = PolicyLog(self.nc, signer=self.signing_key.key, keyring=self._keyring())
        await self._ensure_streams()
        self.audit = AuditStore.from_url(s.database_url.get_secret_value())
        await self._check_database_role()
        self.tokens = TokenStore(self.audit.engine)
        self.checkpoints = self._checkpoint_log()
        self.checkpointer: Checkpointer | None = None
        if self.checkpoints is not None and self.checkpoints.signer is not None:
            self.checkpointer = Checkpointer(
                self.checkpoints, self.audit, interval_s=s.audit_checkpoint_interval_s,
                every_rows=s.audit_checkpoint_every_rows, writer=s.instance_name)
            self.audit.on_rows = self.checkpointer.notify
            self.checkpointer.start()
        self.fleet = FleetView(self.nc, worker_ttl_s=s.worker_ttl_s, router_heartbeat_s=s.router_heartbeat_s,
                               outage_grace_s=s.bus_outage_grace_s)
        self.acks = AckConsumer(self.nc.jetstream(), self.audit, durable=s.acks_consumer,
                                drops=self.fleet.drops)
        self.acks.start()
        await self.fleet.start()
        self.writes = WritePath(self.log, self.audit, self.fleet,
                                busy_threshold_retries=s.busy_threshold_retries, failpoints=self.failpoints)
        self.queries = Queries(self.log, self.fleet)
        self.reconciler = Reconciler(self.log, self.audit, grace_s=s.reconcile_grace_s)
        self._tasks.append(asyncio.create_task(
            self.reconciler.run_periodically(s.reconcile_interval_s), name="reconciler"))
        self._tasks.append(asyncio.create_task(self._record_auth_failures(), name="auth-failures"))
        self._tasks.append(asyncio.create_task(self._watch_keys(), name="policy-keys"))
        log.info("control plane ready: nats=%s admin=%s:%d signing key %s, valid keys %s", s.nats_url,
                 s.admin_host, s.admin_port, self.signing_key.key.key_id, ", ".join(self.log.keyring.key_ids))

    def _keyring(self) -> Keyring:
        return self.verify_keys.keyring if self.verify_keys is not None else Keyring({})

    def refresh_keys(self) -> bool:
        """Re-read the key files if they changed; a bad new file keeps the last good keys."""
        changed = False
        for watched in (self.signing_key, self.verify_keys):
            if watched is None:
                continue
            try:
                changed = watched.refresh() or changed
            except KeyFileInvalid as exc:
                log.error("policy key file not reloaded, keeping the last good keys: %s", exc.message)
        if changed:
            self.log.use_keys(self.signing_key.key, self._keyring())
            log.info("policy keys reloaded: signing with %s, valid keys %s", self.signing_key.key.key_id,
                     ", ".join(self.log.keyring.key_ids))
        return changed

    async def _watch_keys(self) -> None:
        while True:
            await asyncio.sleep(self.settings.key_poll_s)
            self.refresh_keys()

    async def _ensure_streams(self) -> None:
        """Wait for the streams the bus admin creates (``rudder bus init``) and check their
        settings; a stream that differs from ours stops start-up naming the setting."""
        s = self.settings
        await wait_ready(self.nc.jetstream(), s.bus_layout(worker_ttl_s=s.worker_ttl_s,
                                                          router_heartbeat_s=s.router_heartbeat_s),
                         CONTROLPLANE_STREAMS, timeout_s=s.startup_timeout_s)

    async def flush_auth_failures(self, *, everything: bool = False) -> int:
        """Write one audit row per ended window of failed authentications; returns how many.
        Raises AuditUnavailable (the windows are kept for the next attempt)."""
        windows = self.auth_failures.ended(everything=everything)
        if not windows:
            return 0
        window_s = self.settings.auth_failure_window_s
        try:
            await self.audit.append_many([failure_entry(w, window_s=window_s) for w in windows])
        except RudderError:
            self.auth_failures.requeue(windows)
            raise
        for w in windows:
            log.warning("audited %d failed authentication(s) from %s in one row", w.unrecorded, w.source)
        return len(windows)

    async def _record_auth_failures(self) -> None:
        interval = min(self.settings.auth_failure_window_s / 4, 5.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.flush_auth_failures()
            except RudderError as exc:
                log.warning("failed authentications not audited yet (%s); retrying", exc.message)

    async def _check_database_role(self) -> None:
        """Fail closed: a control plane that could disable the audit triggers does not start."""
        deadline = asyncio.get_running_loop().time() + self.settings.startup_timeout_s
        while True:
            try:
                problem = await self.audit.privileged_role()
                break
            except RudderError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"PostgreSQL not reachable: {exc.message}") from exc
                await asyncio.sleep(0.5)
        if problem is None:
            return
        if not self.settings.allow_privileged_database_role:
            raise RuntimeError(
                f"{problem}: set RUDDER_DATABASE_URL to the control plane's role (SELECT/INSERT "
                "only; see migrations/grants.py), or RUDDER_ALLOW_PRIVILEGED_DATABASE_ROLE=true "
                "for development")
        log.warning("%s; running anyway (RUDDER_ALLOW_PRIVILEGED_DATABASE_ROLE)", problem)

    def _checkpoint_log(self) -> CheckpointLog | None:
        """The checkpoint stream with this replica's signer and the trusted keys, or None when
        checkpoints are off and no verify keys are set. Raises RuntimeError naming a setting."""
        s = self.settings
        try:
            signer = load_signer(s.audit_signing_key) if s.audit_signing_key else None
            keys = load_verify_keys(s.audit_verify_keys) if s.audit_verify_keys else {}
        except KeyFileError as exc:
            raise RuntimeError(f"{exc.field}: {exc.message}") from exc
        if s.audit_checkpoints and signer is None:
            raise RuntimeError("RUDDER_AUDIT_SIGNING_KEY (an Ed25519 seed file) is required while "
                               "RUDDER_AUDIT_CHECKPOINTS is on")
        if signer is not None and not keys:
            keys = {signer.key_id: signer.verify_key}
        if not s.audit_checkpoints:
            signer = None
        if signer is None and not keys:
            return None
        return CheckpointLog(self.nc.jetstream(), keys=keys, signer=signer)

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        if getattr(self, "audit", None) is not None:
            with contextlib.suppress(RudderError):
                await self.flush_auth_failures(everything=True)
        if getattr(self, "checkpointer", None) is not None:
            assert self.checkpointer is not None
            await self.checkpointer.stop()
            # A last checkpoint, so what this replica wrote is anchored before it goes away.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.checkpointer.take(), 3.0)
        if getattr(self, "acks", None) is not None:
            await self.acks.stop()
        with contextlib.suppress(Exception):
            await self.fleet.stop()
        with contextlib.suppress(Exception):
            await self.nc.drain()
        with contextlib.suppress(Exception):
            await self.audit.close()

    async def readiness(self) -> dict[str, str]:
        checks: dict[str, str] = {}
        checks["nats"] = "ok" if self.nc.is_connected else "disconnected"
        s = self.settings
        layout = s.bus_layout(worker_ttl_s=s.worker_ttl_s, router_heartbeat_s=s.router_heartbeat_s)
        try:
            for stream in CONTROLPLANE_STREAMS:
                await asyncio.wait_for(check(self.nc.jetstream(timeout=1.0), layout, stream), 1.5)
            checks["streams"] = "ok"
        except ConfigurationError as exc:
            checks["streams"] = exc.message
        except Exception as exc:  # the bus did not answer: say so without its internals
            checks["streams"] = f"unavailable ({type(exc).__name__})"
        try:
            await self.audit.ping()
            checks["postgres"] = "ok"
        except RudderError as exc:
            # The reason goes to the log, not to the unauthenticated caller.
            log.warning("readiness: database unavailable: %s", exc.message)
            checks["postgres"] = "unavailable"
        return checks


def create_app(settings: ControlPlaneSettings, *, failpoints: Failpoints | None = None) -> FastAPI:
    cp = ControlPlane(settings, failpoints=failpoints)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await cp.start()
        try:
            yield
        finally:
            await cp.stop()

    app = build_app(cp, lifespan=lifespan)
    app.state.controlplane = cp
    return app


@dataclass
class Running:
    url: str
    app: FastAPI
    server: uvicorn.Server

    @property
    def controlplane(self) -> ControlPlane:
        cp: ControlPlane = self.app.state.controlplane
        return cp


@contextlib.asynccontextmanager
async def serving(settings: ControlPlaneSettings, *, failpoints: Failpoints | None = None) -> AsyncIterator[Running]:
    """Run a control plane inside this event loop (tests, embedding); yields once it listens."""
    app = create_app(settings, failpoints=failpoints)
    config = uvicorn.Config(app, host=settings.admin_host, port=settings.admin_port, log_level="warning",
                            lifespan="on", access_log=False, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(), name="admin-api")
    while not server.started:
        if task.done():
            try:
                task.result()
            except SystemExit as exc:  # uvicorn exits on a failed lifespan start
                raise RuntimeError("control plane did not start; see its log") from exc
            raise RuntimeError("control plane did not start")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Running(url=f"http://{settings.admin_host}:{port}", app=app, server=server)
    finally:
        server.should_exit = True
        await task


async def serve(settings: ControlPlaneSettings) -> None:
    config = uvicorn.Config(create_app(settings), host=settings.admin_host, port=settings.admin_port,
                            log_level=settings.log_level.lower(), lifespan="on", access_log=False,
                            timeout_graceful_shutdown=10)
    await uvicorn.Server(config).serve()


def run(settings: ControlPlaneSettings | None = None) -> None:
    settings = settings or ControlPlaneSettings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(settings))


