"""The router's one settings object (``RUDDER_*`` environment variables, DESIGN §5).

Startup overrides of policy parameters come as JSON objects (``RUDDER_SELECTION='{"router_temperature": 0.5}'``,
``RUDDER_BUSY_THRESHOLDS='{"active_prefill_tokens_threshold": 8192}'``) and are validated with the
same specs as policy documents, so a bad value stops start-up naming the field.
"""

from __future__ import annotations

import enum
import functools
import secrets
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from bus.keyfiles import load_keyring
from bus.settings import BusSettings
from controlplane.protocol.errors import KeyFileInvalid, ValidationFailed
from controlplane.protocol.events import RouterRole
from controlplane.protocol.guard import DEFAULT_WORKER_URL_ALLOW, UrlAllowList
from controlplane.protocol.policy import (
    ALL_CACHE_INPUTS,
    CacheInput,
    Number,
    PolicyKind,
    validate_value,
)
from router.claims import ClaimCaps


class RoutingMode(enum.StrEnum):
    """``kv`` is KV-aware routing with the default cost (:data:`DEFAULT_KV_COST`); ``kv-blocks``
    and ``kv-time`` name a cost explicitly (DESIGN §5's block cost; router.cost.time's predicted time).
    The others are load-only comparison modes."""

    KV = "kv"
    KV_BLOCKS = "kv-blocks"
    KV_TIME = "kv-time"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"

    @property
    def kv_aware(self) -> bool:
        return self in (RoutingMode.KV, RoutingMode.KV_BLOCKS, RoutingMode.KV_TIME)

    @property
    def cost(self) -> RoutingMode | None:
        """The cost a KV-aware mode scores with (``kv`` resolved); None for load-only modes."""
        if self is RoutingMode.KV:
            return DEFAULT_KV_COST
        return self if self.kv_aware else None


# What plain ``kv`` means: the predicted-time cost, which beat the block cost at startup values on
# every scenario of bench/routing_quality.py (docs/benchmarks.md, "Predicted-time cost").
DEFAULT_KV_COST = RoutingMode.KV_TIME


def new_router_id() -> str:
    """``r-`` + 12 hex digits: NATS-token and KV-key safe, stable for the life of the process."""
    return f"r-{secrets.token_hex(6)}"


