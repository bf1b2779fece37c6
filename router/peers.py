"""Peers' bookings: what the other router replicas have booked on each worker rank. Pure.

Each replica books only the requests it routes (router.bookings) and learns the others' only from
the workers' load reports, every second: between two reports, replicas behind a balancer without
affinity all see the same rank as the least loaded and send it work together (issue 16, item 4).
So each replica publishes a snapshot of its own bookings per rank (:class:`Figures`: requests,
prefill tokens not yet computed, distinct blocks) to its peers, coalesced and only when changed
(router.peersync), and counts theirs here.

The merge (:meth:`PeerLoads.total`, read by router.pools): a rank's load is

    max(own bookings + Σ peers' bookings, the worker's last report)    (per figure)

The report counts every request on the worker when it was sampled, whoever routed it; bookings
(this router's and its peers') count what was booked since and what the report has not seen yet.
Taking the larger never counts a request twice (the overlap of the two is counted once); the
price is undercounting when each holds requests the other does not, for at most one report
period. Two rules keep peers' figures from outliving what they describe:

- a worker's load report *supersedes* the peer figures of its ranks received before it
  (:meth:`PeerLoads.supersede`): the report already counts those requests, and the peers' next
  snapshots (any change of their bookings sends one) bring back what it cannot include yet;
- a peer is forgotten once its last snapshot is older than ``stale_s`` (:meth:`PeerLoads.expire`,
  run on the scheduler's tick): a replica that stopped or lost the bus stops counting within
  ``stale_s`` plus one tick. A live peer re-sends its snapshot at least every ``stale_s / 3``
  while it has bookings, so a lost message or two costs nothing.

The same snapshots carry the expected returns' events (router.returns: requests finished, entries
closed by a return) since the previous one (:class:`Outbox` keeps them until taken;
:func:`apply_returns` applies a peer's), so every replica expects a session back on the rank that
holds its cache whichever replica routed its last turn.

Snapshots are whole, so a lost message costs a moment's accuracy, never a lasting error; ``boot``
and ``seq`` keep only the newest snapshot of each peer process (core NATS keeps one publisher's
order, but a reconnect may not). Peers' blocks are summed as distinct counts: a prefix booked by
two replicas counts twice, an upper bound the report's figure caps nothing of (the block figure
weighs decode step time, where a shared system prompt is a small part of a rank's blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from controlplane.protocol import limits as L
from router.bookings import Bookings
from router.returns import Returns

WorkerKey = tuple[int, int]


class Figures(NamedTuple):
    """One rank's bookings as peers see them."""

    requests: int
    prefill_tokens: int
    blocks: int


NOTHING = Figures(0, 0, 0)
#: Events of the expected returns (router.returns) a router tells its peers, at most this many of
#: each kind per snapshot (the newest; more only when the bus was away).
MAX_RETURN_EVENTS = L.MAX_ROUTER_LOAD_EVENTS


class Finished(NamedTuple):
    """A request that finished on ``key``: its prompt's last full block hash and how long ago."""

    key: WorkerKey
    hash: int
    age_s: float


class Snapshot(NamedTuple):
    """What a router publishes (router.peersync): its bookings per rank with their version, and
    the expected-returns events since its last snapshot: requests finished (entries opened) and
    entries closed by a return it saw (their hashes)."""

    version: int
    ranks: dict[WorkerKey, Figures]
    finished: list[Finished]
    returned: list[int]


def own_figures(bookings: Bookings) -> dict[WorkerKey, Figures]:
    """This router's bookings per rank, as it publishes them (ranks with bookings only)."""
    out: dict[WorkerKey, Figures] = {}
    for key in bookings.keys():
        rank = bookings.rank(key)
        if rank is not None and rank.requests > 0:
            out[key] = Figures(rank.requests, max(rank.prefill_tokens, 0), rank.active_blocks)
    return out


@dataclass(slots=True)
class _Peer:
    boot: str
    seq: int
    received_at: float
    ranks: dict[WorkerKey, Figures] = field(default_factory=dict)


