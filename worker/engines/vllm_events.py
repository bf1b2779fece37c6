"""vLLM KV-cache events → Rudder's canonical KV events (DESIGN §5, §6). Pure (msgpack only).

vLLM's ZMQ publisher sends ``[topic, seq (8 bytes, big-endian), payload]``; the payload is msgpack
``[ts, [events], dp_rank]``. Events are decoded untyped (a new event type must not make the whole
batch unreadable) and accepted in both encodings seen in the wild: a map with a ``"type"`` key, or
a tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, ...]``.

vLLM's block hashes are its own (and may be bytes); routers need canonical chain hashes. A
``BlockStored`` carries its blocks' ``token_ids``, so the translator hashes them itself and keeps a
map from vLLM's hash to the canonical one, per dp rank, to translate parents and
``BlockRemoved``. A block whose parent it never saw (it attached late, or lost events for good)
cannot be hashed canonically: it is skipped and the view is marked partial.

Sequence numbers (per dp rank: one publisher per engine process): +1 is normal; a jump is a gap
(the caller replays it); going backwards means vLLM restarted: the rank is cleared and numbering
starts again.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from controlplane.protocol.events import KvCleared, KvRemoved, KvStored, StoredBlock
from controlplane.protocol.hashing import block_hash, chain_hash
from controlplane.protocol.policy import CacheInput

log = logging.getLogger(__name__)

KvData = KvStored | KvRemoved | KvCleared

_MEDIUM_TIER = {"GPU": CacheInput.DEVICE, "CPU": CacheInput.HOST, "CPU_TIER": CacheInput.HOST,
                "DISK": CacheInput.DISK, "SHARED": CacheInput.SHARED}


def tier_of(medium: Any) -> CacheInput:
    if medium is None:
        return CacheInput.DEVICE
    return _MEDIUM_TIER.get(str(medium).upper(), CacheInput.DEVICE)


@dataclass(frozen=True, slots=True)
class VllmBatch:
    seq: int
    ts: float
    events: list[Any]
    dp_rank: int


class BadFrame(ValueError):
    """A ZMQ message that is not a vLLM KV-event batch."""


def decode_frames(frames: Sequence[bytes]) -> VllmBatch:
    """Decode ``[topic, seq, payload]`` (or ``[seq, payload]`` from a replay). Raises BadFrame."""
    if len(frames) == 3:
        _, seq_bytes, payload = frames
    elif len(frames) == 2:
        seq_bytes, payload = frames
    else:
        raise BadFrame(f"expected 2 or 3 frames, got {len(frames)}")
    if len(seq_bytes) != 8:
        raise BadFrame("the sequence frame is not 8 bytes")
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    return decode_payload(seq, payload)


def decode_payload(seq: int, payload: bytes) -> VllmBatch:
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadFrame(f"payload is not msgpack: {exc!r}") from exc
    if isinstance(body, dict):
        ts, events, rank = body.get("ts", 0.0), body.get("events", []), body.get("data_parallel_rank")
    elif isinstance(body, list | tuple) and len(body) >= 2:
        ts, events = body[0], body[1]
        rank = body[2] if len(body) > 2 else None
    else:
        raise BadFrame("payload is not [ts, events, dp_rank]")
    if not isinstance(events, list):
        raise BadFrame("events is not a list")
    return VllmBatch(seq=seq, ts=float(ts or 0.0), events=events, dp_rank=int(rank or 0))


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def event_fields(event: Any) -> tuple[str, dict[str, Any]] | None:
    """``(type, fields)`` of one untyped event, or None when it is not one we know."""
    if isinstance(event, dict):
        kind = event.get("type") or event.get("_type")
        if not isinstance(kind, str):
            return None
        return kind, event
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        kind = event[0]
        names = _FIELDS.get(kind)
        if names is None:
            return kind, {}
        return kind, dict(zip(names, event[1:], strict=False))
    return None


def _key(h: Any) -> Hashable:
    """vLLM hashes are ints, bytes, or (after msgpack) lists of ints: make them hashable."""
    if isinstance(h, list):
        return tuple(_key(x) for x in h)
    if isinstance(h, int | bytes | str | tuple):
        return h
    return repr(h)


@dataclass(slots=True)
class _Entry:
    chain: int
    tokens_hash: int
    parent: int | None
    depth: int
    tiers: set[CacheInput] = field(default_factory=set)


class SeqStatus(enum.Enum):
    NEXT = "next"  # the expected number (or the first one seen)
    GAP = "gap"  # numbers are missing before this one
    RESTART = "restart"  # went backwards: the publisher restarted
    OLD = "old"  # already applied (a replayed duplicate)


class VllmKvTranslator:
    """Canonical view of one vLLM server's KV cache, built from its event batches.

    Each dp rank of vLLM is its own engine process with its own publisher, so sequence numbers
    are tracked per rank (the rank comes from the batch payload).
    """

    def __init__(self, *, block_size: int) -> None:
        self.block_size = block_size
        self.last_seqs: dict[int, int] = {}
        self.partial = False
        self._ranks: dict[int, dict[Hashable, _Entry]] = {}
        self.unknown_types: set[str] = set()

    @property
    def last_seq(self) -> int | None:
        """Last applied sequence number of rank 0 (the only rank without data parallelism)."""
        return self.last_seqs.get(0)

    # -- sequence numbers -------------------------------------------------------------------

    def classify(self, seq: int, rank: int = 0, *, replaying: bool = False) -> SeqStatus:
        last = self.last_seqs.get(rank)
        if last is None or seq == last + 1:
            return SeqStatus.NEXT
        if seq > last + 1:
            return SeqStatus.GAP
        return SeqStatus.OLD if replaying else SeqStatus.RESTART

    def expect_from(self, seq: int, rank: int = 0) -> None:
        """The next batch of ``rank`` should be ``seq`` (e.g. 0 for a server we started)."""
        self.last_seqs[rank] = seq - 1

    def restart(self, rank: int = 0) -> list[tuple[int, KvData, CacheInput]]:
        """The publisher of ``rank`` restarted: everything that rank had is gone."""
        entries = self._ranks.setdefault(rank, {})
        tiers = {t for e in entries.values() for t in e.tiers} or {CacheInput.DEVICE}
        entries.clear()
        self.last_seqs.pop(rank, None)
        return [(rank, KvCleared(), t) for t in sorted(tiers)]

    def give_up_gap(self, seq: int, rank: int = 0) -> None:
        """Missing batches could not be replayed: later blocks may have unknown parents."""
        log.warning("vLLM KV events of dp rank %d before seq %d are lost; the cache view is "
                    "partial", rank, seq)
        self.partial = True
        self.last_seqs[rank] = seq - 1

    # -- translation ------------------------------------------------------------------------

    def apply(self, batch: VllmBatch) -> list[tuple[int, KvData, CacheInput]]:
        """Translate one batch (the caller has checked its sequence number)."""
        rank = batch.dp_rank
        self.last_seqs[rank] = batch.seq
        entries = self._ranks.setdefault(rank, {})
        out: list[tuple[int, KvData, CacheInput]] = []
        for raw in batch.events:
            parsed = event_fields(raw)
            if parsed is None:
                continue
            kind, f = parsed
            if kind == "BlockStored":
                out.extend(self._stored(rank, entries, f))
            elif kind == "BlockRemoved":
                out.extend(self._removed(rank, entries, f))
            elif kind == "AllBlocksCleared":
                tiers = {t for e in entries.values() for t in e.tiers} or {CacheInput.DEVICE}
                entries.clear()
                out.extend((rank, KvCleared(), t) for t in sorted(tiers))
            elif kind not in self.unknown_types:
                self.unknown_types.add(kind)
                log.info("ignoring vLLM KV event type %r", kind)
        return out

    def _stored(self, rank: int, entries: dict[Hashable, _Entry],
                f: dict[str, Any]) -> list[tuple[int, KvData, CacheInput]]:
        hashes = [_key(h) for h in f.get("block_hashes") or []]
        tokens = f.get("token_ids") or []
        bs = int(f.get("block_size") or self.block_size)
        tier = tier_of(f.get("medium"))
        if f.get("lora_id") is not None:
            return []  # adapter blocks live in another namespace: not routable by prefix
        parent_key = f.get("parent_block_hash")
        parent: int | None = None
        depth = 0
        if parent_key is not None:
            pentry = entries.get(_key(parent_key))
            if pentry is None:
                self.partial = True
                log.debug("BlockStored with an unknown parent: skipped")
                return []
            parent, depth = pentry.chain, pentry.depth + 1
        if len(tokens) < len(hashes) * bs:
            log.warning("BlockStored with %d tokens for %d blocks of %d: skipped",
                        len(tokens), len(hashes), bs)
            return []
        blocks: list[StoredBlock] = []
        run_parent = parent
        out: list[tuple[int, KvData, CacheInput]] = []
        for i, key in enumerate(hashes):
            existing = entries.get(key)
            if existing is not None and tier in existing.tiers:
                # Already known in this tier (vLLM may repeat a store): end the current run.
                if blocks:
                    out.append((rank, KvStored(parent_hash=run_parent, blocks=blocks), tier))
                    blocks = []
                parent, depth = existing.chain, existing.depth + 1
                run_parent = parent
                continue
            b = block_hash(tokens[i * bs:(i + 1) * bs])
            c = chain_hash(parent, b)
            if existing is None:
                entries[key] = _Entry(c, b, parent, depth, {tier})
            else:
                existing.tiers.add(tier)
            if not blocks:
                run_parent = parent
            blocks.append(StoredBlock(block_hash=c, tokens_hash=b))
            parent, depth = c, depth + 1
        if blocks:
            out.append((rank, KvStored(parent_hash=run_parent, blocks=blocks), tier))
        return out

    def _removed(self, rank: int, entries: dict[Hashable, _Entry],
                 f: dict[str, Any]) -> list[tuple[int, KvData, CacheInput]]:
        tier = tier_of(f.get("medium"))
        gone: list[int] = []
        for raw in f.get("block_hashes") or []:
            key = _key(raw)
            entry = entries.get(key)
            if entry is None or tier not in entry.tiers:
                continue
            entry.tiers.discard(tier)
            if not entry.tiers:
                del entries[key]
            gone.append(entry.chain)
        return [(rank, KvRemoved(block_hashes=gone), tier)] if gone else []

    # -- state ------------------------------------------------------------------------------

    def dump(self, tier: CacheInput = CacheInput.DEVICE) -> dict[int, list[tuple[int | None, int, int]]]:
        """Per rank: ``(parent, chain, tokens hash)`` of every block in ``tier``, parents first."""
        out: dict[int, list[tuple[int | None, int, int]]] = {}
        for rank, entries in sorted(self._ranks.items()):
            live = sorted((e for e in entries.values() if tier in e.tiers), key=lambda e: e.depth)
            out[rank] = [(e.parent, e.chain, e.tokens_hash) for e in live]
        return out

    def block_count(self, rank: int = 0) -> int:
        return len(self._ranks.get(rank, {}))
