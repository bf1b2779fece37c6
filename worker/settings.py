"""The worker's one settings object (``RUDDER_*`` environment variables, DESIGN §6).

Engine settings are nested: ``RUDDER_MOCK__SPEEDUP_RATIO=10``, ``RUDDER_VLLM__MODEL_PATH=/m``.
The mock engine's defaults are those of the reference simulator (Dynamo's mocker) so that fleets
compare like for like.
"""

from __future__ import annotations

import enum
import secrets
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import SettingsConfigDict

from bus.settings import BusSettings
from controlplane.protocol import limits as L
from controlplane.protocol.events import U64_MAX, WorkerRole


class EngineKind(enum.StrEnum):
    MOCK = "mock"
    VLLM = "vllm"


class AdvertisedTiming(enum.StrEnum):
    """What timing model a mock worker advertises as the router's prior: its own (``true``: its
    formula, speed-up applied), or the generic prior a vLLM worker advertises (``generic``), so
    the router must learn the worker's speed from what it observes (a heterogeneous pool)."""

    TRUE = "true"
    GENERIC = "generic"


def random_instance_id() -> int:
    """A random nonzero u64 (DESIGN §6)."""
    return secrets.randbelow(U64_MAX) + 1


class MockEngineSettings(BaseModel):
    """The simulated engine: KV pool, scheduler budgets and timing model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Bounded as routers bound them (controlplane.protocol.limits): a worker refuses at start-up
    # what every router would refuse in its membership record.
    num_blocks: int = Field(default=16384, gt=0, le=L.MAX_KV_TOTAL_BLOCKS)
    block_size: int = Field(default=64, gt=0, le=L.MAX_BLOCK_SIZE)
    max_num_seqs: int = Field(default=256, gt=0)
    max_num_batched_tokens: int = Field(default=8192, gt=0, le=L.MAX_BATCHED_TOKENS)
    # prefill ms = a·N² + b·N + c for N uncached tokens in the batch
    prefill_a: float = 4.209989e-7
    prefill_b: float = 1.518344e-2
    prefill_c: float = 16.50142
    # decode step ms = a·u² + b·u + c at KV usage u ∈ [0, 1], at least decode_min_ms
    decode_a: float = -25.74
    decode_b: float = 54.01
    decode_c: float = 5.74
    decode_min_ms: float = Field(default=1.0, ge=0)
    speedup_ratio: float = Field(default=1.0, gt=0)
    advertise_timing: AdvertisedTiming = AdvertisedTiming.TRUE  # RUDDER_MOCK__ADVERTISE_TIMING
    # Advertise its own formula at this speed-up ratio instead of its real one: a worker claiming
    # to be faster than it is (tests of router.claims.TimingOutcomes). RUDDER_MOCK__ADVERTISE_SPEEDUP_RATIO
    advertise_speedup_ratio: float | None = Field(default=None, gt=0)
    # Disaggregated decode: KV transfer of the prompt's uncached blocks from the prefill worker.
    kv_transfer_base_ms: float = Field(default=2.0, ge=0)
    kv_transfer_ms_per_block: float = Field(default=0.05, ge=0)
    default_max_tokens: int = Field(default=16, gt=0)
    max_model_len: int = Field(default=131072, gt=0)
    # "" = rudder-bytes (one token per UTF-8 byte); a local model folder = its Hugging Face
    # tokenizer, the one the router loads for it (worker/engines/mock/tokenizer.py).
    tokenizer: str = ""


class VllmEngineSettings(BaseModel):
    """A real vLLM OpenAI server, started by the worker or attached to (``attach_url``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path | None = None
    vllm_python: str = "python"
    attach_url: str | None = None  # attach to a running server instead of starting one
    served_model_name: str | None = None  # defaults to the worker's model
    block_size: int = Field(default=32, gt=0, le=L.MAX_BLOCK_SIZE)
    max_num_batched_tokens: int = Field(default=2048, gt=0, le=L.MAX_BATCHED_TOKENS)
    max_num_seqs: int = Field(default=64, gt=0)
    max_model_len: int = Field(default=512, gt=0)
    kv_events_endpoint: str = ""  # default: tcp://127.0.0.1:<free port>
    kv_replay_endpoint: str = ""
    kv_topic: str = "kv"
    enforce_eager: bool = True
    extra_args: list[str] = Field(default_factory=list)
    startup_timeout_s: float = Field(default=300.0, gt=0)
    metrics_interval_s: float = Field(default=1.0, gt=0)
    cpu_kvcache_space_gib: int = Field(default=1, gt=0)


class WorkerSettings(BusSettings):
    """Everything one worker process needs. A missing or bad value stops start-up naming it."""

    model_config = SettingsConfigDict(
        env_prefix="RUDDER_", env_nested_delimiter="__", extra="ignore"
    )

    nats_connect_timeout_s: float = Field(default=10.0, gt=0)
    model: str = Field(min_length=1)
    engine: EngineKind = EngineKind.MOCK
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)  # 0 = pick a free one; the real one is advertised
    advertise_host: str | None = None  # host in the advertised URL when binding 0.0.0.0
    role: WorkerRole = WorkerRole.AGGREGATED
    dp_size: int = Field(default=1, ge=1, le=64)
    instance_id: int = Field(default_factory=random_instance_id, gt=0, le=U64_MAX)
    heartbeat_s: float = Field(default=1.0, gt=0)
    worker_ttl_s: float = Field(default=10.0, gt=0)
    log_level: str = "INFO"
    mock: MockEngineSettings = Field(default_factory=MockEngineSettings)
    vllm: VllmEngineSettings = Field(default_factory=VllmEngineSettings)

    @field_validator("instance_id", mode="before")
    @classmethod
    def _zero_means_random(cls, value: object) -> object:
        # An empty or zero id from the environment means "pick one", like an unset one.
        if value in (None, "", 0, "0"):
            return random_instance_id()
        return value
