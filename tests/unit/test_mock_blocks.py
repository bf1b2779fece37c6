"""Block pool: prefix hits, stored only for new blocks, LRU eviction emits removed, reset."""

from __future__ import annotations

import pytest

from controlplane.protocol.events import KvCleared, KvRemoved, KvStored
from controlplane.protocol.hashing import block_hashes
from worker.engines.mock.blocks import BlockPool, SeqBlocks

BS = 4


def chain(tokens: list[int]) -> list[tuple[int, int]]:
    return block_hashes(tokens, BS)


def stored_hashes(events: list[object]) -> list[int]:
    return [b.block_hash for e in events if isinstance(e, KvStored) for b in e.blocks]


def test_new_blocks_are_stored_with_parents_and_partial_blocks_are_not() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    toks = list(range(10))  # 2 full blocks + a partial one
    c = chain(toks)
    seq = SeqBlocks()
    assert pool.allocate(seq, c, len(toks))
    events = pool.drain_events()
    assert len(events) == 1 and isinstance(events[0], KvStored)
    assert events[0].parent_hash is None
    assert [(b.block_hash, b.tokens_hash) for b in events[0].blocks] == c
    assert pool.used_blocks == 3 and pool.cached_blocks == 2
    assert pool.dump() == [(None, c[0][0], c[0][1]), (c[0][0], c[1][0], c[1][1])]


def test_prefix_hit_reuses_blocks_and_stores_only_the_new_tail() -> None:
    pool = BlockPool(num_blocks=16, block_size=BS)
    a = list(range(8))
    b = [*a, 100, 101, 102, 103]
    s1 = SeqBlocks()
    assert pool.allocate(s1, chain(a), len(a))
    pool.drain_events()
    assert pool.match(chain(b)) == 2
    s2 = SeqBlocks()
    assert pool.allocate(s2, chain(b), len(b))
    events = pool.drain_events()
    assert len(events) == 1 and isinstance(events[0], KvStored)
    assert events[0].parent_hash == chain(b)[1][0]
    assert stored_hashes(events) == [chain(b)[2][0]]
    assert pool.used_blocks == 3  # the two shared blocks count once


def test_chunked_growth_converts_the_partial_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    toks = list(range(8))
    seq = SeqBlocks()
    assert pool.allocate(seq, chain(toks), 3)
    assert pool.drain_events() == [] and pool.used_blocks == 1
    assert pool.allocate(seq, chain(toks), 6)
    assert stored_hashes(pool.drain_events()) == [chain(toks)[0][0]]
    assert pool.used_blocks == 2
    assert pool.allocate(seq, chain(toks), 8)
    assert stored_hashes(pool.drain_events()) == [chain(toks)[1][0]]
    assert pool.used_blocks == 2 and not seq.partial


def test_lru_eviction_emits_removed_tail_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = [1] * 8
    b = [2] * 8
    c = [3] * 8
    sa, sb = SeqBlocks(), SeqBlocks()
    assert pool.allocate(sa, chain(a), 8)
    assert pool.allocate(sb, chain(b), 8)
    pool.release(sa)  # a freed first: least recently used
    pool.release(sb)
    pool.drain_events()
    assert pool.used_blocks == 0 and pool.cached_blocks == 4
    sc = SeqBlocks()
    assert pool.allocate(sc, chain(c), 8)
    events = pool.drain_events()
    assert isinstance(events[0], KvRemoved)
    # a's tail block goes before its head.
    assert events[0].block_hashes == [chain(a)[1][0], chain(a)[0][0]]
    assert stored_hashes(events) == [h for h, _ in chain(c)]
    assert pool.match(chain(a)) == 0 and pool.match(chain(b)) == 2


def test_touching_a_cached_block_protects_it_from_eviction() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    a, b = [1] * 4, [2] * 4
    sa, sb = SeqBlocks(), SeqBlocks()
    pool.allocate(sa, chain(a), 4)
    pool.allocate(sb, chain(b), 4)
    pool.release(sa)
    pool.release(sb)
    again = SeqBlocks()
    assert pool.allocate(again, chain(a), 4)  # hit: a is now in use, b is the LRU victim
    pool.drain_events()
    s2 = SeqBlocks()
    assert pool.allocate(s2, chain([5] * 8), 8)
    events = pool.drain_events()
    assert isinstance(events[0], KvRemoved) and events[0].block_hashes == [chain(b)[0][0]]


def test_allocation_fails_atomically_when_blocks_are_in_use() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS)
    s1 = SeqBlocks()
    assert pool.allocate(s1, chain([1] * 8), 8)
    pool.drain_events()
    s2 = SeqBlocks()
    assert not pool.allocate(s2, chain([2] * 4), 4)
    assert pool.drain_events() == [] and s2.held == [] and pool.used_blocks == 2


def test_reset_clears_only_when_idle() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    s = SeqBlocks()
    pool.allocate(s, chain([1] * 4), 4)
    assert not pool.reset()
    pool.release(s)
    pool.drain_events()
    assert pool.reset()
    assert pool.drain_events() == [KvCleared()]
    assert pool.cached_blocks == 0 and pool.dump() == []


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks=0, block_size=BS)
    pool = BlockPool(num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="chain"):
        pool.allocate(SeqBlocks(), [], 8)
