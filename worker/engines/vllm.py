"""The vLLM engine (DESIGN §6): work in progress."""

from __future__ import annotations

from controlplane.protocol.events import KvDumpRank, RankLoad
from worker.engines.base import EngineInfo, KvSink
from worker.settings import WorkerSettings


class VllmEngine:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings

    async def start(self, kv_sink: KvSink) -> EngineInfo:
        raise RuntimeError("the vllm engine is not available yet")

    async def stop(self) -> None:
        return None

    def load(self) -> list[RankLoad]:
        return []

    def dump(self) -> list[KvDumpRank]:
        return []

    @property
    def partial_view(self) -> bool:
        return True
