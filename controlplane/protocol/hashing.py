"""Canonical KV block hashes (DESIGN §5), shared by routers and workers.

block hash = XXH3-64(seed 1337) of the block's token ids as little-endian u32;
chain hash = XXH3-64(seed 1337) of (parent chain hash as LE u64 ‖ block hash as LE u64);
the first block's chain hash is its block hash. Only full blocks are hashed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

SEED = 1337
_U64 = struct.Struct("<Q")


def _packer(n: int) -> struct.Struct:
    """The packing of ``n`` token ids as little-endian u32 (one per block size, kept)."""
    packer = _BLOCKS.get(n)
    if packer is None:
        packer = _BLOCKS[n] = struct.Struct(f"<{n}I")
    return packer


_BLOCKS: dict[int, struct.Struct] = {}


def block_hash(tokens: Sequence[int]) -> int:
    data = _packer(len(tokens)).pack(*tokens)
    h: int = xxhash.xxh3_64_intdigest(data, seed=SEED)
    return h


def chain_hash(parent: int | None, block: int) -> int:
    if parent is None:
        return block
    h: int = xxhash.xxh3_64_intdigest(_U64.pack(parent) + _U64.pack(block), seed=SEED)
    return h


def block_hashes(tokens: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """``[(chain_hash, block_hash), ...]`` for every full block of ``tokens``."""
    out: list[tuple[int, int]] = []
    parent: int | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        b = block_hash(tokens[start : start + block_size])
        c = chain_hash(parent, b)
        out.append((c, b))
        parent = c
    return out


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of :func:`block_hashes`, built without a tuple per block: a long prompt
    (hashed in a thread by the router) then allocates no garbage-collected object per block, so
    it cannot trigger a full collection that would stall the event loop."""
    out: list[int] = []
    parent: int | None = None
    pack = _U64.pack
    block = _packer(block_size).pack
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, len(tokens) - block_size + 1, block_size):
        b = digest(block(*tokens[start : start + block_size]), seed=SEED)
        if parent is not None:
            b = digest(pack(parent) + pack(b), seed=SEED)
        out.append(b)
        parent = b
    return out
