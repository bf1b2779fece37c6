"""Prometheus metrics of one router (a registry per app, so several routers fit one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_OVERHEAD = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rudder_router_requests", "Requests answered", ["model", "endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "rudder_router_ttft_seconds", "Time to first token", ["model"], buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "rudder_router_itl_seconds", "Inter-token latency (between streamed chunks)", ["model"],
            buckets=_LATENCY, registry=r,
        )
        self.overhead = Histogram(
            "rudder_router_routing_overhead_seconds",
            "Request received to worker selected (tokenize, hash, queue, select)", ["model"],
            buckets=_OVERHEAD, registry=r,
        )
        # Disaggregated requests, per phase: prefill = the prefill worker's whole answer (its
        # one token), decode = the decode worker's first byte; overhead = waiting for selection.
        self.phase_ttft = Histogram(
            "rudder_router_phase_ttft_seconds",
            "Disaggregated requests: phase forwarded to its first token (prefill: whole answer)",
            ["model", "phase"], buckets=_LATENCY, registry=r,
        )
        self.phase_overhead = Histogram(
            "rudder_router_phase_routing_overhead_seconds",
            "Disaggregated requests: time to select the worker of each phase", ["model", "phase"],
            buckets=_OVERHEAD, registry=r,
        )
        self.hit_rate = Histogram(
            "rudder_router_predicted_kv_hit_rate", "Predicted prefix-cache hit rate per request",
            ["model"], buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r,
        )
        self.revision = Gauge(
            "rudder_router_applied_revision", "Applied revision per policy document",
            ["model", "kind"], registry=r,
        )
        self.rejections = Counter(
            "rudder_router_rejections", "Requests refused, by reason", ["reason"], registry=r
        )
        self.policy_results = Counter(
            "rudder_router_policy_events", "Policy events applied or refused", ["status"], registry=r
        )
        self.workers = Gauge("rudder_router_workers", "Workers in the snapshot", ["model"], registry=r)
        self.bus_drops = Counter(
            "rudder_router_bus_dropped", "Bus messages dropped as hostile or malformed, by kind "
            "and reason", ["kind", "reason"], registry=r,
        )
        self.policy_resyncs = Counter(
            "rudder_router_policy_resyncs",
            "Re-syncs of the policy stream after its sequence went backwards (stream recreated)",
            registry=r,
        )
        self.retries = Counter(
            "rudder_router_retries", "Requests retried on another worker", ["model"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
