"""Busy thresholds (DESIGN §3.2). Pure.

A dp rank is busy if any set threshold is exceeded (strictly: a threshold of 0 makes a rank with
any load busy, and an idle rank is never busy); a worker is busy when all its ranks are.
``kv_total_blocks`` of a membership record is per rank (each dp rank has its own KV pool).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.protocol.policy import Number


@dataclass(frozen=True, slots=True)
class Thresholds:
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None

    @classmethod
    def from_values(cls, values: Mapping[str, Number | None]) -> Thresholds:
        tokens = values.get("active_prefill_tokens_threshold")
        blocks = values.get("active_decode_blocks_threshold")
        frac = values.get("active_prefill_tokens_threshold_frac")
        return cls(
            None if blocks is None else float(blocks),
            None if tokens is None else int(tokens),
            None if frac is None else float(frac),
        )

    @property
    def enabled(self) -> bool:
        return (
            self.active_decode_blocks_threshold is not None
            or self.active_prefill_tokens_threshold is not None
            or self.active_prefill_tokens_threshold_frac is not None
        )


def rank_busy(
    th: Thresholds, *, active_decode_blocks: int, active_prefill_tokens: int, kv_total_blocks: int,
    max_num_batched_tokens: int,
) -> bool:
    if th.active_decode_blocks_threshold is not None and kv_total_blocks > 0:
        if active_decode_blocks / kv_total_blocks > th.active_decode_blocks_threshold:
            return True
    if th.active_prefill_tokens_threshold is not None:
        if active_prefill_tokens > th.active_prefill_tokens_threshold:
            return True
    if th.active_prefill_tokens_threshold_frac is not None:
        if active_prefill_tokens > th.active_prefill_tokens_threshold_frac * max_num_batched_tokens:
            return True
    return False
