"""Requests expected back: the arrival rate the time cost's wait term reads (router.cost.time's λ). Pure.

A chat session or an agent loop sends its next request some time after its previous one finished,
and that request carries the previous prompt (and its answer): it is expected back on the rank that
holds its cache, and nowhere else. So what a rank should expect is not what it received lately but
the requests that finished there and have not come back yet. Each finished request leaves an
*open* entry keyed by the chain hash of its prompt's last full block; a later request whose prompt
holds that hash is its return, and closes it (wherever the return is then sent).

The model: a finished request comes back with probability ``p``, after an exponential delay of mean
``τ`` (both observed: ``τ`` the running mean delay of the returns seen, ``p`` the fraction of
finished requests that came back; priors until enough are seen). An entry still open at age ``a``
comes back with probability ``π(a) = p·e^(-a/τ) / (1 - p + p·e^(-a/τ))`` (Bayes: it may be one
that never returns), and a rank expects ``λ = Σ π(a)/τ`` returns per unit of time over its open
entries. Traffic without sessions (every prompt new) opens entries that never close: ``p`` falls
towards 0 and with it every rank's rate — nothing is expected anywhere in particular.

A rank's rate is computed over its open entries when asked and kept for ``τ/16`` (it moves on the
scale of ``τ``); an entry opened or closed meanwhile adds or takes away its own ``π/τ`` at once.
Recomputing it at every change instead cost O(entries) at every request's end: traffic without
sessions keeps thousands open per rank, and the router spent a third of its time here under load
(docs/decisions.md 123). Entries are dropped once ``π`` is negligible (after ``HORIZON_DELAYS·τ``)
or beyond ``MAX_OPEN``, oldest first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

WorkerKey = tuple[int, int]

PRIOR_DELAY_S = 5.0  # τ until returns are seen
PRIOR_FRACTION = 0.5  # p until finished requests are seen
PRIOR_WEIGHT = 8.0  # how many observations each prior is worth
DELAY_MEMORY = 64.0  # τ is a running mean over about this many returns
FRACTION_TIME_CONSTANT_S = 300.0  # p counts finishes and returns, exponentially decayed
MAX_OPEN = 1 << 16
HORIZON_DELAYS = 8.0  # an entry older than this many τ is dropped


def _posterior(x: float, p: float, odds: float) -> float:
    """π of an entry ``x`` delays old (``odds`` = (1 - p) / p): p when new, 1 / (1 + odds·e^x) after,
    nothing past ``4·HORIZON_DELAYS`` (π < e^-30 there, and e^x would overflow later on)."""
    if x <= 0.0:
        return p
    if x >= HORIZON_DELAYS * 4:
        return 0.0
    return 1.0 / (1.0 + odds * math.exp(x))


class Returns:
    """Open entries (finished requests not yet seen back) and each rank's expected return rate."""

    __slots__ = ("_cache", "_delay_n", "_delay_s", "_finished", "_open", "_ranks", "_returned",
                 "_seen_at")

    def __init__(self) -> None:
        self._open: dict[int, tuple[WorkerKey, float]] = {}  # hash → (rank, finished at), oldest first
        self._ranks: dict[WorkerKey, dict[int, float]] = {}  # rank → its open entries
        self._cache: dict[WorkerKey, tuple[float, float]] = {}  # rank → (rate, computed at)
        self._delay_s = PRIOR_DELAY_S
        self._delay_n = 0.0
        self._finished = 0.0  # finishes and returns, exponentially decayed to _seen_at
        self._returned = 0.0
        self._seen_at = 0.0

    def __len__(self) -> int:
        return len(self._open)

    # -- the estimates --------------------------------------------------------------------------

    @property
    def delay_s(self) -> float:
        """τ: the mean delay between a request's end and its return, in seconds."""
        return self._delay_s

    @property
    def fraction(self) -> float:
        """p: the fraction of finished requests that come back."""
        return (self._returned + PRIOR_FRACTION * PRIOR_WEIGHT) / (self._finished + PRIOR_WEIGHT)

    def rate(self, key: WorkerKey, now: float) -> float:
        """Returns expected at the rank per ms from ``now`` (router.cost.time's λ)."""
        entries = self._ranks.get(key)
        if not entries:
            return 0.0
        tau = self._delay_s
        cached = self._cache.get(key)
        if cached is not None and 0.0 <= now - cached[1] < tau / 16:
            return cached[0]
        p = self.fraction
        odds = (1.0 - p) / p
        rate = sum(_posterior((now - at) / tau, p, odds) for at in entries.values()) / (tau * 1000.0)
        self._cache[key] = (rate, now)
        return rate

    def _shift(self, key: WorkerKey, at: float, now: float, sign: float) -> None:
        """A kept rate of ``key`` with the entry that finished at ``at`` added (+1) or taken
        away (-1) as of ``now``; it stays due for its recomputation when it was."""
        cached = self._cache.get(key)
        if cached is not None:
            p, tau = self.fraction, self._delay_s
            rate = cached[0] + sign * _posterior((now - at) / tau, p, (1.0 - p) / p) / (tau * 1000.0)
            self._cache[key] = (max(rate, 0.0), cached[1])

    def status(self) -> dict[str, float]:
        """What the router's status and /metrics show of it."""
        return {"open": float(len(self._open)), "delay_s": self._delay_s, "fraction": self.fraction}

    # -- events -----------------------------------------------------------------------------------

    def finished(self, key: WorkerKey, hashes: Sequence[int], now: float) -> None:
        """A request that ran on ``key`` ended at ``now``; ``hashes`` are its prompt's chain hashes
        at the rank's block size (a prompt of less than one block opens nothing)."""
        if not hashes:
            return
        self._count(now, finished=1.0)
        h = hashes[-1]
        old = self._open.pop(h, None)
        if old is not None:  # the same prompt again: one entry, the newest
            self._close(old[0], h, now)
        self._open[h] = (key, now)
        self._ranks.setdefault(key, {})[h] = now
        self._shift(key, now, now, 1.0)
        self._expire(now)

    def arrived(self, hashes: Sequence[int], at: float) -> WorkerKey | None:
        """A request that arrived at ``at`` with these chain hashes (its rank's block size): if
        it is the return of an open entry (its prompt holds the entry's hash) the entry closes;
        the rank it was open on, else None. The longest such prefix wins (a conversation's newest
        turn)."""
        entry = self.arrived_entry(hashes, at)
        return entry[0] if entry is not None else None

    def arrived_entry(self, hashes: Sequence[int], at: float) -> tuple[WorkerKey, int] | None:
        """:meth:`arrived`, answering the closed entry's (rank, hash)."""
        open_ = self._open
        if not open_:
            return None
        h = next((h for h in reversed(hashes) if h in open_), None)
        if h is None:
            return None
        key = self.closed(h, at)
        return (key, h) if key is not None else None

    def closed(self, h: int, at: float) -> WorkerKey | None:
        """The entry ``h`` came back at ``at`` (here, or at a peer router: router.peers): close it
        and count the return; its rank, or None when it is not open here."""
        entry = self._open.pop(h, None)
        if entry is None:
            return None
        key, finished_at = entry
        self._close(key, h, at)
        self._count(at, returned=1.0)
        delay = at - finished_at
        if delay >= 0:
            self._delay_n = min(self._delay_n + 1.0, DELAY_MEMORY)
            w = 1.0 / (self._delay_n + PRIOR_WEIGHT)
            self._delay_s = max(self._delay_s + w * (delay - self._delay_s), 1e-3)
        return key

    def forget(self, keys: Iterable[WorkerKey]) -> None:
        """Ranks that left expect nothing any more; their entries stay open (the sessions may
        come back elsewhere, and still count as returns)."""
        for key in keys:
            self._ranks.pop(key, None)
            self._cache.pop(key, None)

    # -- internals -------------------------------------------------------------------------------

    def _close(self, key: WorkerKey, h: int, now: float) -> None:
        entries = self._ranks.get(key)
        if entries is not None:
            at = entries.pop(h, None)
            if not entries:
                del self._ranks[key]
                self._cache.pop(key, None)
            elif at is not None:
                self._shift(key, at, now, -1.0)

    def _count(self, now: float, *, finished: float = 0.0, returned: float = 0.0) -> None:
        age = now - self._seen_at
        if age > 0:
            decay = math.exp(-age / FRACTION_TIME_CONSTANT_S)
            self._finished *= decay
            self._returned *= decay
            self._seen_at = now
        self._finished += finished
        self._returned += returned

    def _expire(self, now: float) -> None:
        """Drop the oldest entries past the horizon or beyond the cap."""
        open_ = self._open
        horizon = now - HORIZON_DELAYS * self._delay_s
        while open_:
            h = next(iter(open_))
            key, at = open_[h]
            if at >= horizon and len(open_) <= MAX_OPEN:
                break
            del open_[h]
            self._close(key, h, now)
