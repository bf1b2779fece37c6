"""The mock engine's timing model (DESIGN §6). Pure.

Prefill time grows with the uncached tokens computed in a step, decode step time with KV usage;
every duration is divided by ``speedup_ratio`` so a laptop can simulate a busy GPU fleet fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.protocol.events import (
    DEFAULT_DECODE_MIN_MS,
    DEFAULT_DECODE_MS,
    DEFAULT_PREFILL_MS,
    EngineTiming,
)
from worker.settings import AdvertisedTiming, MockEngineSettings


@dataclass(frozen=True, slots=True)
class TimingModel:
    prefill_a: float = 4.209989e-7
    prefill_b: float = 1.518344e-2
    prefill_c: float = 16.50142
    decode_a: float = -25.74
    decode_b: float = 54.01
    decode_c: float = 5.74
    decode_min_ms: float = 1.0
    speedup_ratio: float = 1.0
    kv_transfer_base_ms: float = 2.0
    kv_transfer_ms_per_block: float = 0.05

    @classmethod
    def from_settings(cls, s: MockEngineSettings) -> TimingModel:
        return cls(
            prefill_a=s.prefill_a, prefill_b=s.prefill_b, prefill_c=s.prefill_c,
            decode_a=s.decode_a, decode_b=s.decode_b, decode_c=s.decode_c,
            decode_min_ms=s.decode_min_ms, speedup_ratio=s.speedup_ratio,
            kv_transfer_base_ms=s.kv_transfer_base_ms,
            kv_transfer_ms_per_block=s.kv_transfer_ms_per_block,
        )

    def advertised(self) -> EngineTiming:
        """This model as the membership record advertises it (per step, speed-up applied)."""
        r = self.speedup_ratio
        return EngineTiming(
            source="mock",
            prefill_ms=(self.prefill_c / r, self.prefill_b / r, self.prefill_a / r),
            decode_ms=(self.decode_c / r, self.decode_b / r, self.decode_a / r),
            decode_min_ms=self.decode_min_ms / r,
        )

    def prefill_ms(self, uncached_tokens: int) -> float:
        """Time of the prefill part of a step computing ``uncached_tokens`` (0 → 0 ms)."""
        if uncached_tokens <= 0:
            return 0.0
        n = float(uncached_tokens)
        ms = self.prefill_a * n * n + self.prefill_b * n + self.prefill_c
        return max(ms, 0.0) / self.speedup_ratio

    def decode_ms(self, kv_usage: float) -> float:
        """Time of one decode step at KV usage ``kv_usage`` (clamped to [0, 1])."""
        u = min(max(kv_usage, 0.0), 1.0)
        ms = self.decode_a * u * u + self.decode_b * u + self.decode_c
        return max(ms, self.decode_min_ms) / self.speedup_ratio

    def step_ms(self, *, uncached_tokens: int, decoding: int, kv_usage: float) -> float:
        """One engine step: the prefill chunk(s) plus, when any sequence decodes, a decode pass."""
        ms = self.prefill_ms(uncached_tokens)
        if decoding > 0:
            ms += self.decode_ms(kv_usage)
        return ms

    def kv_transfer_ms(self, blocks: int) -> float:
        """Simulated transfer of ``blocks`` KV blocks from a prefill worker (disaggregated)."""
        ms = self.kv_transfer_base_ms + self.kv_transfer_ms_per_block * max(blocks, 0)
        return ms / self.speedup_ratio


# What a vLLM worker advertises (worker/engines/vllm.py): DESIGN §6's formula, whatever the GPU.
GENERIC_TIMING = EngineTiming(source="vllm-default", prefill_ms=DEFAULT_PREFILL_MS, decode_ms=DEFAULT_DECODE_MS,
                              decode_min_ms=DEFAULT_DECODE_MIN_MS)


def advertised_timing(settings: MockEngineSettings) -> EngineTiming:
    """The timing model a mock worker's membership record advertises (``advertise_timing``)."""
    if settings.advertise_timing is AdvertisedTiming.GENERIC:
        return GENERIC_TIMING
    if settings.advertise_speedup_ratio is not None:
        settings = settings.model_copy(update={"speedup_ratio": settings.advertise_speedup_ratio})
    return TimingModel.from_settings(settings).advertised()
