"""Prometheus metrics of one router (a registry per app, so several routers fit one process)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)

from controlplane.protocol.events import WorkerCalibration
from controlplane.telemetry.build import build_info
from router.decisions import DecisionRecord
from router.fastmetrics import Count, FastCounter, FastHistogram, Observed

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_OVERHEAD = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


@dataclass(frozen=True, slots=True)
class ModelSeries:
    """One model's labelled series of the request path, looked up once per model."""

    ttft: Observed
    itl: Observed
    overhead: Observed
    hit_rate: Observed
    selection: Observed
    predicted_cached: Count
    reported_cached: Count


class RouterMetrics:
    def __init__(self) -> None:
        self._series: dict[str, ModelSeries] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        # What every Python exporter shows, read at scrape time: the process's CPU and memory,
        # the interpreter, and the collector's passes by generation (python_gc_collections_total:
        # a request path that leaves reference cycles shows there first, docs/decisions.md 114).
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(standard)
        # The request path's series (per request, per chunk) keep plain numbers, no lock
        # (router.fastmetrics); the rest are prometheus_client's.
        self.requests = FastCounter(
            "rudder_router_requests", "Requests answered", ["model", "endpoint", "status"], registry=r
        )
        self.ttft = FastHistogram(
            "rudder_router_ttft_seconds", "Time to first token", ["model"], buckets=_LATENCY, registry=r
        )
        self.itl = FastHistogram(
            "rudder_router_itl_seconds", "Inter-token latency (between streamed chunks)", ["model"],
            buckets=_LATENCY, registry=r,
        )
        self.overhead = FastHistogram(
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
        self.hit_rate = FastHistogram(
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
        self.quarantined = Gauge(
            "rudder_router_worker_cache_quarantined",
            "Workers whose KV claims persistently exceeded the cached tokens they delivered: no cache "
            "credit (1 while quarantined)", ["model", "instance_id"], registry=r,
        )
        self.timing_quarantined = Gauge(
            "rudder_router_worker_timing_quarantined",
            "Workers whose measured TTFT persistently exceeded what their claimed timing prior "
            "predicts: the router's own prior and fit are used (1 while quarantined)",
            ["model", "instance_id"], registry=r,
        )
        self.bus_drops = Counter(
            "rudder_router_bus_dropped", "Bus messages dropped as hostile or malformed, by kind "
            "and reason", ["kind", "reason"], registry=r,
        )
        # What each worker's KV claims hold of this router's memory (refreshed at each scrape):
        # at most its capped KV blocks per rank (docs/security.md, "A stolen worker credential").
        self.index_blocks = Gauge(
            "rudder_router_prefix_index_blocks", "Blocks the prefix index holds per worker (all its ranks)",
            ["model", "instance_id"], registry=r,
        )
        # Requests this router has selected a worker for and not yet seen end (refreshed at each
        # scrape): where its load is now, between two of the workers' own reports.
        self.in_flight = Gauge(
            "rudder_router_requests_in_flight", "Requests this router has in flight on each worker",
            ["model", "instance_id"], registry=r,
        )
        self.index_refused = Counter(
            "rudder_router_prefix_index_refused_blocks",
            "Blocks claimed in KV events past the worker's capped capacity (not indexed)", registry=r,
        )
        self._refused_seen = 0
        self.kv_index_events = Counter(
            "rudder_router_kv_index_events",
            "KV events and dumps the prefix index did not take as they came, by reason: gap (an "
            "event id skipped: a dump asked for), buffer_full (an event dropped while a dump was "
            "pending), other_process (an event or dump of another process than the known one under "
            "the worker's id), dump_missed (a dump asked for that did not come)", ["reason"], registry=r,
        )
        self._kv_index_seen: dict[str, int] = {}
        self.kv_backlog = Gauge(
            "rudder_router_kv_events_backlog",
            "KV events received and not yet applied to the prefix index (refreshed at each scrape): "
            "a value that stays high means the index lags the workers' caches", registry=r,
        )
        self.calibration_expiries = Counter(
            "rudder_router_calibration_expiries",
            "Times a worker's timing observations expired because its pool moved on without it", registry=r,
        )
        self._expiries_seen = 0
        self.policy_resyncs = Counter(
            "rudder_router_policy_resyncs",
            "Re-syncs of the policy stream after its sequence went backwards (stream recreated)",
            registry=r,
        )
        self.retries = Counter(
            "rudder_router_retries", "Requests retried on another worker", ["model"], registry=r
        )
        # Requests with a TTFT objective (x-rudder-ttft-slo-ms / nvext.ttft_slo_ms), by outcome:
        # met / missed (measured at the router, received to first token) / rejected (refused).
        self.slo = Counter(
            "rudder_router_ttft_slo_requests", "Requests with a TTFT objective, by outcome",
            ["model", "outcome"], registry=r,
        )
        self.slo_met = Gauge(
            "rudder_router_ttft_slo_met_ratio", "Fraction of requests with a TTFT objective that met it",
            ["model"], registry=r,
        )
        self._slo_counts: dict[str, list[int]] = {}
        # The time cost's per-worker timing fit (router.calibration), refreshed at each scrape.
        self.calibration = Gauge(
            "rudder_router_timing_coefficient", "Fitted timing model of a worker (ms per engine step)",
            ["model", "instance_id", "coefficient"], registry=r,
        )
        self.prediction_error = Gauge(
            "rudder_router_ttft_prediction_error_ms",
            "Predicted vs measured engine TTFT of a worker's recent requests (absolute, ms)",
            ["model", "instance_id", "stat"], registry=r,
        )
        self.calibration_samples = Gauge(
            "rudder_router_calibration_samples", "Observations in a worker's timing fit window",
            ["model", "instance_id", "fit"], registry=r,
        )

        # Issue 19, the fleet view: how far this router is behind each document's head (refreshed
        # every heartbeat by the runtime), the scheduler's queue, the selection's time, what was
        # predicted cached against what the worker reported, and each worker's answers.
        self.policy_head = Gauge(
            "rudder_router_policy_head_revision", "Head revision of each policy document on the stream",
            ["model", "kind"], registry=r,
        )
        self.behind = Gauge(
            "rudder_router_policy_revisions_behind",
            "Revisions of a policy document on the stream newer than the one applied here",
            ["model", "kind"], registry=r,
        )
        self.queue_depth = Gauge(
            "rudder_router_scheduler_queue_depth", "Commands waiting in the scheduler actor's queue",
            registry=r,
        )
        self.selection = FastHistogram(
            "rudder_router_selection_seconds",
            "Selection asked of the scheduler to its answer (queue wait and scoring)", ["model"],
            buckets=_OVERHEAD, registry=r,
        )
        self.request_path = FastCounter(
            "rudder_router_request_path", "Inference requests by the path that served them (express: "
            "from the connections' callbacks; asgi: a task each, where the express path does not serve them)",
            ["path"], registry=r,
        )
        self.express_path, self.asgi_path = self.request_path.labels("express"), self.request_path.labels("asgi")
        self.predicted_cached = FastCounter(
            "rudder_router_predicted_cached_tokens", "Prompt tokens predicted cached on the chosen "
            "worker (requests whose worker reported its cached tokens)", ["model"], registry=r,
        )
        self.reported_cached = FastCounter(
            "rudder_router_reported_cached_tokens",
            "Prompt tokens the worker reported cached (usage.prompt_tokens_details.cached_tokens)",
            ["model"], registry=r,
        )
        self.worker_requests = FastCounter(
            "rudder_router_worker_requests", "Requests forwarded, by worker and answer status",
            ["model", "instance_id", "status"], registry=r,
        )
        # Decision quality, over the sampled decisions (RUDDER_DECISION_SAMPLE; router.decisions).
        self.decisions = Counter(
            "rudder_router_decisions", "Sampled selection decisions, by why the worker was chosen",
            ["model", "reason"], registry=r,
        )
        self.largest_overlap = Counter(
            "rudder_router_decisions_largest_overlap",
            "Sampled decisions that chose a worker holding the largest cached prefix", ["model"], registry=r,
        )
        self.decision_prompt = Counter(
            "rudder_router_decision_prompt_tokens", "Prompt tokens of the sampled decisions that finished",
            ["model"], registry=r,
        )
        self.reachable_cached = Counter(
            "rudder_router_decision_reachable_cached_tokens",
            "Prompt tokens cached on the best candidate of each finished sampled decision", ["model"],
            registry=r,
        )
        self.achieved_cached = Counter(
            "rudder_router_decision_achieved_cached_tokens",
            "Prompt tokens the chosen worker reported cached, finished sampled decisions", ["model"],
            registry=r,
        )
        self.ttft_error = Summary(
            "rudder_router_decision_ttft_error_seconds",
            "Predicted vs measured TTFT of the sampled decisions (absolute), per worker",
            ["model", "instance_id"], registry=r,
        )
        self.build = build_info(r, "router")

        # Router replicas sharing their bookings (router.peers): peers counted (at each scrape).
        self.peers = Gauge("rudder_router_peers", "Peer routers whose bookings are counted here", registry=r)
        self.peer_snapshots = Counter(
            "rudder_router_peer_snapshots", "Bookings snapshots sent to peers and received from them "
            "(accepted; refused ones are rudder_router_bus_dropped_total{kind=\"router_load\"})",
            ["direction"], registry=r,
        )
        # What the time cost expects back (router.returns), refreshed at each scrape.
        self.returns = Gauge(
            "rudder_router_expected_returns",
            "Requests expected back on the rank that holds their cache: open (finished, not yet "
            "seen back), delay_seconds (mean delay of a return), fraction (of finished requests "
            "that come back)", ["stat"], registry=r,
        )

    def observe_decision(self, r: DecisionRecord) -> None:
        """A sampled decision whose request finished: the decision-quality counters."""
        self.decisions.labels(r.model, r.why[0] if r.why else "").inc()
        chosen = r.chosen
        if chosen is None:  # no cost was computed (explicit target, comparison mode)
            return
        if chosen.overlap_blocks >= max(c.overlap_blocks for c in r.candidates):
            self.largest_overlap.labels(r.model).inc()
        self.decision_prompt.labels(r.model).inc(r.prompt_tokens)
        self.reachable_cached.labels(r.model).inc(max(c.cached_tokens for c in r.candidates))
        achieved = r.reported_cached_tokens if r.reported_cached_tokens is not None else chosen.cached_tokens
        self.achieved_cached.labels(r.model).inc(achieved)
        if chosen.ttft_ms is not None and r.measured_ttft_ms is not None:
            self.ttft_error.labels(r.model, str(r.instance_id)).observe(
                abs(chosen.ttft_ms - r.measured_ttft_ms) / 1e3)

    def model(self, model: str) -> ModelSeries:
        """The request path's series of ``model`` (a model this router serves)."""
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = ModelSeries(
                self.ttft.labels(model), self.itl.labels(model), self.overhead.labels(model),
                self.hit_rate.labels(model), self.selection.labels(model),
                self.predicted_cached.labels(model), self.reported_cached.labels(model))
        return series

    def answered(self, model: str, endpoint: str, status: str) -> None:
        """Count a request answered."""
        self.requests.labels(model, endpoint, status).value += 1  # (Count.inc's check: for amounts)

    def worker_answered(self, model: str, instance_id: int, status: str) -> None:
        """Count a worker's answer by worker and status (``rudder_router_worker_requests``)."""
        self.worker_requests.labels(model, str(instance_id), status).value += 1

    def set_quarantined(self, workers: Iterable[tuple[str, int]],
                        timing: Iterable[tuple[str, int]] = ()) -> None:
        """The workers whose cache claims (router.claims.CacheOutcomes) and whose timing priors
        (router.claims.TimingOutcomes) are not believed."""
        for gauge, listed in ((self.quarantined, workers), (self.timing_quarantined, timing)):
            _per_worker(gauge, ((model, wid, 1) for model, wid in listed))

    def set_index(self, held: Iterable[tuple[str, int, int]], refused: int,
                  events: Mapping[str, int] | None = None) -> None:
        """Blocks held per worker, the index's count of refused blocks, and its counts of events
        and dumps not taken as they came, by reason (each monotonic)."""
        _per_worker(self.index_blocks, held)
        self._refused_seen = _catch_up(self.index_refused, self._refused_seen, refused)
        for reason, count in (events or {}).items():
            seen = self._kv_index_seen.get(reason, 0)
            self._kv_index_seen[reason] = _catch_up(self.kv_index_events.labels(reason), seen, count)

    def set_in_flight(self, rows: Iterable[tuple[str, int, int]]) -> None:
        """Requests in flight per worker (known workers only: a departed one's series goes)."""
        _per_worker(self.in_flight, rows)

    def set_returns(self, status: Mapping[str, float]) -> None:
        self.returns.labels("open").set(status["open"])
        self.returns.labels("delay_seconds").set(status["delay_s"])
        self.returns.labels("fraction").set(status["fraction"])

    def observe_slo(self, model: str, outcome: str) -> None:
        self.slo.labels(model, outcome).inc()
        counts = self._slo_counts.setdefault(model, [0, 0])
        counts[0] += outcome == "met"
        counts[1] += 1
        self.slo_met.labels(model).set(counts[0] / counts[1])

    def set_calibration(self, workers: Iterable[WorkerCalibration], expiries: int) -> None:
        """Replace the per-worker calibration series (a worker gone drops its series); ``expiries``:
        the scheduler's count so far (router.calibration, decision 110)."""
        self._expiries_seen = _catch_up(self.calibration_expiries, self._expiries_seen, expiries)
        for gauge in (self.calibration, self.prediction_error, self.calibration_samples):
            gauge.clear()
        for w in workers:
            wid = str(w.instance_id)
            values = (*w.prefill_ms, *w.decode_ms, w.running_ms, w.decode_running_ms)
            for name, value in zip(("p0", "p1", "p2", "d0", "d1", "d2", "r", "dn"), values, strict=True):
                self.calibration.labels(w.model, wid, name).set(value)
            if w.ttft_mae_ms is not None:
                self.prediction_error.labels(w.model, wid, "mae").set(w.ttft_mae_ms)
            if w.ttft_p90_error_ms is not None:
                self.prediction_error.labels(w.model, wid, "p90").set(w.ttft_p90_error_ms)
            self.calibration_samples.labels(w.model, wid, "prefill").set(w.prefill_samples)
            self.calibration_samples.labels(w.model, wid, "decode").set(w.decode_samples)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _catch_up(counter: Counter, seen: int, value: int) -> int:
    """Advance ``counter`` to a monotonic count kept elsewhere (``seen``: what it was last told);
    returns the new ``seen``."""
    if value > seen:
        counter.inc(value - seen)
        return value
    return seen


def _per_worker(gauge: Gauge, rows: Iterable[tuple[str, int, float]]) -> None:
    """A {model, instance_id} gauge set to ``rows`` as a whole (a worker not listed loses its series)."""
    gauge.clear()
    for model, wid, value in rows:
        gauge.labels(model, str(wid)).set(value)