class PeerLoads:
    """The newest snapshot of each peer and their sum per rank (kept up to date, so the merge in
    router.pools costs one dictionary look-up)."""

    def __init__(self, *, stale_s: float) -> None:
        if stale_s <= 0:
            raise ValueError("stale_s must be positive")
        self.stale_s = stale_s
        self._peers: dict[str, _Peer] = {}
        self._total: dict[WorkerKey, Figures] = {}
        self.applied = 0  # snapshots applied
        self.refused = 0  # snapshots older than one already applied (out of order)

    def __len__(self) -> int:
        return len(self._peers)

    def peers(self) -> list[str]:
        return sorted(self._peers)

    def total(self, key: WorkerKey) -> Figures | None:
        """The sum of every counted peer's bookings on the rank (None: none)."""
        return self._total.get(key)

    def of_peer(self, router_id: str) -> dict[WorkerKey, Figures]:
        peer = self._peers.get(router_id)
        return dict(peer.ranks) if peer is not None else {}

    def apply(self, router_id: str, *, boot: str, seq: int, ranks: Mapping[WorkerKey, Figures],
              now: float) -> set[WorkerKey] | None:
        """Replace the peer's snapshot with ``ranks``; the ranks whose total changed, or None when
        the snapshot is older than one already applied from the same process (ignored)."""
        peer = self._peers.get(router_id)
        if peer is not None and peer.boot == boot and seq <= peer.seq:
            self.refused += 1
            return None
        if peer is None:
            peer = self._peers[router_id] = _Peer(boot, seq, now)
        old = peer.ranks
        peer.boot, peer.seq, peer.received_at = boot, seq, now
        new = {k: f for k, f in ranks.items() if f != NOTHING}
        peer.ranks = new
        self.applied += 1
        changed: set[WorkerKey] = set()
        for key in old.keys() | new.keys():
            before, after = old.get(key, NOTHING), new.get(key, NOTHING)
            if before != after:
                self._add(key, after, before)
                changed.add(key)
        return changed

    def supersede(self, instance_id: int) -> set[WorkerKey]:
        """The worker reported its load: drop every peer's figures of its ranks (the report counts
        them); the ranks whose total changed."""
        changed: set[WorkerKey] = set()
        for peer in self._peers.values():
            for key in [k for k in peer.ranks if k[0] == instance_id]:
                self._add(key, NOTHING, peer.ranks.pop(key))
                changed.add(key)
        return changed

    def expire(self, now: float) -> tuple[list[str], set[WorkerKey]]:
        """Forget the peers whose last snapshot is ``stale_s`` old or older: (their ids, the ranks
        whose total changed)."""
        gone = [rid for rid, p in self._peers.items() if now - p.received_at >= self.stale_s]
        changed: set[WorkerKey] = set()
        for rid in gone:
            changed |= self.remove(rid)
        return gone, changed

    def remove(self, router_id: str) -> set[WorkerKey]:
        """Forget one peer; the ranks whose total changed."""
        peer = self._peers.pop(router_id, None)
        if peer is None:
            return set()
        for key, figures in peer.ranks.items():
            self._add(key, NOTHING, figures)
        return set(peer.ranks)

    def forget_worker(self, instance_id: int) -> None:
        """The worker left: its ranks are nobody's load any more."""
        self.supersede(instance_id)

    def keys_of(self, instance_ids: Iterable[int]) -> set[WorkerKey]:
        ids = set(instance_ids)
        return {k for k in self._total if k[0] in ids}

    def _add(self, key: WorkerKey, plus: Figures, minus: Figures) -> None:
        cur = self._total.get(key, NOTHING)
        total = Figures(cur.requests + plus.requests - minus.requests,
                        cur.prefill_tokens + plus.prefill_tokens - minus.prefill_tokens,
                        cur.blocks + plus.blocks - minus.blocks)
        if total.requests <= 0 and total.prefill_tokens <= 0 and total.blocks <= 0:
            self._total.pop(key, None)
        else:
            self._total[key] = total


class Outbox:
    """What this router's peers must hear of its expected returns (router.returns) until
    router.peersync takes it with the next snapshot: requests finished here (rank, last block hash,
    when) and entries closed here by a return (hashes). Bounded: when nothing takes them (a bus
    away), the oldest go."""

    def __init__(self) -> None:
        self.finished: list[tuple[WorkerKey, int, float]] = []
        self.returned: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.finished or self.returned)

    def finish(self, key: WorkerKey, h: int, at: float) -> None:
        self.finished.append((key, h, at))
        if len(self.finished) > 2 * MAX_RETURN_EVENTS:
            del self.finished[:MAX_RETURN_EVENTS]

    def close(self, h: int) -> None:
        self.returned.append(h)
        if len(self.returned) > 2 * MAX_RETURN_EVENTS:
            del self.returned[:MAX_RETURN_EVENTS]

    def take(self, bookings: Bookings, since: int, now: float) -> Snapshot | None:
        """The snapshot to publish (None: nothing changed since version ``since``); the events are
        handed over once."""
        if bookings.version == since and not self:
            return None
        finished = [Finished(k, h, max(now - at, 0.0)) for k, h, at in self.finished[-MAX_RETURN_EVENTS:]]
        returned = self.returned[-MAX_RETURN_EVENTS:]
        self.finished, self.returned = [], []
        return Snapshot(bookings.version, own_figures(bookings), finished, returned)


def apply_returns(returns: Returns, finished: Iterable[Finished], returned: Iterable[int],
                  now: float) -> set[WorkerKey]:
    """A peer's expected-returns events, as if they had happened here (a finish opens the entry, a
    return closes it and counts); the ranks whose expected rate changed."""
    changed: set[WorkerKey] = set()
    for key, h, age in finished:
        returns.finished(key, (h,), now - age)
        changed.add(key)
    for h in returned:
        back = returns.closed(h, now)
        if back is not None:
            changed.add(back)
    return changed
