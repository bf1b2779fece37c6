"""Load of a vLLM server from its Prometheus ``/metrics`` text. Pure.

Read: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(``vllm:gpu_cache_usage_perc`` on older versions), ``vllm:prefix_cache_queries_total`` /
``_hits_total`` (tokens), and ``vllm:cache_config_info`` (labels ``block_size``,
``num_gpu_blocks``). Samples are grouped by the ``engine`` label (one per dp rank).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class RankMetrics:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


@dataclass(slots=True)
class VllmMetrics:
    ranks: dict[int, RankMetrics] = field(default_factory=dict)
    block_size: int | None = None
    num_blocks: int | None = None

    def rank(self, r: int) -> RankMetrics:
        return self.ranks.setdefault(r, RankMetrics())


def parse_metrics(text: str) -> VllmMetrics:
    out = VllmMetrics()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m.group("name")
        if not name.startswith("vllm:"):
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        try:
            rank = int(labels.get("engine", "0"))
        except ValueError:
            rank = 0
        if name == "vllm:num_requests_running":
            out.rank(rank).running = int(value)
        elif name == "vllm:num_requests_waiting":
            out.rank(rank).waiting = int(value)
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            out.rank(rank).kv_usage = value
        elif name == "vllm:prefix_cache_queries_total":
            out.rank(rank).prefix_queries = value
        elif name == "vllm:prefix_cache_hits_total":
            out.rank(rank).prefix_hits = value
        elif name == "vllm:cache_config_info":
            if labels.get("block_size", "").isdigit():
                out.block_size = int(labels["block_size"])
            blocks = labels.get("num_gpu_blocks", "")
            if blocks.isdigit() and int(blocks) > 0:
                out.num_blocks = int(blocks)
    return out
