"""The prefix index: which worker dp rank holds which block, in which storage tier. Pure.

Fed by ``stored``/``removed``/``cleared`` KV events (DESIGN §5), or, in approximate mode, by the
router's own decisions with a TTL. Keys are chain hashes, so "worker holds block i" implies it
held the whole prefix when the block was stored; the overlap of a request is the run of leading
blocks a worker holds, counted per tier (a block held in several tiers counts in the fastest).

Event ids are checked per worker: a jump is a gap and a worker heard of for the first time needs
its full state; both answer :class:`KvApplied` values that tell the caller to request a dump.
Events arriving while a dump is pending are buffered (at most ``max_buffered`` per worker: past it
the rest are dropped, which the event ids show as a gap after the dump) and replayed after it.

Bounded per worker (issue 17): with a capacity set (:meth:`PrefixIndex.set_capacity`, the worker's
capped KV blocks per rank) a rank holds at most that many blocks; a ``stored`` claim past it is not
indexed (counted in :attr:`PrefixIndex.refused`). A worker cannot grow a router's memory past its
own capacity by claiming blocks.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import cast

from controlplane.protocol.events import KvCleared, KvDumpReply, KvEvent, KvRemoved, KvStored
from controlplane.protocol.policy import CacheInput
from router.cost.common import Overlap

WorkerKey = tuple[int, int]  # (instance_id, dp_rank)

_TIERS: tuple[CacheInput, ...] = (
    CacheInput.DEVICE, CacheInput.HOST, CacheInput.DISK, CacheInput.SHARED,
)
_BIT: dict[CacheInput, int] = {t: 1 << i for i, t in enumerate(_TIERS)}
_DEVICE_ONLY = _BIT[CacheInput.DEVICE]
_FEW_HOLDERS = 8  # up to this many ranks holding a prompt's first block, runs are taken per rank
_DEVICE_RUNS: list[Overlap] = []  # Overlap(device=n) by n, shared (immutable)
# Fastest tier of a bit mask → its position in Overlap.
_BEST: list[int] = [0] * 16
for _mask in range(1, 16):
    _BEST[_mask] = (_mask & -_mask).bit_length() - 1


class KvApplied(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # event id already seen: ignored
    GAP = "gap"  # applied, but events were missed: request a dump
    NEW_WORKER = "new_worker"  # first event of this worker: request a dump
    BUFFERED = "buffered"  # a dump is pending: replayed after it


class PrefixIndex:
    def __init__(self, *, max_buffered: int = 4096) -> None:
        self.max_buffered = max_buffered
        self._capacity: dict[int, int] = {}  # instance id → blocks one rank may hold
        self.refused = 0  # blocks claimed past a rank's capacity (not indexed)
        self.buffer_dropped = 0  # events dropped while a dump was pending (buffer full)
        self.other_process = 0  # events and dumps of another process than the known one, not applied
        self._holders: dict[int, dict[WorkerKey, int]] = {}
        self._by_key: dict[WorkerKey, set[int]] = {}
        self._last_event: dict[int, int] = {}
        self._pending_dump: dict[int, list[KvEvent]] = {}
        # Approximate mode: (key, hash) → expiry, in expiry order (constant TTL).
        self._expiry: dict[tuple[WorkerKey, int], float] = {}
        self.gaps = 0
        # Set once a block is stored in a tier other than the device: overlaps() then checks tiers.
        self._other_tiers = False

    # -- queries -------------------------------------------------------------------------------

    def overlaps(self, hashes: Sequence[int]) -> dict[WorkerKey, Overlap]:
        """Leading blocks of ``hashes`` each worker rank holds, by tier (ranks holding the first).

        A few ranks (``_FEW_HOLDERS``, the usual case) take their run in C from their own block
        sets (``takewhile``). With many, the blocks' holders are looked up in C and the run is
        scanned in C (map/compress) for the next block some rank of it lacks, where the ranks
        still in the run are intersected with that block's holders: the Python loop turns once
        per block where ranks leave the run, which keeps this fast with hundreds of holders.
        Tiers are counted one by one only past the leading blocks whose every holder has them on
        the device alone (all of them, if no other tier was ever stored)."""
        holders_of = self._holders
        first = holders_of.get(hashes[0]) if hashes else None
        if not first:
            return {}
        if len(first) <= _FEW_HOLDERS:
            takewhile, by_key = itertools.takewhile, self._by_key
            run = {k: len(list(takewhile(by_key[k].__contains__, hashes))) for k in first}
        else:
            run = self._runs(first, hashes)
        device_runs = _DEVICE_RUNS
        end = max(run.values())
        while len(device_runs) <= end:
            device_runs.append(Overlap(len(device_runs)))
        if not self._other_tiers:
            return {k: device_runs[n] for k, n in run.items()}
        # Leading blocks held on the device alone by every holder (each block before ``end`` has
        # a holder: the rank whose run is longest).
        device_only = next(itertools.compress(itertools.count(), (
            max(holders_of[h].values()) != _DEVICE_ONLY for h in hashes[:end])), end)
        out: dict[WorkerKey, Overlap] = {}
        for k, n in run.items():
            if n <= device_only:
                out[k] = device_runs[n]
            else:
                counts = [device_only, 0, 0, 0]
                for h in hashes[device_only:n]:
                    counts[_BEST[holders_of[h][k]]] += 1
                out[k] = Overlap(*counts)
        return out

    def _runs(self, first: dict[WorkerKey, int], hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """The run of each rank holding the first block, for many such ranks."""
        held = list(map(self._holders.get, hashes))  # each block's holders (None: nobody), in C
        try:
            end = held.index(None)  # no run goes past the first block nobody holds
        except ValueError:
            end = len(held)
        blocks = cast(list[dict[WorkerKey, int]], held[:end])
        active = set(first)
        run: dict[WorkerKey, int] = {}
        i = 1
        while active and i < end:
            lacking = map(operator.not_, map(operator.ge, map(dict.keys, blocks[i:end]), itertools.repeat(active)))
            i = next(itertools.compress(itertools.count(i), lacking), end)
            if i == end:
                break
            still = active.intersection(blocks[i])
            for k in active.difference(still):
                run[k] = i
            active = still
            i += 1
        for k in active:
            run[k] = end
        return {k: run[k] for k in first}

    def blocks_of(self, key: WorkerKey) -> int:
        return len(self._by_key.get(key, ()))

    def held(self) -> dict[int, int]:
        """Blocks indexed per worker (all its ranks): what its claims hold of the router's memory."""
        out: dict[int, int] = {}
        for (wid, _), mine in self._by_key.items():
            out[wid] = out.get(wid, 0) + len(mine)
        return out

    def __len__(self) -> int:
        return len(self._holders)

    def workers(self) -> set[int]:
        return {k[0] for k in self._by_key}

    def not_taken(self) -> dict[str, int]:
        """Counts of events and dumps not taken as they came, by reason (each monotonic)."""
        return {"gap": self.gaps, "buffer_full": self.buffer_dropped, "other_process": self.other_process}

    def dump_pending(self, instance_id: int) -> bool:
        return instance_id in self._pending_dump

    # -- mutations -----------------------------------------------------------------------------

    def set_capacity(self, instance_id: int, blocks_per_rank: int) -> None:
        """At most ``blocks_per_rank`` blocks of each rank of the worker from now on (blocks it
        already holds past a lowered capacity stay until removed)."""
        self._capacity[instance_id] = blocks_per_rank

    def store(self, key: WorkerKey, hashes: Iterable[int], tier: CacheInput = CacheInput.DEVICE) -> None:
        bit = _BIT[tier]
        if bit != _DEVICE_ONLY:
            self._other_tiers = True
        mine = self._by_key.setdefault(key, set())
        holders_of = self._holders
        cap = self._capacity.get(key[0])
        if cap is not None:
            hashes = list(hashes)
            if len(mine) + len(hashes) > cap:
                hashes = self._within(mine, hashes, cap)
        for h in hashes:
            holders = holders_of.get(h)
            if holders is None:
                holders_of[h] = {key: bit}
            else:
                holders[key] = holders.get(key, 0) | bit
            mine.add(h)

    def _within(self, mine: set[int], hashes: list[int], cap: int) -> list[int]:
        """The leading ``hashes`` that fit a rank holding ``mine`` under ``cap`` (held ones are
        free); the others are refused and counted."""
        room = cap - len(mine)
        out: list[int] = []
        for h in hashes:
            if h in mine:
                out.append(h)
            elif room > 0:
                out.append(h)
                room -= 1
            else:
                self.refused += 1
        return out

    def remove(self, key: WorkerKey, hashes: Iterable[int], tier: CacheInput = CacheInput.DEVICE) -> None:
        bit = _BIT[tier]
        mine = self._by_key.get(key)
        if mine is None:
            return
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None or key not in holders:
                continue
            mask = holders[key] & ~bit
            if mask:
                holders[key] = mask
            else:
                del holders[key]
                mine.discard(h)
                if not holders:
                    del self._holders[h]

    def clear(self, key: WorkerKey, tier: CacheInput | None = None) -> None:
        """Forget a worker rank's blocks (one tier, or all)."""
        mine = self._by_key.get(key)
        if not mine:
            return
        if tier is not None:
            self.remove(key, list(mine), tier)
            return
        for h in mine:
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(key, None)
                if not holders:
                    del self._holders[h]
        del self._by_key[key]

    def clear_worker(self, instance_id: int) -> None:
        """Forget every block of every rank of a worker (its event ids and capacity stay)."""
        for key in [k for k in self._by_key if k[0] == instance_id]:
            self.clear(key)

    def remove_worker(self, instance_id: int) -> None:
        self.clear_worker(instance_id)
        self._last_event.pop(instance_id, None)
        self._pending_dump.pop(instance_id, None)
        self._capacity.pop(instance_id, None)

    # -- KV events -----------------------------------------------------------------------------

    def apply(self, event: KvEvent) -> KvApplied:
        wid = event.instance_id
        pending = self._pending_dump.get(wid)
        if pending is not None:
            if len(pending) < self.max_buffered:
                pending.append(event)
            else:
                self.buffer_dropped += 1
            return KvApplied.BUFFERED
        last = self._last_event.get(wid)
        if last is not None and event.event_id <= last:
            return KvApplied.DUPLICATE
        self._apply_data(event)
        self._last_event[wid] = event.event_id
        if last is None:
            return KvApplied.NEW_WORKER
        if event.event_id != last + 1:
            self.gaps += 1
            return KvApplied.GAP
        return KvApplied.APPLIED

    def _apply_data(self, event: KvEvent) -> None:
        key = (event.instance_id, event.dp_rank)
        data = event.data
        if isinstance(data, KvStored):
            self.store(key, (b.block_hash for b in data.blocks), event.tier)
        elif isinstance(data, KvRemoved):
            self.remove(key, data.block_hashes, event.tier)
        elif isinstance(data, KvCleared):
            self.clear(key, event.tier)

    def begin_dump(self, instance_id: int) -> bool:
        """Start buffering a worker's events until its dump arrives. False if already pending."""
        if instance_id in self._pending_dump:
            return False
        self._pending_dump[instance_id] = []
        return True

    def load_dump(self, reply: KvDumpReply) -> list[KvApplied]:
        """Replace a worker's blocks with its full state, then replay events newer than it."""
        wid = reply.instance_id
        buffered = self._pending_dump.pop(wid, [])
        for key in [k for k in self._by_key if k[0] == wid]:
            self.clear(key)
        for rank in reply.ranks:
            self.store((wid, rank.dp_rank), (b[1] for b in rank.blocks), rank.tier)
        self._last_event[wid] = reply.last_event_id
        return [self.apply(e) for e in buffered if e.event_id > reply.last_event_id]

    def unsure(self, instance_id: int) -> None:
        """The worker's blocks may miss events: its next event is taken as a new worker's
        (:attr:`KvApplied.NEW_WORKER`), which asks for its dump."""
        self._last_event.pop(instance_id, None)

    def abandon_dump(self, instance_id: int) -> list[KvApplied]:
        """The dump did not come: apply what was buffered as it is (best effort)."""
        buffered = self._pending_dump.pop(instance_id, [])
        return [self.apply(e) for e in buffered]

    # -- approximate mode ----------------------------------------------------------------------

    def record(self, key: WorkerKey, hashes: Sequence[int], *, now: float, ttl: float) -> None:
        """Index a routing decision as if the worker had stored the prompt's blocks."""
        self.store(key, hashes)
        expires = now + ttl
        for h in hashes:
            k = (key, h)
            self._expiry.pop(k, None)
            self._expiry[k] = expires

    def expire(self, now: float) -> int:
        """Drop decision entries older than their TTL. Returns how many were dropped."""
        dropped: list[tuple[WorkerKey, int]] = []
        for k, expires in self._expiry.items():
            if expires > now:
                break
            dropped.append(k)
        for k in dropped:
            del self._expiry[k]
            self.remove(k[0], (k[1],))
        return len(dropped)
