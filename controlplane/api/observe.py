"""What the admin API tells about itself: a request id on every request, request counts and
latency by route, write decisions, and the collectors read at scrape time (``GET /metrics``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.protocol.errors import RudderError
from controlplane.reconcile import ReconcileReport
from controlplane.telemetry import logs, traces
from controlplane.telemetry.build import build_info

T = TypeVar("T")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("rudder_admin_requests", "Admin API requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("rudder_admin_request_seconds", "Admin API latency", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.writes = Counter("rudder_policy_writes", "Policy write decisions", ["decision", "code"],
                              registry=self.registry)
        # From the reconciler's last report (it runs every reconcile_interval_s).
        self.reconcile_problems = Gauge("rudder_reconcile_problems",
                                        "Findings of the last stream/audit reconciliation, by kind",
                                        ["kind"], registry=self.registry)
        self.reconcile_last_run = Gauge("rudder_reconcile_last_run_timestamp_seconds",
                                        "When the last reconciliation finished (0 = not yet)",
                                        registry=self.registry)

        # Issue 19, the fleet view: each document's head and how many live routers applied it
        # (set at scrape time), the audit store's append time by outcome, the reconciler's verdict.
        self.head_revision = Gauge("rudder_policy_head_revision", "Head revision of each policy document",
                                   ["model", "kind"], registry=self.registry)
        self.routers = Gauge("rudder_policy_routers",
                             "Live routers serving a document, by state: in_sync (applied the head), "
                             "behind, nack (refused the head)", ["model", "kind", "state"],
                             registry=self.registry)
        self.audit_append = Histogram("rudder_audit_append_seconds",
                                      "Audit log appends, by outcome (ok, error)", ["outcome"],
                                      registry=self.registry,
                                      buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                               0.25, 0.5, 1, 2.5))
        self.reconcile_clean = Gauge("rudder_reconcile_clean",
                                     "1 when the last reconciliation found nothing, 0 when it found a "
                                     "problem, -1 before the first", registry=self.registry)
        self.reconcile_clean.set(-1)
        self.build = build_info(self.registry, "controlplane")
        # Children of the per-request series, looked up once per label set (``labels()`` takes a
        # lock and builds a key on every call); the label sets are few (routes, statuses, codes).
        self._children: dict[tuple[object, ...], Any] = {}

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.child(self.requests, method, route, str(status)).inc()
        self.child(self.latency, method, route).observe(seconds)

    def observe_audit_append(self, seconds: float, ok: bool) -> None:
        self.child(self.audit_append, "ok" if ok else "error").observe(seconds)

    def observe_documents(self, documents: list[dict[str, Any]]) -> None:
        """Heads and router states from the read side's document listing (controlplane.queries)."""
        for doc in documents:
            model, kind = doc["model"], doc["kind"]
            self.head_revision.labels(model, kind).set(doc["revision"])
            counts = {"in_sync": 0, "behind": 0, "nack": 0}
            for r in doc["routers"]:
                if r["in_sync"]:
                    counts["in_sync"] += 1
                elif r["last_nack_revision"] == doc["revision"]:
                    counts["nack"] += 1
                else:
                    counts["behind"] += 1
            for state, n in counts.items():
                self.routers.labels(model, kind, state).set(n)

    async def decision(self, write: Awaitable[T]) -> T:
        """Await a write and count its decision (``rudder_policy_writes``): rejected with the
        error's code, or accepted."""
        try:
            result = await write
        except RudderError as exc:
            self.child(self.writes, "rejected", exc.code).inc()
            raise
        self.child(self.writes, "accepted", "ok").inc()
        return result

    def observe_reconcile(self, report: ReconcileReport | None, at: datetime | None) -> None:
        if report is None or at is None:
            return
        problems = report.problems()
        for kind, count in problems.items():
            self.reconcile_problems.labels(kind).set(count)
        self.reconcile_clean.set(0 if any(problems.values()) else 1)
        self.reconcile_last_run.set(at.timestamp())


class BusDropsCollector(Collector):
    """``rudder_controlplane_bus_dropped_total{kind, reason}``: bus messages the fleet view dropped
    as hostile or malformed (read at scrape time from the running fleet view's counts)."""

    def __init__(self, totals: Callable[[], dict[tuple[str, str], int]]) -> None:
        self.totals = totals

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "rudder_controlplane_bus_dropped", "Bus messages dropped as hostile or malformed",
            labels=["kind", "reason"],
        )
        for (kind, reason), n in sorted(self.totals().items()):
            family.add_metric([kind, reason], n)
        yield family


class BehindReadsCollector(Collector):
    """``rudder_controlplane_behind_reads_total``: direct reads of the policy stream that a replica
    answered behind the stream, then read again from its leader (docs/decisions.md 89): how
    often, and how far, the NATS cluster's followers lag (read at scrape time)."""

    def __init__(self, total: Callable[[], int]) -> None:
        self.total = total

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "rudder_controlplane_behind_reads", "Stream reads a replica answered behind, read again from the leader")
        family.add_metric([], self.total())
        yield family


class ObserveMiddleware:
    """Plain ASGI: a request id for every request (``X-Request-Id`` in, or a new one), echoed in
    the response, plus request counts and latency by route. (Starlette's ``BaseHTTPMiddleware``
    costs a task and two memory streams per request; this costs a closure.)"""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope.get("headers", []):
            if name == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
                break
        request_id = request_id or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        logs.bind(request_id=request_id)  # this request's task only
        start = time.perf_counter()
        status = 500
        span = token = None
        if traces.enabled():
            carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])
                       if k in (b"traceparent", b"tracestate")}
            span, token = traces.server_span(f"admin {scope['method']}", carrier, **{
                "http.request.method": scope["method"], "url.path": scope.get("path", ""),
                "rudder.request_id": request_id})

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["X-Request-Id"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.observe_request(scope["method"], path, status, time.perf_counter() - start)
            if span is not None:
                span.update_name(f"admin {scope['method']} {path}")
                span.set_attribute("http.route", path)
                span.set_attribute("http.response.status_code", status)
                span.end()
                traces.detach(token)
