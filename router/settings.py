"""The router's one settings object (``RUDDER_*`` environment variables, DESIGN §5).

Startup overrides of policy parameters come as JSON objects (``RUDDER_SELECTION='{"router_temperature": 0.5}'``,
``RUDDER_BUSY_THRESHOLDS='{"active_prefill_tokens_threshold": 8192}'``) and are validated with the
same specs as policy documents, so a bad value stops start-up naming the field.
"""

from __future__ import annotations

import enum
import secrets

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.protocol.events import RouterRole
from controlplane.protocol.policy import (
    ALL_CACHE_INPUTS,
    CacheInput,
    Number,
    PolicyKind,
    validate_value,
)


class RoutingMode(enum.StrEnum):
    """``kv`` is KV-aware routing with the default cost (:data:`DEFAULT_KV_COST`); ``kv-blocks``
    and ``kv-time`` name a cost explicitly (DESIGN §5's block cost; router.cost's predicted time).
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


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RUDDER_", extra="ignore")

    nats_url: str = "nats://127.0.0.1:4222"
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
    history_depth: int = Field(default=64, ge=2)
    stream_replicas: int = Field(default=1, ge=1, le=5)

    selection: dict[str, float] = Field(default_factory=dict)
    busy_thresholds: dict[str, float] = Field(default_factory=dict)

    approx_ttl_s: float = Field(default=120.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    # On SIGTERM, in-flight streams get this long to finish before their connections are closed.
    shutdown_grace_s: int = Field(default=30, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    kvdump_timeout_s: float = Field(default=2.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    log_level: str = "INFO"

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
