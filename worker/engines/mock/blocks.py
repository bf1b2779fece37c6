"""The mock engine's KV block pool: prefix caching by canonical chain hash, LRU eviction. Pure.

Model (the one vLLM's v1 block manager uses, reduced to what routing can observe):

- A *full* block is registered under its canonical chain hash (``controlplane.protocol.hashing``),
  so a later sequence with the same prefix re-uses it; registering a block emits ``stored``.
- A sequence's trailing partial block is private: it takes a slot but no hash.
- A registered block whose reference count drops to 0 stays cached on the free list; sequences
  release their blocks tail first, so the free list evicts a prefix's tail before its head.
- A slot is taken from the never-used capacity first, then by evicting the least recently freed
  cached block, which emits ``removed``. ``reset`` forgets everything and emits ``cleared``.

Events accumulate in order and are taken with :meth:`BlockPool.drain_events`; the engine numbers
and publishes them. Nothing here knows about time, asyncio or NATS.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from controlplane.protocol.events import KvCleared, KvRemoved, KvStored, StoredBlock

KvData = KvStored | KvRemoved | KvCleared
ChainEntry = tuple[int, int]  # (chain hash, tokens hash) of one full block


@dataclass(slots=True)
class _Block:
    chain_hash: int
    tokens_hash: int
    parent: int | None
    depth: int
    refs: int


@dataclass(slots=True)
class SeqBlocks:
    """The blocks one sequence holds: its full blocks' chain hashes, and a private partial slot."""

    held: list[int] = field(default_factory=list)
    partial: bool = False

    @property
    def slots(self) -> int:
        return len(self.held) + (1 if self.partial else 0)


class BlockPool:
    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks: dict[int, _Block] = {}
        self._free: OrderedDict[int, None] = OrderedDict()  # refs == 0, least recent first
        self._private = 0
        self._events: list[KvData] = []

    # -- observation -----------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks held by live sequences (cached-but-free blocks count as free, as in vLLM)."""
        return len(self._blocks) - len(self._free) + self._private

    @property
    def cached_blocks(self) -> int:
        """Registered blocks, in use or not: what a router's prefix index should hold."""
        return len(self._blocks)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def __contains__(self, chain_hash: int) -> bool:
        return chain_hash in self._blocks

    def match(self, chain: Sequence[ChainEntry], limit: int | None = None) -> int:
        """Number of leading blocks of ``chain`` that are cached (at most ``limit``)."""
        n = 0
        end = len(chain) if limit is None else min(limit, len(chain))
        while n < end and chain[n][0] in self._blocks:
            n += 1
        return n

    def dump(self) -> list[tuple[int | None, int, int]]:
        """Every cached block as ``(parent, chain hash, tokens hash)``, parents first."""
        ordered = sorted(self._blocks.values(), key=lambda b: b.depth)
        return [(b.parent, b.chain_hash, b.tokens_hash) for b in ordered]

    def drain_events(self) -> list[KvData]:
        events, self._events = self._events, []
        return events

    # -- changes ---------------------------------------------------------------------------

    def allocate(self, seq: SeqBlocks, chain: Sequence[ChainEntry], num_tokens: int) -> bool:
        """Make ``seq`` hold slots for its first ``num_tokens`` tokens.

        ``chain`` must cover every full block of those tokens. Cached blocks are re-used (a prefix
        hit), new full blocks are registered (``stored``), room is made by evicting free cached
        blocks (``removed``). Returns False, changing nothing, when the pool cannot make room.
        """
        bs = self.block_size
        full_target = num_tokens // bs
        partial_target = num_tokens % bs != 0
        if full_target < len(seq.held):
            raise ValueError("a sequence's blocks only grow")
        if len(chain) < full_target:
            raise ValueError("chain does not cover the requested tokens")
        start = len(seq.held)
        new = chain[start:full_target]
        reused = [h for h, _ in new if h in self._blocks]
        reused_free = sum(1 for h in reused if h in self._free)
        needed = (len(new) - len(reused)) + (1 if partial_target else 0) - (1 if seq.partial else 0)
        unused = self.num_blocks - len(self._blocks) - self._private
        if needed > unused + len(self._free) - reused_free:
            return False

        for h in reused:
            block = self._blocks[h]
            if block.refs == 0:
                del self._free[h]
            block.refs += 1
        self._evict(needed - unused)

        # Chain hashes include the parent, so one sequence never repeats a hash: a block of
        # ``new`` is either re-used (it was cached) or registered here, in runs of new blocks.
        reused_set = set(reused)
        run: list[StoredBlock] = []
        run_parent: int | None = None
        for i, (h, tokens_hash) in enumerate(new, start=start):
            if h in reused_set:
                if run:
                    self._events.append(KvStored(parent_hash=run_parent, blocks=run))
                    run = []
                continue
            parent = chain[i - 1][0] if i > 0 else None
            self._blocks[h] = _Block(h, tokens_hash, parent, i, 1)
            if not run:
                run_parent = parent
            run.append(StoredBlock(block_hash=h, tokens_hash=tokens_hash))
        if run:
            self._events.append(KvStored(parent_hash=run_parent, blocks=run))

        seq.held.extend(h for h, _ in new)
        self._private += (1 if partial_target else 0) - (1 if seq.partial else 0)
        seq.partial = partial_target
        return True

    def release(self, seq: SeqBlocks) -> None:
        """Drop ``seq``'s references, tail first, so its tail is evicted before its head."""
        for h in reversed(seq.held):
            block = self._blocks.get(h)
            if block is None:  # cleared under us
                continue
            block.refs -= 1
            if block.refs == 0:
                self._free[h] = None
                self._free.move_to_end(h)
        seq.held = []
        if seq.partial:
            self._private -= 1
            seq.partial = False

    def reset(self) -> bool:
        """Forget every cached block (``cleared``). Refused (False) while any block is in use."""
        if self.used_blocks:
            return False
        self._blocks.clear()
        self._free.clear()
        self._events.append(KvCleared())
        return True

    def _evict(self, count: int) -> None:
        removed: list[int] = []
        for _ in range(max(count, 0)):
            h, _ = self._free.popitem(last=False)
            del self._blocks[h]
            removed.append(h)
        if removed:
            self._events.append(KvRemoved(block_hashes=removed))
