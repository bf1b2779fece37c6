"""The seam between the worker agent and an engine (two implementations: mock, vLLM).

The agent owns the bus (membership, KV event numbering and publishing, dumps); an engine owns
inference and its KV cache and reports what changes. An engine calls ``kv_sink`` synchronously
for every cache change, in order, from the event loop's thread, so the agent can number events
and a dump taken between two awaits is consistent with the last number given out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from controlplane.protocol.events import (
    EngineTiming,
    KvCleared,
    KvDumpRank,
    KvRemoved,
    KvStored,
    RankLoad,
)
from controlplane.protocol.policy import CacheInput

KvData = KvStored | KvRemoved | KvCleared


class KvSink(Protocol):
    """Receives one cache change of one dp rank (and storage tier), in order."""

    def __call__(self, dp_rank: int, data: KvData, tier: CacheInput = CacheInput.DEVICE) -> None:
        ...


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the membership record says about the engine (DESIGN §6)."""

    url: str
    block_size: int
    kv_total_blocks: int  # per dp rank
    max_num_batched_tokens: int
    dp_size: int
    tokenizer: str
    engine: str
    timing: EngineTiming | None = None  # the engine's own timing model (the router's prior)


class Engine(Protocol):
    async def start(self, kv_sink: KvSink) -> EngineInfo:
        """Start serving; raises RuntimeError (or OSError) when the engine cannot start."""
        ...

    async def stop(self) -> None:
        """Stop serving; in-flight requests are failed or finished, never left hanging."""
        ...

    def load(self) -> list[RankLoad]:
        """Current load of every dp rank (for heartbeats)."""
        ...

    def dump(self) -> list[KvDumpRank]:
        """Full cache state of every dp rank, parents first (for ``kvdump`` replies)."""
        ...

    @property
    def partial_view(self) -> bool:
        """True when the engine may hold blocks it never reported (attached late)."""
        ...

    def healthy(self) -> bool:
        """Whether the engine serves now. While it does not, the worker leaves and sends no
        heartbeat (worker.agent), so routers stop routing to an engine that died or hangs under a
        live agent; it joins again once the engine serves."""
        ...
