"""Bookings: load this router has put on each worker rank and not yet seen finish. Pure.

A request is booked with its selection (prefill tokens still to compute + its blocks), its prefill
tokens are released at the first token, and it is freed at completion, error or cancel (DESIGN §5).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

WorkerKey = tuple[int, int]


@dataclass(slots=True)
class Booking:
    request_id: str
    key: WorkerKey
    model: str
    prefill_tokens: int
    hashes: tuple[int, ...]
    booked_at: float = 0.0  # the scheduler's clock (monotonic seconds)
    prefill_released: bool = False


@dataclass(slots=True)
class RankBookings:
    prefill_tokens: int = 0
    requests: int = 0
    blocks: Counter[int] = field(default_factory=Counter)

    @property
    def active_blocks(self) -> int:
        return len(self.blocks)


class Bookings:
    def __init__(self) -> None:
        self._by_request: dict[str, Booking] = {}
        self._by_key: dict[WorkerKey, RankBookings] = {}
        # Bumped by every change (what router.peersync publishes only when it moved).
        self.version = 0

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def book(
        self, request_id: str, key: WorkerKey, *, model: str, prefill_tokens: int,
        hashes: Sequence[int], at: float = 0.0,
    ) -> Booking:
        """Raises ValueError if the request id is already booked (a bug in the caller)."""
        if request_id in self._by_request:
            raise ValueError(f"request {request_id} is already booked")
        self.version += 1
        booking = Booking(request_id, key, model, prefill_tokens, tuple(hashes), at)
        self._by_request[request_id] = booking
        rank = self._by_key.get(key)
        if rank is None:
            rank = self._by_key[key] = RankBookings()
        rank.prefill_tokens += prefill_tokens
        rank.requests += 1
        rank.blocks.update(booking.hashes)
        return booking

    def first_token(self, request_id: str) -> Booking | None:
        booking = self._by_request.get(request_id)
        if booking is None or booking.prefill_released:
            return None
        booking.prefill_released = True
        self.version += 1
        self._by_key[booking.key].prefill_tokens -= booking.prefill_tokens
        return booking

    def free(self, request_id: str) -> Booking | None:
        booking = self._by_request.pop(request_id, None)
        if booking is None:
            return None
        self.version += 1
        rank = self._by_key[booking.key]
        if not booking.prefill_released:
            rank.prefill_tokens -= booking.prefill_tokens
        rank.requests -= 1
        blocks = rank.blocks
        pop = blocks.pop
        for h in booking.hashes:  # one pass (Counter.subtract and its __delitem__ are Python)
            n = blocks.get(h, 0) - 1
            if n > 0:
                blocks[h] = n
            else:
                pop(h, None)
        if rank.requests == 0:
            del self._by_key[booking.key]
        return booking

    def drop_worker(self, instance_id: int) -> list[Booking]:
        dropped = [b for b in self._by_request.values() if b.key[0] == instance_id]
        for b in dropped:
            self.free(b.request_id)
        return dropped

    def rank(self, key: WorkerKey) -> RankBookings | None:
        return self._by_key.get(key)

    def keys(self) -> list[WorkerKey]:
        return list(self._by_key)
