"""One router process: wiring of settings, NATS, the scheduler actor, consumers and the API.

Entry points for the CLI (``rudder serve router``):

- :func:`create_app` (settings) → a FastAPI app whose lifespan connects and starts everything;
- :func:`serve` (settings) → runs it with uvicorn until cancelled or signalled;
- :func:`run` (settings) → ``asyncio.run(serve(settings))``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from datetime import datetime

import nats
import uvicorn
from fastapi import FastAPI
from nats.aio.client import Client as NATS

from controlplane.protocol.events import utcnow
from controlplane.protocol.policy import Number, PolicyKind, startup_values
from router.api import build_api
from router.consumers import (
    KvDumper,
    KvEventSubscriber,
    MembershipConsumer,
    PolicyConsumer,
    StatusPublisher,
    TaskSet,
    every,
    tick,
)
from router.metrics import RouterMetrics
from router.policy_state import ApplyResult, Outcome
from router.proxy import Proxy
from router.scheduler import Scheduler
from router.settings import RouterSettings
from router.streams import ensure_all
from router.tokenize import TokenizerRegistry
from router.upstream import UpstreamClient

log = logging.getLogger(__name__)


class RouterRuntime:
    """Everything one router process owns, opened in :meth:`start`, closed in :meth:`stop`."""

    def __init__(self, settings: RouterSettings, *, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.cache_inputs = settings.cache_inputs
        self.startup: dict[PolicyKind, dict[str, Number | None]] = {
            kind: startup_values(
                kind, overrides=settings.startup_overrides(kind), cache_inputs=self.cache_inputs
            )
            for kind in PolicyKind
        }
        self.scheduler = Scheduler(
            router_id=settings.router_id, models=settings.models, role=settings.role,
            mode=settings.mode, kv_events=settings.kv_events, cache_inputs=self.cache_inputs,
            startup=self.startup, worker_ttl_s=settings.worker_ttl_s,
            worker_stale_s=settings.worker_stale_s, approx_ttl_s=settings.approx_ttl_s, rng=rng,
        )
        self.metrics = RouterMetrics()
        self.tokenizers = TokenizerRegistry()
        self.tasks = TaskSet()
        self.started_at: datetime = utcnow()
        self.nc: NATS | None = None
        self.http = UpstreamClient(connect_timeout_s=settings.connect_timeout_s,
                                   read_timeout_s=settings.request_timeout_s)
        self.proxy: Proxy = Proxy(self.http)
        self.status: StatusPublisher | None = None
        self.policy: PolicyConsumer | None = None
        self.membership: MembershipConsumer | None = None
        self.kv: KvEventSubscriber | None = None

    async def start(self) -> None:
        s = self.settings
        self.scheduler.start()
        self.nc = await nats.connect(
            s.nats_url, name=f"rudder-router-{s.router_id}", max_reconnect_attempts=-1,
            reconnect_time_wait=0.5, connect_timeout=2,
        )
        js = self.nc.jetstream()
        bucket = await ensure_all(
            js, history_depth=s.history_depth, replicas=s.stream_replicas,
            worker_ttl_s=s.worker_ttl_s, heartbeat_s=s.heartbeat_s,
        )
        self.status = StatusPublisher(
            bucket, self.scheduler, router_id=s.router_id, models=list(s.models), role=s.role,
            mode=s.mode.value, url=s.url(), cache_inputs=self.cache_inputs, startup=self.startup,
            started_at=self.started_at,
        )
        dumper = None
        if s.mode.kv_aware and s.kv_events:
            dumper = KvDumper(self.nc, self.scheduler, self.tasks, timeout_s=s.kvdump_timeout_s)
            self.kv = KvEventSubscriber(self.nc, self.scheduler, dumper, models=list(s.models))
            await self.kv.start()
        self.membership = MembershipConsumer(js, self.scheduler, dumper, models=list(s.models))
        await self.membership.start()
        self.policy = PolicyConsumer(
            self.nc, js, self.scheduler, self.status, router_id=s.router_id,
            models=list(s.models), on_result=self._count,
        )
        await self.policy.start()
        await self.status.put()
        self.tasks.spawn(every(s.tick_s, lambda: tick(self.scheduler), "tick"), name="tick")
        self.tasks.spawn(every(s.heartbeat_s, self.status.put, "status"), name="status")
        self.tasks.spawn(every(s.tick_s, self._prewarm_tokenizers, "tokenizers"), name="tokenizers")
        # /health answers 503 until the membership replay is applied; the API serves meanwhile.
        self.tasks.spawn(self.membership.wait_complete(), name="first-discovery")
        log.info(
            "router %s serving %s on %s (mode %s, role %s, cache inputs %s)", s.router_id,
            ", ".join(s.models), s.url(), s.mode.value, s.role.value,
            ", ".join(sorted(self.cache_inputs)) or "none",
        )

    async def _prewarm_tokenizers(self) -> None:
        """Load a newly advertised tokenizer (a model folder) before requests need it."""
        for names in self.scheduler.view.tokenizers.values():
            self.tokenizers.prewarm(names)

    def _count(self, result: ApplyResult) -> None:
        status = "ACK" if result.outcome is Outcome.ACK else "NACK"
        self.metrics.policy_results.labels(status).inc()

    async def stop(self) -> None:
        for part in (self.policy, self.membership, self.kv):
            if part is not None:
                await part.stop()
        await self.tasks.close()
        await self.scheduler.stop()
        if self.status is not None:
            await self.status.delete()
        if self.nc is not None:
            # Flush what is published (the status delete, last ACKs), then close; a drain could
            # wait out its 30 s timeout on a consumer the server already forgot.
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=1)
            with contextlib.suppress(Exception):
                await self.nc.close()
        if self.http is not None:
            await self.http.aclose()


def create_app(settings: RouterSettings, *, runtime: RouterRuntime | None = None) -> FastAPI:
    rt = runtime or RouterRuntime(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await rt.start()
        try:
            yield
        finally:
            await rt.stop()

    app = FastAPI(title="Rudder router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = rt
    build_api(rt, app)
    return app


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


async def serve(settings: RouterSettings) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM, which uvicorn handles)."""
    print(
        f"rudder router {settings.router_id}: models {', '.join(settings.models)}, "
        f"{settings.url()}, mode {settings.mode.value}, role {settings.role.value}",
        flush=True,
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        access_log=False, lifespan="on", timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    await uvicorn.Server(config).serve()


def run(settings: RouterSettings | None = None) -> None:
    """Blocking entry point: settings from ``RUDDER_*`` when not given."""
    settings = settings or RouterSettings()
    configure_logging(settings.log_level)
    asyncio.run(serve(settings))