class RouterSettings(BusSettings):
    model_config = SettingsConfigDict(env_prefix="RUDDER_", extra="ignore")

    models: list[str] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # Address other processes use to reach this router (reported in RUDDER_ROUTERS); "" = derived.
    public_url: str = ""
    mode: RoutingMode = RoutingMode.KV
    kv_events: bool = True
    role: RouterRole = RouterRole.AGGREGATED
    router_id: str = Field(default_factory=new_router_id, pattern=r"^[A-Za-z0-9_-]{1,64}$")

    worker_ttl_s: float = Field(default=10.0, gt=0)
    # A worker whose last heartbeat is older than this is *stale*: not a candidate, a pin to it is
    # 503; it is *gone* after worker_ttl_s.
    worker_stale_s: float = Field(default=3.0, gt=0)
    heartbeat_s: float = Field(default=1.0, gt=0)
    tick_s: float = Field(default=0.2, gt=0)
    overload_status: int = 529

    selection: dict[str, float] = Field(default_factory=dict)
    busy_thresholds: dict[str, float] = Field(default_factory=dict)

    approx_ttl_s: float = Field(default=120.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    # On SIGTERM, in-flight streams get this long to finish before their connections are closed.
    shutdown_grace_s: int = Field(default=30, gt=0)
    # On SIGTERM /health turns 503 this long before the listener closes (load balancers notice).
    drain_delay_s: float = Field(default=0.5, ge=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    kvdump_timeout_s: float = Field(default=2.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    log_level: str = "INFO"
    # Public keys that may sign policy events (DESIGN §9), "<key id> <base64>" per line. Required:
    # a router without it does not start. Re-read on every tick when the file changes (rotation).
    policy_verify_keys: Path | None = Field(default=None, validate_default=True)

    @field_validator("policy_verify_keys")
    @classmethod
    def _verify_keys(cls, value: Path | None) -> Path:
        if value is None:
            raise ValueError("required: the path of the file of public keys that may sign policy events "
                             "(RUDDER_POLICY_VERIFY_KEYS; `rudder keys new` makes one)")
        try:
            load_keyring(value)
        except KeyFileInvalid as exc:
            raise ValueError(exc.message) from exc
        return value

    # Hosts and networks worker URLs must match (comma-separated CIDRs and host names, "*.suffix"
    # for every name below a suffix); a worker announcing another URL never receives traffic.
    worker_url_allow: str = DEFAULT_WORKER_URL_ALLOW

    @field_validator("worker_url_allow")
    @classmethod
    def _url_allow(cls, value: str) -> str:
        try:
            UrlAllowList.parse(value)
        except ValidationFailed as exc:
            raise ValueError(exc.message) from exc
        return value

    @property
    def url_allow_list(self) -> UrlAllowList:
        return UrlAllowList.parse(self.worker_url_allow)

    # Ingress limits (docs/router.md, "Ingress limits"): what one client can hold of a router.
    # A request body is read up to this size and refused with 413 past it (never buffered whole).
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # A worker's answer the router reads whole (not streamed, an error, a disaggregated prefill's)
    # is held in memory up to this size; past it the request fails (503) and the worker's
    # connection is closed. A streamed answer is relayed as it comes and never held whole.
    max_answer_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # Request line and headers, in bytes (431 past it) and in time from the first byte (or the
    # connection's opening) to the end of the headers (408, then the connection is closed).
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    header_timeout_s: float = Field(default=10.0, gt=0)
    # The whole body must arrive within this long after the headers (408).
    body_timeout_s: float = Field(default=30.0, gt=0)
    # A client whose connection accepts no bytes for this long while the router has output for
    # it (it stopped reading) is disconnected: its stream is closed and its booking freed.
    write_timeout_s: float = Field(default=30.0, gt=0)
    # Open client connections; past it a new connection is answered 503 and closed.
    max_connections: int = Field(default=1024, ge=1)
    # Selections waiting in the scheduler queue; past it a request is answered with the
    # overload status (code queue_full) at once.
    max_queued_selections: int = Field(default=1024, ge=1)
    # "Why did this request go there?" (router/decisions.py): the fraction of selections whose
    # decision is recorded (every candidate's cost terms), and how many records are kept.
    decision_sample: float = Field(default=0.01, ge=0.0, le=1.0)
    decision_records: int = Field(default=1024, ge=1)
    # How often the router reads each served document's head for its lag metric
    # (rudder_router_policy_revisions_behind): one direct get per document each time.
    policy_lag_s: float = Field(default=5.0, gt=0)
    # Bodies at least this large are tokenized and hashed in a thread, off the event loop;
    # smaller ones inline, where a thread hop would cost more than the work (docs/router.md).
    offload_min_bytes: int = Field(default=16 * 1024, ge=0)

    # What a worker's own word is believed up to without an issued capacity (router/claims.py,
    # docs/security.md "A stolen worker credential"): its ranks, its KV blocks (and so what the
    # prefix index holds of it), how much faster or slower than the router's own prior its
    # advertised timing prior may be.
    claim_max_dp_size: int = Field(default=8, ge=1, le=1024)
    claim_max_kv_blocks: int = Field(default=262_144, ge=1)
    claim_max_prior_speedup: float = Field(default=256.0, ge=1.0)
    # A claimed timing prior is taken away when the measured TTFT persistently exceeds this many
    # times its prediction plus this slack per request (router.claims.TimingOutcomes).
    claim_timing_max_ratio: float = Field(default=4.0, ge=1.0)
    claim_timing_slack_ms: float = Field(default=20.0, ge=0.0)
    # Per worker (per subject): membership messages and KV event bytes past these rates are dropped at
    # the edge (counted as rudder_router_bus_dropped_total{reason="rate_limited"}); a worker's
    # full KV dump is asked for at most once per kvdump_min_interval_s.
    membership_rate_per_s: float = Field(default=20.0, gt=0)
    membership_burst: int = Field(default=100, ge=1)
    # KV events are limited by their bytes (about 70 a block with real 64-bit hashes): 512 KiB/s is
    # ~7.5k blocks/s sustained, and a 1 MiB burst (one largest NATS message) ~15k at once. What is
    # let through is decoded on the event loop that also selects workers (~0.1-0.2 ms a KiB): with
    # 1 MiB/s and a 4 MiB burst a flooding worker took the most of that loop (bench/flood.py,
    # docs/decisions.md 82); raise these for workers that store and evict more.
    kv_event_bytes_per_s: float = Field(default=512 * 1024, gt=0)
    kv_event_burst_bytes: int = Field(default=1024 * 1024, ge=1024 * 1024)
    kvdump_min_interval_s: float = Field(default=1.0, ge=0)

    # Router replicas share their bookings (router.peers, router.peersync): each publishes what it
    # booked per worker rank at most every peer_sync_interval_s (only when it changed; at least
    # every peer_stale_s / 3 while it has bookings) and counts its peers' until their last
    # snapshot is peer_stale_s old. Off: each replica counts only its own and the load reports.
    peer_sync: bool = True
    peer_sync_interval_s: float = Field(default=0.025, gt=0, le=1.0)
    peer_stale_s: float = Field(default=1.5, gt=0)
    # Snapshots a peer may send per second (burst: twice that); past it they are dropped.
    peer_sync_rate_per_s: float = Field(default=100.0, gt=0)

    # Client credential headers (Authorization, Cookie, X-Api-Key, Api-Key) are never relayed to a
    # worker unless named here (comma-separated, e.g. "authorization"); Proxy-Authorization never is.
    forward_credential_headers: str = ""
    # Response headers naming the worker, its rank, the policy revisions and the predicted cached
    # tokens / TTFT (x-worker-instance-id, x-rudder-predicted-cached-tokens, ...): a debugging aid
    # and a cache oracle for any client, so off by default.
    debug_headers: bool = False
    # The express path (router.express; docs/decisions.md 128): the common inference request served
    # from the connections' callbacks, no task or ASGI. Off: every request takes the ASGI path
    # (what a benchmark compares it with; a fallback for an operator who suspects it).
    express_path: bool = True

    @functools.cached_property
    def credential_headers_allowed(self) -> frozenset[str]:  # read on every request
        return frozenset(h.strip().lower() for h in self.forward_credential_headers.split(",") if h.strip())

    @property
    def claim_caps(self) -> ClaimCaps:
        return ClaimCaps(max_dp_size=self.claim_max_dp_size, max_kv_blocks=self.claim_max_kv_blocks,
                         max_prior_speedup=self.claim_max_prior_speedup,
                         timing_max_ratio=self.claim_timing_max_ratio, timing_slack_ms=self.claim_timing_slack_ms)

    @field_validator("overload_status")
    @classmethod
    def _overload(cls, value: int) -> int:
        if value not in (503, 529):
            raise ValueError("overload_status must be 529 or 503")
        return value

    @field_validator("selection")
    @classmethod
    def _selection(cls, value: dict[str, float]) -> dict[str, float]:
        for name, v in value.items():
            validate_value(PolicyKind.SELECTION, name, v, prefix="selection")
        return value

    @field_validator("busy_thresholds")
    @classmethod
    def _thresholds(cls, value: dict[str, float]) -> dict[str, float]:
        for name, v in value.items():
            validate_value(PolicyKind.BUSY_THRESHOLD, name, v, prefix="busy_thresholds")
        return value

    @model_validator(mode="after")
    def _models(self) -> RouterSettings:
        if not self.models:
            raise ValueError("models: at least one model must be served (RUDDER_MODELS='[\"m\"]')")
        if self.worker_stale_s >= self.worker_ttl_s:
            self.worker_stale_s = self.worker_ttl_s / 2
        if self.peer_sync and self.peer_sync_interval_s * 3 > self.peer_stale_s:
            raise ValueError(f"peer_stale_s ({self.peer_stale_s}) must be at least 3 x peer_sync_interval_s "
                             f"({self.peer_sync_interval_s}): a peer re-sends every peer_stale_s / 3")
        return self

    @property
    def cache_inputs(self) -> frozenset[CacheInput]:
        """What this router can feed to cache-scoring weights (DESIGN §3.1)."""
        if not self.mode.kv_aware or self.role is RouterRole.DECODE:
            return frozenset()
        if not self.kv_events:
            return frozenset({CacheInput.DEVICE})
        return ALL_CACHE_INPUTS

    def startup_overrides(self, kind: PolicyKind) -> dict[str, Number]:
        raw = self.selection if kind is PolicyKind.SELECTION else self.busy_thresholds
        return {
            name: validate_value(kind, name, value, prefix=kind.value) for name, value in raw.items()
        }

    def url(self) -> str:
        if self.public_url:
            return self.public_url
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"
