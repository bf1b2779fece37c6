"""What a worker may claim, bounded at the router (issue 17 items 1-2). Pure: clock passed in.

A worker's membership record, KV events and dumps are its own word: a stolen worker credential
could otherwise claim 1024 data-parallel ranks (1024 candidate slots: it draws every request),
blocks it never computed, or a timing model that costs nothing, and flood the router with
heartbeats and events. Without a capacity issued by the operator the router believes only
conservative bounds (:class:`ClaimCaps`, settings ``RUDDER_CLAIM_*``):

- ``dp_size`` above ``max_dp_size`` is cut to it (the load of ranks past it is ignored);
- ``kv_total_blocks`` above ``max_kv_blocks`` is cut to it, and the prefix index holds at most
  that many blocks of the worker (:meth:`router.index.PrefixIndex.set_capacity`);
- an advertised timing prior whose prefill or decode step is more than ``max_prior_speedup``
  times faster (or slower) than the router's own prior is not believed: the router's own prior
  is used instead (a zero-cost prior would otherwise make the worker the cheapest everywhere).

:class:`RateLimits` is a token bucket per source (a subject, which NATS binds to one identity):
membership messages past a worker's rate and KV events past its byte rate (the bytes of a message
bound what it can claim, and are known before decoding) are dropped at the edge, before decoding,
and counted; selection never waits for them. Dumps are asked of a worker at most once per
``RUDDER_KVDUMP_MIN_INTERVAL_S``.

:class:`CacheOutcomes` checks a worker's KV claims against what it delivers: the prefix cache hits
the router predicted from its ``stored`` events against the ``cached_tokens`` its answers report.
A worker whose predicted hits persistently exceed what it delivers (decayed sums: over
``min_predicted`` tokens predicted, less than ``min_ratio`` of them delivered) is quarantined: its
blocks leave the prefix index and its further claims are not indexed (it keeps serving, with no
cache credit), until it leaves or expires.

:class:`TimingOutcomes` does the same for a worker's timing prior: each answer's measured time to
first token against what the prior the worker claimed predicts for it (decayed sums). A worker
whose measured TTFT persistently exceeds ``max_ratio`` times the claimed prediction plus
``slack_ms`` a request loses its claimed prior: the router uses its own prior and, once it has
``calibration_min_samples`` answers, the timing it fitted from what it measured (the claimed prior
no longer pulls the fit toward it), until the worker leaves or expires.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass

from controlplane.protocol.events import MembershipEvent
from router.cost.time import DEFAULT_TIMING, Timing

# Reference step for comparing a prior with the router's own: a mid-sized prefill chunk and a
# decode step at half KV usage.
_REF_TOKENS = 512.0
_REF_USAGE = 0.5


@dataclass(frozen=True, slots=True)
class ClaimCaps:
    max_dp_size: int = 8
    max_kv_blocks: int = 262_144
    max_prior_speedup: float = 256.0
    # TimingOutcomes' bounds: measured TTFT above max_ratio x the claimed prior's prediction plus
    # slack_ms (network, HTTP, a busy host) per request, persistently.
    timing_max_ratio: float = 4.0
    timing_slack_ms: float = 20.0

    def timing_outcomes(self) -> TimingOutcomes:
        return TimingOutcomes(max_ratio=self.timing_max_ratio, slack_ms=self.timing_slack_ms)

    def cap(self, event: MembershipEvent) -> tuple[MembershipEvent, list[str]]:
        """The event with its record cut to the caps, and the names of the fields that were cut."""
        rec = event.worker
        update: dict[str, object] = {}
        if rec.dp_size > self.max_dp_size:
            update["dp_size"] = self.max_dp_size
        if rec.kv_total_blocks > self.max_kv_blocks:
            update["kv_total_blocks"] = self.max_kv_blocks
        if not update:
            return event, []
        worker = rec.model_copy(update=update)
        load = [r for r in event.load if r.dp_rank < worker.dp_size]
        return event.model_copy(update={"worker": worker, "load": load}), sorted(update)

    def prior(self, claimed: Timing) -> Timing:
        """The prior the router believes for a worker that advertised ``claimed``."""
        return claimed if self.believable(claimed) else DEFAULT_TIMING

    def believable(self, claimed: Timing) -> bool:
        r = self.max_prior_speedup
        pairs = (
            (claimed.prefill_step_ms(_REF_TOKENS), DEFAULT_TIMING.prefill_step_ms(_REF_TOKENS)),
            (claimed.decode_step_ms(_REF_USAGE), DEFAULT_TIMING.decode_step_ms(_REF_USAGE)),
        )
        return all(ref / r <= ms <= ref * r for ms, ref in pairs)

    def blocks_per_rank(self, kv_total_blocks: int, dp_size: int) -> int:
        """Blocks of one rank the prefix index may hold (the record is already capped)."""
        return max(1, min(kv_total_blocks, self.max_kv_blocks) // max(1, dp_size))


class RateLimits:
    """A token bucket per source: ``rate_per_s`` sustained, ``burst`` at once. Bounded: past
    ``max_sources`` tracked sources the oldest is forgotten (it starts again with a full bucket)."""

    def __init__(self, rate_per_s: float, burst: float, *, max_sources: int = 65_536) -> None:
        self.rate = rate_per_s
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: dict[str, tuple[float, float]] = {}  # source → (tokens, at)

    def allow(self, source: str, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens of ``source``'s bucket; False (take nothing) when it has fewer."""
        tokens, at = self._buckets.pop(source, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= cost
        if ok:
            tokens -= cost
        if len(self._buckets) >= self.max_sources:
            del self._buckets[next(iter(self._buckets))]
        self._buckets[source] = (tokens, now)  # most recently used last
        return ok


class CacheOutcomes:
    """Predicted against delivered cached tokens, per worker (decayed sums)."""

    def __init__(self, *, min_predicted: float = 1024.0, min_ratio: float = 0.5, decay: float = 0.95) -> None:
        self.min_predicted = min_predicted
        self.min_ratio = min_ratio
        self.decay = decay
        self._sums: dict[int, tuple[float, float]] = {}  # instance id → (predicted, delivered)
        self.quarantined: set[int] = set()

    def report(self, instance_id: int, predicted: int, delivered: int) -> bool:
        """One answer's figures; True when this report quarantines the worker."""
        if instance_id in self.quarantined:
            return False
        p, d = self._sums.get(instance_id, (0.0, 0.0))
        p = p * self.decay + max(predicted, 0)
        d = d * self.decay + min(max(delivered, 0), max(predicted, 0))  # over-delivery earns nothing
        self._sums[instance_id] = (p, d)
        if p >= self.min_predicted and d < self.min_ratio * p:
            self.quarantined.add(instance_id)
            return True
        return False

    def ratio(self, instance_id: int) -> float | None:
        """Delivered over predicted so far (None before any prediction)."""
        p, d = self._sums.get(instance_id, (0.0, 0.0))
        return d / p if p > 0 else None

    def forget(self, instance_id: int) -> None:
        self._sums.pop(instance_id, None)
        self.quarantined.discard(instance_id)


# Answers (of any worker) that a worker's peers' current delay is read from (TimingOutcomes).
RECENT = 64


class TimingOutcomes:
    """Measured TTFT against the claimed prior's prediction, per worker (decayed sums).

    What no prior models is also measured: the HTTP stacks at both ends and the event loops'
    lag, which grow with load on the router's host and the workers' (tens of ms past the slack
    at concurrency 32 on a shared 2-core host, where honest workers lost their priors). That
    delay comes and goes for a model's workers together, a lie stays with its worker: a worker
    is judged on its delay beyond its peers' *at the same time* (the median unexplained time of
    the other workers' answers among the last :data:`RECENT` reported, quarantined ones left
    out), and alone, as before, when none of them answered lately; and only when it stays past
    the bound for ``persist_s`` (docs/decisions.md 108)."""

    def __init__(self, *, max_ratio: float = 4.0, slack_ms: float = 20.0, min_weight: float = 8.0,
                 decay: float = 0.95, persist_s: float = 3.0) -> None:
        self.max_ratio = max_ratio
        # How long a worker's answers must read as slower than its claim, without a break, before
        # it loses it: answers that arrive together (a batch's first tokens after one stall of
        # its process) are one event, not many (decision 108).
        self.persist_s = persist_s
        self._since: dict[int, float] = {}  # instance id → since when, continuously, slower
        self.slack_ms = slack_ms
        self.min_weight = min_weight
        self.decay = decay
        self._sums: dict[int, tuple[float, float, float]] = {}  # instance id → (weight, predicted, measured)
        self._recent: deque[tuple[int, float]] = deque(maxlen=RECENT)  # (instance id, measured - predicted)
        self.quarantined: set[int] = set()

    def report(self, instance_id: int, predicted_ms: float, measured_ms: float, *, now: float,
               peers: Container[int] = ()) -> bool:
        """One answer's figures at ``now`` (seconds); True when this report takes the worker's
        claimed prior away. ``peers``: the workers of its model (asked only about those among the
        recent answers)."""
        if instance_id in self.quarantined or not (measured_ms >= 0 and predicted_ms >= 0):
            return False  # (NaN fails both comparisons)
        w, p, m = self._sums.get(instance_id, (0.0, 0.0, 0.0))
        d = self.decay
        w, p, m = w * d + 1.0, p * d + predicted_ms, m * d + measured_ms
        self._sums[instance_id] = (w, p, m)
        self._recent.append((instance_id, measured_ms - predicted_ms))
        if w < self.min_weight or m <= self.max_ratio * p + (self.slack_ms + self.shared_ms(instance_id, peers)) * w:
            self._since.pop(instance_id, None)
            return False
        if now - self._since.setdefault(instance_id, now) < self.persist_s:
            return False
        del self._since[instance_id]
        self.quarantined.add(instance_id)
        return True

    def shared_ms(self, instance_id: int, peers: Container[int]) -> float:
        """The delay beyond their claimed priors that ``instance_id``'s peers see now: the median
        of their answers' among the last :data:`RECENT` reported, at least 0; 0 when none of
        them (not quarantined) answered lately."""
        delays = sorted(d for j, d in self._recent
                        if j != instance_id and j not in self.quarantined and j in peers)
        if not delays:
            return 0.0
        mid = len(delays) // 2
        median = delays[mid] if len(delays) % 2 else (delays[mid - 1] + delays[mid]) / 2
        return max(median, 0.0)

    def ratio(self, instance_id: int) -> float | None:
        """Measured over predicted so far (None before any prediction above 0)."""
        _, p, m = self._sums.get(instance_id, (0.0, 0.0, 0.0))
        return m / p if p > 0 else None

    def forget(self, instance_id: int) -> None:
        self._sums.pop(instance_id, None)
        self._recent = deque(((j, d) for j, d in self._recent if j != instance_id), maxlen=RECENT)
        self._since.pop(instance_id, None)
        self.quarantined.discard(instance_id)
