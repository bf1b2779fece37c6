"""vLLM KV events → canonical events, from synthetic msgpack frames; metrics; command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from controlplane.protocol.events import KvCleared, KvRemoved, KvStored
from controlplane.protocol.hashing import block_hashes
from controlplane.protocol.policy import CacheInput
from worker.engines.vllm import parse_replay_reply, rank_endpoint, vllm_binds, vllm_command
from worker.engines.vllm_events import (
    BadFrame,
    SeqStatus,
    VllmKvTranslator,
    decode_frames,
    event_fields,
)
from worker.engines.vllm_metrics import parse_metrics
from worker.settings import VllmEngineSettings, WorkerSettings

BS = 4


def frames(seq: int, events: list[Any], rank: int | None = 0, topic: bytes = b"kv") -> list[bytes]:
    payload = msgpack.packb([1700000000.5, events, rank])
    return [topic, seq.to_bytes(8, "big"), payload]


def stored_map(hashes: list[Any], parent: Any, tokens: list[int], medium: str | None = "GPU",
               lora: int | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": lora, "medium": medium}


def stored_array(hashes: list[Any], parent: Any, tokens: list[int]) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU"]


def apply(tr: VllmKvTranslator, seq: int, events: list[Any], rank: int = 0) -> list[Any]:
    batch = decode_frames(frames(seq, events, rank))
    assert tr.classify(batch.seq, batch.dp_rank) is SeqStatus.NEXT
    return tr.apply(batch)


TOKENS = list(range(100, 112))  # 3 blocks of 4
CANON = block_hashes(TOKENS, BS)


def test_stored_is_rehashed_and_parents_are_translated() -> None:
    tr = VllmKvTranslator(block_size=BS)
    out = apply(tr, 0, [stored_map([11, 12], None, TOKENS[:8])])
    assert len(out) == 1
    rank, data, tier = out[0]
    assert rank == 0 and tier is CacheInput.DEVICE and isinstance(data, KvStored)
    assert data.parent_hash is None
    assert [(b.block_hash, b.tokens_hash) for b in data.blocks] == CANON[:2]
    # The child names its parent by vLLM's hash; the translation uses the canonical one.
    out = apply(tr, 1, [stored_array([13], 12, TOKENS[8:])])
    data = out[0][1]
    assert isinstance(data, KvStored) and data.parent_hash == CANON[1][0]
    assert [b.block_hash for b in data.blocks] == [CANON[2][0]]
    assert tr.dump()[0] == [(None, CANON[0][0], CANON[0][1]),
                            (CANON[0][0], CANON[1][0], CANON[1][1]),
                            (CANON[1][0], CANON[2][0], CANON[2][1])]


def test_removed_and_cleared_are_translated_per_rank() -> None:
    tr = VllmKvTranslator(block_size=BS)
    apply(tr, 0, [stored_map([b"\x01" * 32, b"\x02" * 32], None, TOKENS[:8])], rank=1)
    out = apply(tr, 1, [{"type": "BlockRemoved", "block_hashes": [b"\x02" * 32, b"zz"],
                         "medium": "GPU"}], rank=1)
    assert out == [(1, KvRemoved(block_hashes=[CANON[1][0]]), CacheInput.DEVICE)]
    out = apply(tr, 2, [["AllBlocksCleared"]], rank=1)
    assert out == [(1, KvCleared(), CacheInput.DEVICE)]
    assert tr.dump() == {1: []}


def test_repeated_store_is_idempotent_and_unknown_types_are_skipped() -> None:
    tr = VllmKvTranslator(block_size=BS)
    apply(tr, 0, [stored_map([11, 12], None, TOKENS[:8])])
    out = apply(tr, 1, [
        {"type": "SomethingNew", "x": 1},
        ["AnotherNewEvent", 1, 2],
        stored_map([11, 12, 13], None, TOKENS),
    ])
    assert len(out) == 1
    data = out[0][1]
    assert isinstance(data, KvStored) and data.parent_hash == CANON[1][0]
    assert [b.block_hash for b in data.blocks] == [CANON[2][0]]
    assert tr.unknown_types == {"SomethingNew", "AnotherNewEvent"}


def test_unknown_parent_and_lora_blocks_are_not_reported() -> None:
    tr = VllmKvTranslator(block_size=BS)
    assert apply(tr, 0, [stored_map([21], 999, TOKENS[:4])]) == []
    assert tr.partial
    assert apply(tr, 1, [stored_map([22], None, TOKENS[:4], lora=3)]) == []


def test_host_tier_is_tracked_separately() -> None:
    tr = VllmKvTranslator(block_size=BS)
    apply(tr, 0, [stored_map([11], None, TOKENS[:4])])
    out = apply(tr, 1, [stored_map([11], None, TOKENS[:4], medium="CPU")])
    assert out[0][2] is CacheInput.HOST
    out = apply(tr, 2, [{"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}])
    assert out == [(0, KvRemoved(block_hashes=[CANON[0][0]]), CacheInput.DEVICE)]
    assert tr.dump(CacheInput.HOST)[0] == [(None, CANON[0][0], CANON[0][1])]
    assert tr.dump(CacheInput.DEVICE)[0] == []


def test_sequence_numbers_gap_restart_and_replayed_duplicates() -> None:
    tr = VllmKvTranslator(block_size=BS)
    apply(tr, 0, [stored_map([11], None, TOKENS[:4])])
    assert tr.classify(1) is SeqStatus.NEXT
    assert tr.classify(3) is SeqStatus.GAP
    assert tr.classify(0, replaying=True) is SeqStatus.OLD
    assert tr.classify(0) is SeqStatus.RESTART
    assert tr.restart() == [(0, KvCleared(), CacheInput.DEVICE)]
    assert tr.last_seq is None and tr.dump() == {0: []}
    tr.give_up_gap(7)
    assert tr.partial and tr.classify(7) is SeqStatus.NEXT


def test_bad_frames_are_rejected_with_bad_frame() -> None:
    with pytest.raises(BadFrame, match="not msgpack"):
        decode_frames([b"kv", b"\x00" * 8, b"\xc1"])
    with pytest.raises(BadFrame, match="8 bytes"):
        decode_frames([b"kv", b"\x00", b""])
    with pytest.raises(BadFrame, match="frames"):
        decode_frames([b"a", b"b", b"c", b"d"])
    batch = decode_frames(frames(5, [], rank=None))
    assert batch.seq == 5 and batch.dp_rank == 0 and batch.events == []
    assert event_fields(42) is None


def test_metrics_are_parsed_per_engine() -> None:
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 320.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",num_gpu_blocks="2048"} 1.0
other_metric 7
"""
    m = parse_metrics(text)
    assert m.block_size == 32 and m.num_blocks == 2048
    assert (m.ranks[0].running, m.ranks[0].waiting, m.ranks[0].kv_usage) == (3, 1, 0.25)
    assert m.ranks[0].prefix_hits == 320.0 and m.ranks[1].running == 5


