"""One router process: wiring of settings, NATS, the scheduler actor, consumers and the API.

Entry points for the CLI (``rudder serve router``):

- :func:`create_app` (settings) → a FastAPI app whose lifespan connects and starts everything;
- :func:`serve` (settings) → runs it with uvicorn until cancelled or signalled;
- :func:`run` (settings) → ``asyncio.run(serve(settings))``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import signal
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from bus.client import Bus, Message, Subscription
from bus.keyfiles import KeyringFile
from bus.streams import ROUTER_STREAMS
from bus.tasks import Tasks, every
from controlplane.protocol.errors import KeyFileInvalid, RudderError
from controlplane.protocol.events import DecisionReply, decode_decision_query, doc_key, utcnow
from controlplane.protocol.guard import Drops
from controlplane.protocol.policy import Number, PolicyKind, startup_values
from controlplane.protocol.subjects import BUCKET_ROUTERS, STREAM_POLICY, decisions_subject, policy_subject
from controlplane.telemetry import logs, traces
from controlplane.telemetry.logs import configure_logging
from router import build
from router.api import RouterApp, build_api, error_response
from router.claims import RateLimits
from router.commands import UseVerifyKeys
from router.consumers import (
    KvDumper,
    KvEventSubscriber,
    MembershipConsumer,
    PolicyConsumer,
    StatusPublisher,
    tick,
)
from router.decisions import DecisionLog
from router.express import Express
from router.fitting import Fitter
from router.ingress import IngressLimits, protocol_class
from router.manifests import ManifestBook, ManifestConsumer
from router.metrics import RouterMetrics
from router.peersync import LoadSharing
from router.policy_state import ApplyResult, Outcome
from router.proxy import Proxy
from router.scheduler import Scheduler
from router.settings import RouterSettings
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
        assert settings.policy_verify_keys is not None  # the settings refuse to exist without it
        self.decisions = DecisionLog(sample=settings.decision_sample, capacity=settings.decision_records)
        self.verify_keys = KeyringFile(settings.policy_verify_keys, field="RUDDER_POLICY_VERIFY_KEYS")
        self.scheduler = Scheduler(
            router_id=settings.router_id, models=settings.models, role=settings.role,
            mode=settings.mode, kv_events=settings.kv_events, cache_inputs=self.cache_inputs,
            startup=self.startup, worker_ttl_s=settings.worker_ttl_s,
            worker_stale_s=settings.worker_stale_s, bus_outage_grace_s=settings.bus_outage_grace_s,
            approx_ttl_s=settings.approx_ttl_s,
            keyring=self.verify_keys.keyring, rng=rng,
            max_queued_selections=settings.max_queued_selections, decisions=self.decisions,
            background_fits=True,
            caps=settings.claim_caps, peer_stale_s=settings.peer_stale_s, peer_sync=settings.peer_sync,
        )
        self.metrics = RouterMetrics()
        self.drops = Drops(
            logging.getLogger("router.bus"),
            count=lambda kind, reason: self.metrics.bus_drops.labels(kind, reason).inc(),
        )
        self.tokenizers = TokenizerRegistry()
        self.tasks = Tasks(f"router {settings.router_id}")
        self.started_at: datetime = utcnow()
        self.draining = False  # a graceful stop began: /health is 503, in-flight work finishes
        self._logged_stale: dict[str, int] = {}  # models last logged as having only stale workers
        self.bus: Bus | None = None
        # As many idle connections to a worker as the router can have requests in flight (one
        # per client connection): past the pool's bound each request's connection would close
        # when it ends and the next request connect anew, a TIME_WAIT port each (decision 106).
        self.http = UpstreamClient(connect_timeout_s=settings.connect_timeout_s,
                                   read_timeout_s=settings.request_timeout_s,
                                   max_idle_per_host=settings.max_connections)
        self.proxy: Proxy = Proxy(self.http)
        self.status: StatusPublisher | None = None
        self.policy: PolicyConsumer | None = None
        self.membership: MembershipConsumer | None = None
        self.manifest_book = ManifestBook()
        self.manifests: ManifestConsumer | None = None
        self.kv: KvEventSubscriber | None = None
        self.sharing: LoadSharing | None = None
        self._decision_sub: Subscription | None = None

    async def start(self) -> None:
        s = self.settings
        logs.bind(router_id=s.router_id)  # the lifespan's tasks (consumers, ticks) inherit it
        self.scheduler.start()
        self.bus = bus = await Bus.connect(s.bus_options(f"rudder-router-{s.router_id}"))
        await bus.wait_ready(s.bus_layout(worker_ttl_s=s.worker_ttl_s, router_heartbeat_s=s.heartbeat_s),
                             ROUTER_STREAMS, timeout_s=s.stream_wait_s)
        bucket = await bus.bucket(BUCKET_ROUTERS)
        self.status = StatusPublisher(
            bucket, self.scheduler, router_id=s.router_id, models=list(s.models), role=s.role,
            mode=s.mode.value, url=s.url(), cache_inputs=self.cache_inputs, startup=self.startup,
            started_at=self.started_at,
        )
        dumper = None
        if s.mode.kv_aware and s.kv_events:
            dumper = KvDumper(bus, self.scheduler, self.tasks, timeout_s=s.kvdump_timeout_s,
                              drops=self.drops, min_interval_s=s.kvdump_min_interval_s)
            self.kv = KvEventSubscriber(bus, self.scheduler, dumper, models=list(s.models),
                                        drops=self.drops,
                                        limits=RateLimits(s.kv_event_bytes_per_s, s.kv_event_burst_bytes))
            await self.kv.start()
            self.tasks.spawn(self.kv.run(), name="kv-events")
        # Manifests first: the first membership records are bounded by what was issued.
        self.manifests = ManifestConsumer(bus, self.manifest_book, keyring=lambda: self.verify_keys.keyring,
                                          drops=self.drops)
        await self.manifests.start()
        self.membership = MembershipConsumer(bus, self.scheduler, dumper, models=list(s.models),
                                             allow=s.url_allow_list, drops=self.drops,
                                             caps=s.claim_caps, manifests=self.manifest_book,
                                             limits=RateLimits(s.membership_rate_per_s, s.membership_burst))
        await self.membership.start()
        self.policy = PolicyConsumer(
            bus, self.scheduler, self.status, router_id=s.router_id,
            models=list(s.models), on_result=self._count, on_resync=self.metrics.policy_resyncs.inc,
        )
        await self.policy.start()
        self._decision_sub = await bus.subscribe(decisions_subject(s.router_id), self._answer_decisions)
        if s.peer_sync:  # router replicas share their bookings (router.peersync)
            self.sharing = LoadSharing(
                bus, self.scheduler, router_id=s.router_id, interval_s=s.peer_sync_interval_s,
                keepalive_s=s.peer_stale_s / 3, drops=self.drops,
                limits=RateLimits(s.peer_sync_rate_per_s, 2 * s.peer_sync_rate_per_s),
                count=lambda direction: self.metrics.peer_snapshots.labels(direction).inc())
            await self.sharing.start()
            self.tasks.spawn(self.sharing.run(), name="bookings-sharing")
        self.tasks.spawn(self.policy.acks.run(), name="ack-publisher")
        await self.status.put()
        self.tasks.spawn(every(s.tick_s, lambda: tick(self.scheduler), "tick"), name="tick")
        # The workers' timing fits, off the scheduler actor (router.fitting).
        self.tasks.spawn(Fitter(self.scheduler).run(), name="calibration-fits")
        self.tasks.spawn(every(s.heartbeat_s, self.status.put, "status"), name="status")
        self.tasks.spawn(self.status.run(), name="status-writer")
        self.tasks.spawn(every(s.heartbeat_s, self.policy.check_stream, "policy stream check"),
                         name="policy-stream-check")
        self.tasks.spawn(every(s.policy_lag_s, self.policy_lag, "policy lag"), name="policy-lag")
        self.tasks.spawn(every(s.tick_s, self._prewarm_tokenizers, "tokenizers"), name="tokenizers")
        self.tasks.spawn(every(s.tick_s, self.refresh_verify_keys, "verify keys"), name="verify-keys")
        # /health answers 503 until the membership replay is applied; the API serves meanwhile.
        self.tasks.spawn(self.membership.wait_complete(), name="first-discovery")
        log.info(
            "router %s serving %s on %s (mode %s, role %s, cache inputs %s, policy keys %s, request path %s)",
            s.router_id, ", ".join(s.models), s.url(), s.mode.value, s.role.value,
            ", ".join(sorted(self.cache_inputs)) or "none", ", ".join(self.verify_keys.keyring.key_ids),
            "compiled" if build.running_compiled() else "pure Python",
        )
        if stale := build.stale_modules():
            log.warning("router %s: %s", s.router_id, build.advice(stale))

    async def _answer_decisions(self, msg: Message) -> None:
        """``rudder.decisions.<router_id>``: this router's records of one request (router.decisions)."""
        try:
            query = decode_decision_query(msg.data)
        except RudderError as exc:
            self.drops.drop("decision_query", "malformed", msg.subject, exc.message)
            return
        records = [r.to_dict() for r in self.decisions.get(query.request_id)]
        reply = DecisionReply(router_id=self.settings.router_id, decisions=records[-64:])
        try:
            await msg.respond(reply.to_bytes())
        except RudderError as exc:
            log.info("decision query for %s not answered: %s", query.request_id, exc.message)

    def dumps_missed(self) -> int:
        """KV dumps asked for that did not come (``/metrics``)."""
        return self.kv.dumper.missed if self.kv is not None else 0

    def kv_backlog(self) -> int:
        """KV events received and not yet applied (``/metrics``)."""
        return self.kv.backlog if self.kv is not None else 0

    def readiness(self) -> list[str]:
        """What this router still waits for before it should get traffic; [] when ready."""
        waiting: list[str] = []
        if self.draining:
            waiting.append("draining")
        if self.bus is None or not self.bus.connected:
            waiting.append("nats")
        if self.policy is None or not self.policy.loaded.is_set():
            waiting.append("policy")
        view = self.scheduler.view
        if not view.ready:
            waiting.append("discovery")
        else:
            # A model needs a worker with a fresh heartbeat (a stale one is no candidate).
            missing = [m for m in self.settings.models if not view.live_workers.get(m)]
            if missing:
                waiting.append("workers: " + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
                stale = {m: view.workers[m] for m in missing if view.workers.get(m)}
                if stale and stale != self._logged_stale:
                    log.warning("unhealthy: no worker with a fresh heartbeat for %s (known but stale: %s); "
                                "heartbeat ages are measured on the NATS server's clock",
                                ", ".join(stale), ", ".join(f"{m}={n}" for m, n in stale.items()))
                self._logged_stale = stale
            else:
                self._logged_stale = {}
        return waiting

    async def policy_lag(self) -> None:
        """Each served document's head on the stream and how many of its revisions this router
        has not applied (``rudder_router_policy_revisions_behind``; the alert on a router behind
        the head reads it). Every ``RUDDER_POLICY_LAG_S``: one direct get per document, and one
        per missing revision."""
        assert self.bus is not None
        applied = self.scheduler.view.applied
        for model in self.settings.models:
            for kind in PolicyKind:
                subject = policy_subject(model, kind.value)
                try:
                    head = await self.bus.last(STREAM_POLICY, subject)
                    head_rev = head.seq if head is not None and head.seq is not None else 0
                    doc = applied.get(doc_key(model, kind))
                    mine = doc.revision if doc is not None else 0
                    behind, seq = 0, mine + 1
                    while head_rev > mine and seq <= head_rev:
                        msg = await self.bus.get(STREAM_POLICY, seq, subject=subject)
                        if msg is None or msg.seq is None:
                            break
                        behind, seq = behind + 1, msg.seq + 1
                except RudderError as exc:
                    log.debug("policy head of %s|%s not read: %s", model, kind.value, exc.message)
                    continue
                self.metrics.policy_head.labels(model, kind.value).set(head_rev)
                self.metrics.revision.labels(model, kind.value).set(mine)
                self.metrics.behind.labels(model, kind.value).set(behind)

    async def _prewarm_tokenizers(self) -> None:
        """Load a newly advertised tokenizer (a model folder) before requests need it."""
        for names in self.scheduler.view.tokenizers.values():
            self.tokenizers.prewarm(names)

    async def refresh_verify_keys(self) -> None:
        """Re-read the verify-keys file when it changed (rotation: a new key becomes valid, a
        retired one stops being valid); a broken file keeps the last good keyring."""
        try:
            changed = self.verify_keys.refresh()
        except KeyFileInvalid as exc:
            log.error("verify keys not reloaded, keeping %s: %s",
                      ", ".join(self.verify_keys.keyring.key_ids), exc.message)
            return
        if changed:
            await self.scheduler.call(UseVerifyKeys(self.verify_keys.keyring))
            log.info("policy verify keys reloaded: %s", ", ".join(self.verify_keys.keyring.key_ids))

    def _count(self, result: ApplyResult) -> None:
        status = "ACK" if result.outcome is Outcome.ACK else "NACK"
        self.metrics.policy_results.labels(status).inc()

    async def stop(self) -> None:
        if self._decision_sub is not None:
            with contextlib.suppress(RudderError):
                await self._decision_sub.stop()
        for part in (self.policy, self.membership, self.kv, self.manifests, self.sharing):
            if part is not None:
                await part.stop()
        if self.policy is not None:
            await self.policy.acks.flush()  # the last ACKs reach the stream before we go
        await self.tasks.close()
        await self.scheduler.stop()
        if self.status is not None:
            await self.status.delete()
        if self.bus is not None:
            # Flush what is published (the status delete, last ACKs), then close; a drain could
            # wait out its 30 s timeout on a consumer the server already forgot.
            with contextlib.suppress(RudderError):
                await self.bus.flush(1)
            await self.bus.close()
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

    app = RouterApp(title="Rudder router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = rt
    build_api(rt, app)
    return app


def asgi_app() -> FastAPI:
    """The app from the ``RUDDER_*`` environment, for another ASGI server (``granian --interface
    asgi --factory router.app:asgi_app``). ``rudder serve router`` runs uvicorn with the router's
    guarded connection protocol (ingress limits) and graceful drain, which another server does
    not get; the benchmark measures the alternative with it (docs/decisions.md 91)."""
    return create_app(RouterSettings())


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
        log_config=None,  # uvicorn's lines go through the process's one setup (controlplane.telemetry.logs)
        **uvicorn_options(app),
    )
    await DrainingServer(config, app.state.runtime, drain_delay_s=settings.drain_delay_s).serve()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the router's graceful stop (SIGTERM or SIGINT):

    1. ``/health`` turns 503 at once (``draining``), so load balancers and Kubernetes' readiness
       check stop sending new requests;
    2. after ``drain_delay_s`` the listener closes and requests and streams in flight finish,
       within ``timeout_graceful_shutdown`` (``RUDDER_SHUTDOWN_GRACE_S``);
    3. the lifespan stops (leave, last ACKs, status deleted) and the process exits with 0.

    uvicorn alone re-raises the signal once it has shut down, so a graceful stop ended with
    -15; a second signal forces the exit.
    """

    def __init__(self, config: uvicorn.Config, runtime: RouterRuntime, *, drain_delay_s: float) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.drain_delay_s = drain_delay_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self.drain, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def drain(self, sig: int) -> None:
        if self.runtime.draining:
            self.force_exit = True
            return
        self.runtime.draining = True
        log.info("router %s: %s, draining (health 503; in-flight work finishes within %ss)",
                 self.runtime.settings.router_id, signal.Signals(sig).name, self.config.timeout_graceful_shutdown)
        asyncio.get_running_loop().call_later(self.drain_delay_s, self._exit)

    def _exit(self) -> None:
        self.should_exit = True


def uvicorn_options(app: FastAPI) -> dict[str, Any]:
    """What the router's HTTP server needs beyond host and port: the guarded protocol that
    enforces the connection-level ingress limits (router/ingress.py) with ``app``'s settings,
    error mapping and metrics, and no proxy-headers middleware. Tests that serve the app
    themselves pass these too."""
    rt: RouterRuntime = app.state.runtime
    s = rt.settings
    refused = rt.metrics.rejections

    def render(exc: RudderError) -> Response:
        return error_response(exc, overload_status=s.overload_status)

    limits = IngressLimits(
        max_connections=s.max_connections, max_header_bytes=s.max_header_bytes,
        header_timeout_s=s.header_timeout_s, body_timeout_s=s.body_timeout_s,
        write_timeout_s=s.write_timeout_s, render=render,
        on_refused=lambda reason: refused.labels(reason).inc(),
    )
    # No X-Forwarded-For rewriting of the client address: nothing in the router reads it (its
    # ingress limits and logs use the socket's peer), and uvicorn's middleware for it is one
    # more layer every request and every chunk of a stream passes through. No ``server: uvicorn``
    # on every answer either: it names the server software to whoever asks, and is one more
    # header checked and written per answer (``date`` stays: RFC 9110 asks it of origin servers).
    express = Express(rt) if s.express_path else None
    return {"http": protocol_class(limits, express), "proxy_headers": False, "server_header": False}


# Allocations less deallocations of tracked objects that start a young-generation collection.
YOUNG_GC_THRESHOLD = 10_000


def run(settings: RouterSettings | None = None) -> None:
    """Blocking entry point: settings from ``RUDDER_*`` when not given."""
    settings = settings or RouterSettings()
    configure_logging(settings.log_level)
    traces.setup_tracing("rudder-router")
    # What is loaded by now (modules, pydantic schemas: most of the process's objects) lives as long
    # as the process: moved out of the collector's sight, a full collection no longer walks it. Such
    # collections come with KV-event churn (each decoded event is thousands of objects) and held the
    # event loop 200-500 ms under a KV flood on a loaded box: chats to other workers waited behind
    # them (bench/flood.py; docs/decisions.md 84).
    gc.collect()
    gc.freeze()
    # A request's objects are freed by reference counting (no reference cycles on the request
    # path: tests/integration/test_router_odd_requests.py), so the young generation's count only
    # wanders around what is in flight; at the default 700 that alone started a collection every
    # few requests under load (3-4% of the router's CPU). At this threshold they are rare, and a
    # collection walks only the live young objects (docs/decisions.md 114).
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
    asyncio.run(serve(settings))
