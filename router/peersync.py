"""Router replicas share their bookings over core NATS (router.peers has the merge).

- Publishing: every ``interval_s`` the router asks its scheduler for its bookings per rank
  (:class:`~router.commands.TakeBookings`: nothing unless they changed since the last snapshot),
  with the expected-returns events since the last one (router.returns: requests finished here,
  entries a return seen here closed), and publishes the whole snapshot as a :class:`RouterLoad`
  on ``rudder.routerload.<router_id>``.
  So a burst of bookings costs one message per interval (coalesced), an idle router none; while
  it has bookings it re-sends them at least every ``keepalive_s`` (peers forget a replica that
  sent nothing for their ``peer_stale_s``). A graceful stop publishes an empty snapshot.
- Receiving: ``rudder.routerload.*``, its own subject skipped. A message past
  ``MAX_ROUTER_LOAD_BYTES`` is refused before decoding, one past its peer's rate
  (:class:`~router.claims.RateLimits`, on the subject) likewise; a payload that does not decode or
  names another router than its subject is refused; each is counted
  (``rudder_router_bus_dropped_total{kind="router_load"}``) and logged once per source. The rest
  becomes an :class:`~router.commands.ApplyPeerLoad`, applied between two selections.

Core NATS only (nothing stored): a lost snapshot costs a moment's accuracy, the next one replaces
it. NATS permissions let a router publish on its own subject only (bus.identities).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from bus.client import Bus, Message, Subscription
from controlplane.protocol import limits as L
from controlplane.protocol.errors import InvalidRequest, RudderError, SubjectMismatch
from controlplane.protocol.events import RouterLoad, check_router_load_subject, decode_router_load
from controlplane.protocol.guard import Drops
from controlplane.protocol.subjects import ROUTERLOAD_PREFIX, router_load_subject
from router.claims import RateLimits
from router.commands import ApplyPeerLoad, TakeBookings
from router.peers import Figures, Finished, Snapshot, WorkerKey
from router.scheduler import Scheduler

log = logging.getLogger(__name__)
KIND = "router_load"


def to_message(router_id: str, boot: str, seq: int, ranks: dict[WorkerKey, Figures],
               snapshot: Snapshot | None = None) -> RouterLoad:
    return RouterLoad(
        router_id=router_id, boot=boot, seq=seq,
        ranks=[(k[0], k[1], f.requests, f.prefill_tokens, f.blocks) for k, f in ranks.items()],
        finished=[(f.key[0], f.key[1], f.hash, round(f.age_s, 6)) for f in snapshot.finished] if snapshot else [],
        returned=list(snapshot.returned) if snapshot else [])


class LoadSharing:
    def __init__(self, bus: Bus, scheduler: Scheduler, *, router_id: str, interval_s: float,
                 keepalive_s: float, drops: Drops, limits: RateLimits,
                 count: Callable[[str], None] | None = None) -> None:
        self.bus = bus
        self.scheduler = scheduler
        self.router_id = router_id
        self.interval_s = interval_s
        self.keepalive_s = keepalive_s
        self.drops = drops
        self.limits = limits
        self.count = count  # "sent" / "received" (the process's metric)
        self.boot = secrets.token_hex(8)
        self.subject = router_load_subject(router_id)
        self._seq = 0
        self._sub: Subscription | None = None
        self._stopped = False
        self.sent = 0
        self.received = 0

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(f"{ROUTERLOAD_PREFIX}.*", self._on_msg)

    async def stop(self) -> None:
        """Stop reading peers and tell them this router's bookings are gone."""
        self._stopped = True
        if self._sub is not None:
            await self._sub.stop()
            self._sub = None
        try:
            await self._publish({})
        except RudderError as exc:
            log.info("last (empty) bookings snapshot not published: %s", exc.message)

    async def _publish(self, ranks: dict[WorkerKey, Figures], snapshot: Snapshot | None = None) -> None:
        self._seq += 1
        message = to_message(self.router_id, self.boot, self._seq, ranks, snapshot)
        await self.bus.publish(self.subject, message.to_bytes())
        self.sent += 1
        if self.count is not None:
            self.count("sent")

    async def run(self) -> None:
        """The publisher (a task of the router's lifespan); ends when the scheduler stops."""
        version = -1
        last_at = -float("inf")
        nonempty = False  # what peers last heard from us holds bookings
        while not self._stopped:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            keepalive = nonempty and now - last_at >= self.keepalive_s
            try:
                answer = await self.scheduler.call(TakeBookings(since=-1 if keepalive else version))
            except RudderError:
                return  # the scheduler is stopping
            if answer is None:
                continue
            version, ranks = answer.version, answer.ranks
            events = bool(answer.finished or answer.returned)
            if self._stopped or (not ranks and not nonempty and not events):
                continue  # stopping (the empty snapshot is sent); or nothing booked, and peers know it
            if len(ranks) > L.MAX_ROUTER_LOAD_RANKS:  # thousands of busy ranks: the busiest
                ranks = dict(sorted(ranks.items(), key=lambda kv: -kv[1].requests)[:L.MAX_ROUTER_LOAD_RANKS])
            try:
                await self._publish(ranks, answer)
            except RudderError as exc:
                log.debug("bookings snapshot not published: %s", exc.message)
                version = -1  # try again next interval
                continue
            last_at, nonempty = now, bool(ranks)

    async def _on_msg(self, msg: Message) -> None:
        if msg.subject == self.subject:
            return
        if len(msg.data) > L.MAX_ROUTER_LOAD_BYTES:
            self.drops.drop(KIND, "oversized", msg.subject,
                            f"{len(msg.data)} bytes, more than {L.MAX_ROUTER_LOAD_BYTES}")
            return
        if not self.limits.allow(msg.subject, time.monotonic()):
            self.drops.drop(KIND, "rate_limited", msg.subject, "bookings snapshots past the peer's rate")
            return
        try:
            load = decode_router_load(msg.data)
            check_router_load_subject(msg.subject, load)
        except InvalidRequest as exc:
            reason = "subject_mismatch" if isinstance(exc, SubjectMismatch) else "malformed"
            self.drops.drop(KIND, reason, msg.subject, exc.message)
            return
        self.received += 1
        if self.count is not None:
            self.count("received")
        ranks = {(i, r): Figures(n, p, b) for i, r, n, p, b in load.ranks}
        finished = [Finished((i, r), h, age) for i, r, h, age in load.finished]
        self.scheduler.send(ApplyPeerLoad(load.router_id, load.boot, load.seq, ranks, finished, list(load.returned)))
