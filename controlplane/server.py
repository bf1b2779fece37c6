"""Wires one control-plane process: NATS, the audit store, the fleet view, the write path, the
reconciler and the admin API, all opened in the lifespan and closed in reverse order."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from bus.client import Bus
from bus.keyfiles import KeyringFile, SigningKeyFile
from bus.streams import CONTROLPLANE_STREAMS
from bus.tasks import Tasks, every
from controlplane.acks import AckConsumer, RevisionCheck
from controlplane.api import build_app
from controlplane.api.app import error_response
from controlplane.audit.store import AuditStore
from controlplane.auth import AuthFailureLimiter, TokenStore, failure_entry
from controlplane.checkpoints import Checkpointer, CheckpointLog
from controlplane.decisions import DecisionQueries
from controlplane.eventlog import PolicyLog
from controlplane.failpoints import Failpoints
from controlplane.fleet import FleetView
from controlplane.manifests import ManifestStore
from controlplane.protocol.errors import ConfigurationError, KeyFileInvalid, RudderError
from controlplane.protocol.signing import Keyring, Purpose
from controlplane.protocol.subjects import PROBE_CONTROLPLANE
from controlplane.queries import Queries
from controlplane.reconcile import Reconciler
from controlplane.restore import RestoreResponder
from controlplane.settings import ControlPlaneSettings
from controlplane.telemetry import traces
from controlplane.telemetry.logs import configure_logging
from controlplane.writepath import WritePath
from router.ingress import IngressLimits, protocol_class

log = logging.getLogger(__name__)


class ControlPlane:
    """The process's services. ``start`` opens them; ``stop`` closes them in reverse."""

    def __init__(self, settings: ControlPlaneSettings, *, failpoints: Failpoints | None = None) -> None:
        self.settings = settings
        armed = [f for f in os.environ.get("RUDDER_FAILPOINTS", "").split(",") if f]
        self.failpoints = failpoints or Failpoints(armed)
        self.tasks = Tasks("control plane")
        self.auth_failures = AuthFailureLimiter(
            limit=settings.auth_failure_limit, window_s=settings.auth_failure_window_s,
            max_sources=settings.auth_failure_max_sources, max_rows=settings.auth_failure_max_rows)
        #: Told each audit append's duration and outcome (the admin API's metrics set it).
        self.on_audit_append: Callable[[float, bool], None] | None = None

    async def start(self) -> None:
        s = self.settings
        assert s.policy_signing_key is not None  # the settings refuse to exist without it
        self.signing_key = SigningKeyFile(s.policy_signing_key, field="RUDDER_POLICY_SIGNING_KEY")
        self.verify_keys = (KeyringFile(s.policy_verify_keys, field="RUDDER_POLICY_VERIFY_KEYS")
                            if s.policy_verify_keys is not None else None)
        self.checkpoint_keys = self._checkpoint_key_files()
        self.bus = await Bus.connect(s.bus_options("rudder-controlplane"))
        self.log = PolicyLog(self.bus, signer=self.signing_key.key, keyring=self._keyring())
        await self._ensure_streams()
        self.audit = AuditStore.from_url(s.database_url.get_secret_value())
        await self._check_database_role()
        self.audit.on_append = self.on_audit_append
        self.tokens = TokenStore(self.audit.engine)
        self.checkpoints = self._checkpoint_log()
        self.checkpointer: Checkpointer | None = None
        if self.checkpoints is not None and self.checkpoints.signer is not None:
            self.checkpointer = Checkpointer(
                self.checkpoints, self.audit, interval_s=s.audit_checkpoint_interval_s,
                every_rows=s.audit_checkpoint_every_rows, writer=s.instance_name)
            self.audit.on_rows = self.checkpointer.notify
            self.tasks.spawn(self.checkpointer.run(), name="audit-checkpointer")
        self.fleet = FleetView(self.bus, worker_ttl_s=s.worker_ttl_s, router_heartbeat_s=s.router_heartbeat_s,
                               outage_grace_s=s.bus_outage_grace_s, probe_store=self.probe_store)
        self.acks = AckConsumer(self.bus, self.audit, durable=s.acks_consumer, drops=self.fleet.drops,
                                revisions=RevisionCheck(self.log))
        self.tasks.spawn(self.acks.run(), name="ack-consumer")
        self.tasks.spawn(self.fleet.watch_routers(), name="fleet-routers")
        await self.fleet.start()
        self.tasks.spawn(every(max(1.0, s.router_heartbeat_s), self._watch_store, "store probe"),
                         name="store-probe")
        self.restore = RestoreResponder(self.bus, self.audit, self.log, drops=self.fleet.drops)
        await self.restore.start()
        self.writes = WritePath(self.log, self.audit, self.fleet,
                                busy_threshold_retries=s.busy_threshold_retries, failpoints=self.failpoints)
        self.queries = Queries(self.log, self.fleet)
        self.manifests = ManifestStore(self.bus, signer=lambda: self.signing_key.key,
                                       keyring=lambda: self.log.keyring)
        self.decisions = DecisionQueries(self.bus, self.fleet)
        self.reconciler = Reconciler(self.log, self.audit, grace_s=s.reconcile_grace_s)
        self.tasks.spawn(self.reconciler.run_periodically(s.reconcile_interval_s), name="reconciler")
        auth_interval = min(s.auth_failure_window_s / 4, 5.0)
        self.tasks.spawn(self._record_auth_failures(auth_interval), name="auth-failures")
        self.tasks.spawn(every(s.key_poll_s, self._refresh_keys, "key files"), name="signing-keys")
        log.info("control plane ready: nats=%s admin=%s:%d signing key %s, valid keys %s", s.nats_url,
                 s.admin_host, s.admin_port, self.signing_key.key.key_id, ", ".join(self.log.keyring.key_ids))

    def _keyring(self) -> Keyring:
        return self.verify_keys.keyring if self.verify_keys is not None else Keyring({})

    def refresh_keys(self) -> bool:
        """Re-read the key files of both purposes if they changed (a rotation needs no restart);
        a bad new file keeps the last good keys. True if a policy key changed."""
        changed = self._reread("policy", (self.signing_key, self.verify_keys))
        if changed:
            self.log.use_keys(self.signing_key.key, self._keyring())
            log.info("policy keys reloaded: signing with %s, valid keys %s", self.signing_key.key.key_id,
                     ", ".join(self.log.keyring.key_ids))
        signer, verify = self.checkpoint_keys
        if self._reread("checkpoint", (signer, verify)) and self.checkpoints is not None:
            self.checkpoints.use_keys(
                signer.key if signer is not None and self.settings.audit_checkpoints else None,
                verify.keyring if verify is not None else Keyring({}, Purpose.CHECKPOINT))
            log.info("checkpoint keys reloaded: signing with %s, valid keys %s",
                     self.checkpoints.signer.key_id if self.checkpoints.signer else "none",
                     ", ".join(self.checkpoints.keyring.key_ids))
        return changed

    @staticmethod
    def _reread(purpose: str, files: tuple[SigningKeyFile | KeyringFile | None, ...]) -> bool:
        changed = False
        for watched in files:
            if watched is None:
                continue
            try:
                changed = watched.refresh() or changed
            except KeyFileInvalid as exc:
                log.error("%s key file not reloaded, keeping the last good keys: %s", purpose, exc.message)
        return changed

    async def _refresh_keys(self) -> None:
        self.refresh_keys()

    async def _ensure_streams(self) -> None:
        """Wait for the streams the bus admin creates (``rudder bus init``) and check their
        settings; a stream that differs from ours stops start-up naming the setting."""
        s = self.settings
        await self.bus.wait_ready(s.bus_layout(worker_ttl_s=s.worker_ttl_s,
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

    async def _record_auth_failures(self, interval: float) -> None:
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

    def _checkpoint_key_files(self) -> tuple[SigningKeyFile | None, KeyringFile | None]:
        """This replica's checkpoint signing key and the trusted checkpoint keys (files re-read
        on change). Raises RuntimeError naming a setting."""
        s = self.settings
        try:
            signer = (SigningKeyFile(s.audit_signing_key, field="RUDDER_AUDIT_SIGNING_KEY",
                                     purpose=Purpose.CHECKPOINT) if s.audit_signing_key else None)
            verify = (KeyringFile(s.audit_verify_keys, field="RUDDER_AUDIT_VERIFY_KEYS",
                                  purpose=Purpose.CHECKPOINT) if s.audit_verify_keys else None)
        except KeyFileInvalid as exc:
            raise RuntimeError(f"{exc.field}: {exc.message}") from exc
        if s.audit_checkpoints and signer is None:
            raise RuntimeError("RUDDER_AUDIT_SIGNING_KEY (an Ed25519 seed file) is required while "
                               "RUDDER_AUDIT_CHECKPOINTS is on")
        return signer, verify

    def _checkpoint_log(self) -> CheckpointLog | None:
        """The checkpoint stream with this replica's signer and the trusted keys (the verify
        keys and the signing key's own), or None when checkpoints are off and no key is set."""
        signer, verify = self.checkpoint_keys
        if signer is None and verify is None:
            return None
        return CheckpointLog(
            self.bus, signer=signer.key if signer is not None and self.settings.audit_checkpoints else None,
            keyring=verify.keyring if verify is not None else None)

    async def stop(self) -> None:
        await self.tasks.close()
        if getattr(self, "audit", None) is not None:
            with contextlib.suppress(RudderError):
                await self.flush_auth_failures(everything=True)
        if getattr(self, "checkpointer", None) is not None:
            assert self.checkpointer is not None
            # A last checkpoint, so what this replica wrote is anchored before it goes away.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.checkpointer.take(), 3.0)
        with contextlib.suppress(Exception):
            await self.fleet.stop()
        if getattr(self, "bus", None) is not None:
            await self.bus.close(drain_s=30.0)
        with contextlib.suppress(Exception):
            await self.audit.close()

    async def probe_store(self) -> str:
        """Whether JetStream can store: a probe write to ``RUDDER_PROBE`` (a full disk leaves
        NATS connected and answering reads while every write fails or times out). The fleet
        view holds its ages while it cannot (B2: heartbeats cannot arrive either)."""
        try:
            await self.bus.store(PROBE_CONTROLPLANE, b"", ack_wait_s=1.0)
        except RudderError as exc:
            log.warning("readiness: NATS cannot store: %s", exc.message)
            self.fleet.bus_unhealthy(True)
            return "cannot_store"
        self.fleet.bus_unhealthy(False)
        return "ok"

    async def _watch_store(self) -> None:
        """Probe the bus's storage when the fleet view has heard nothing for half a TTL (or
        holds its ages): costs no write while heartbeats flow."""
        if self.fleet.holding or self.fleet.quiet():
            await self.probe_store()

    async def readiness(self) -> dict[str, str]:
        checks: dict[str, str] = {}
        checks["nats"] = "ok" if self.bus.connected else "disconnected"
        s = self.settings
        layout = s.bus_layout(worker_ttl_s=s.worker_ttl_s, router_heartbeat_s=s.router_heartbeat_s)
        try:
            await self.bus.check_streams(layout, CONTROLPLANE_STREAMS)
            checks["streams"] = "ok"
        except ConfigurationError as exc:
            checks["streams"] = exc.message
        except Exception as exc:  # the bus did not answer: say so without its internals
            checks["streams"] = f"unavailable ({type(exc).__name__})"
        checks["nats_store"] = await self.probe_store()
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


def uvicorn_options(settings: ControlPlaneSettings) -> dict[str, Any]:
    """The admin listener's connection limits: the router's guarded protocol (router/ingress.py)
    with the control plane's settings and its one error mapping."""
    limits = IngressLimits(
        max_connections=settings.max_connections, max_header_bytes=settings.max_header_bytes,
        header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
        write_timeout_s=settings.write_timeout_s, render=error_response,
        on_refused=lambda reason: log.debug("admin connection refused: %s", reason),
        probe_paths=frozenset({"/healthz", "/readyz", "/metrics"}),
    )
    return {"http": protocol_class(limits)}


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
                            lifespan="on", access_log=False, timeout_graceful_shutdown=10,
                            **uvicorn_options(settings))
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
    app = create_app(settings)
    # What is loaded by now (modules, FastAPI routes, pydantic schemas) lives as long as the process:
    # out of the collector's sight, a full collection no longer walks it. At 32 concurrent writes the
    # full collections cost about 8% of the process's CPU (docs/decisions.md 88); the router does
    # the same (router/app.py).
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, host=settings.admin_host, port=settings.admin_port,
                            log_level=settings.log_level.lower(), lifespan="on", access_log=False,
                            timeout_graceful_shutdown=10, log_config=None,  # the process's one log setup
                            **uvicorn_options(settings))
    await uvicorn.Server(config).serve()


def run(settings: ControlPlaneSettings | None = None) -> None:
    settings = settings or ControlPlaneSettings()
    configure_logging(settings.log_level)
    traces.setup_tracing("rudder-controlplane")
    asyncio.run(serve(settings))