def test_vllm_command_line() -> None:
    s = WorkerSettings(model="tiny", engine="vllm", port=0,
                       vllm=VllmEngineSettings(model_path=Path("/models/tiny"),
                                               vllm_python="/venv/bin/python"))
    cmd = vllm_command(s, port=8123, events="tcp://127.0.0.1:1", replay="tcp://127.0.0.1:2")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for part in ("--model /models/tiny", "--served-model-name tiny", "--port 8123",
                 "--block-size 32", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert part in joined
    kv_config = cmd[cmd.index("--kv-events-config") + 1]
    assert '"endpoint": "tcp://127.0.0.1:1"' in kv_config
    with pytest.raises(ValueError, match="MODEL_PATH"):
        vllm_command(WorkerSettings(model="x"), port=1, events="", replay="")


def test_sequences_are_tracked_per_dp_rank() -> None:
    tr = VllmKvTranslator(block_size=BS)
    apply(tr, 0, [stored_map([11], None, TOKENS[:4])], rank=0)
    apply(tr, 0, [stored_map([11], None, TOKENS[:4])], rank=1)  # rank 1's own numbering
    assert tr.classify(1, 0) is SeqStatus.NEXT and tr.classify(1, 1) is SeqStatus.NEXT
    assert tr.restart(1) == [(1, KvCleared(), CacheInput.DEVICE)]
    assert tr.dump()[0] == [(None, CANON[0][0], CANON[0][1])] and tr.dump()[1] == []
    tr.expect_from(0, 2)
    assert tr.classify(3, 2) is SeqStatus.GAP


def test_endpoint_rules_follow_vllm() -> None:
    assert vllm_binds("tcp://*:5557") and vllm_binds("ipc:///tmp/x")
    assert not vllm_binds("tcp://127.0.0.1:5557")
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert rank_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert rank_endpoint("tcp://*:0", 3) == "tcp://*:0"


def test_replay_replies_as_a_dealer_receives_them() -> None:
    seq = (5).to_bytes(8, "big")
    assert parse_replay_reply([b"", b"kv", seq, b"payload"]) == (5, b"payload")
    end = (-1).to_bytes(8, "big", signed=True)
    assert parse_replay_reply([b"", b"", end, b""]) == (-1, b"")
    with pytest.raises(BadFrame):
        parse_replay_reply([b"", b"x"])
