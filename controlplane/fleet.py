"""What the control plane knows of the fleet: live routers (``RUDDER_ROUTERS``), live workers
(``RUDDER_MEMBERSHIP``). Router ACK/NACKs are recorded by ``controlplane.acks``.

Background watchers keep an in-memory view so the write path's capability check costs no I/O.
A router is live while its status is younger than 3 heartbeats; a worker while its last
membership event is not ``leave`` and younger than the worker TTL. Ages use the bus's clock (when
NATS stored the entry), never a timestamp in the payload, so a stamp in the future cannot keep a
router or worker alive. An entry's age is the NATS server's time now less when it stored the
entry, the server's time being the newest receive time of an entry delivered live, projected on
the monotonic clock (:class:`controlplane.protocol.liveness.ServerTime`, B4's fix in the router's
discovery): a control plane whose wall clock runs ahead of the server's (+5 s, +1 h) does not
take every router and worker for dead, nor one behind take a replayed dead one for live; its
wall clock is used only until the first live entry. Ages run on a bus clock per stream
(:class:`controlplane.protocol.liveness.BusClock`) that counts only half a TTL of any silence of
the whole stream, for up to ``outage_grace_s``, so a JetStream node that dies (its watch restarts)
or a broker restart empties no view while every router and worker is fine; and while the
control plane knows the bus cannot store (:meth:`FleetView.bus_unhealthy`: its store probe
fails, B2), no silence counts past that half TTL at all: heartbeats cannot arrive, so their
absence says nothing, and the view keeps the last-known routers and workers.

Hostile input is dropped, logged once per source and counted (``self.drops``): a router status
whose key is not its ``router_id`` or that does not decode (a naive timestamp, a size past its
bound) is removed from the view and listed in :attr:`FleetView.bad_routers`, so it breaks no
query; a membership event or an ACK whose ids differ from its subject's is not used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from bus.client import Bus, KvWatch, Message, Subscription
from controlplane.protocol.errors import InvalidRequest, SubjectMismatch
from controlplane.protocol.events import (
    MembershipEvent,
    MembershipOp,
    RouterStatus,
    check_membership_subject,
    check_router_status_key,
    decode_membership_event,
    decode_router_status,
)
from controlplane.protocol.guard import Drops
from controlplane.protocol.liveness import BusClock, ServerTime
from controlplane.protocol.policy import CacheInput, PolicyKind, missing_cache_inputs
from controlplane.protocol.subjects import (
    BUCKET_ROUTERS,
    MEMBERSHIP_SUBJECTS,
    STREAM_MEMBERSHIP,
)

log = logging.getLogger(__name__)

class _Source:
    """One stream the view listens to: its bus clock and the server's time learnt from it."""

    def __init__(self, *, ttl_s: float, grace_s: float) -> None:
        self.ttl_s = ttl_s
        self.clock = BusClock(counted_s=ttl_s / 2, grace_s=grace_s)
        self.server = ServerTime(step_back_s=ttl_s)

    def seen(self, stored_at: datetime | None, *, mono: float, wall: datetime, live: bool,
             before: float | None) -> float:
        """Bus seconds at which an entry stored at ``stored_at`` (None: now) was current;
        ``live``: delivered as it was stored (not a replay), so it tells the server's time;
        ``before``: the sender's previous value, if any."""
        if live and stored_at is not None:
            self.server.learn(stored_at, mono, wall)
        age = self.server.age(stored_at, mono, wall)
        if not live and self.clock.holding:
            # While the bus cannot store, a watch restarted after the silence replays what it
            # holds: that is neither the stream heard (it would end the silence, and each
            # restart count half a TTL of it again) nor news of the sender (its age is in
            # seconds, not in held bus seconds). Otherwise a replay shows the bus answers: a
            # sender with no news since then ages by it.
            seen = self.clock.at(mono) - age
            return seen if before is None else max(before, seen)
        return self.clock.heard(mono) - age


def _reason(exc: InvalidRequest) -> str:
    return "subject_mismatch" if isinstance(exc, SubjectMismatch) else "malformed"


class FleetView:
    def __init__(self, bus: Bus, *, worker_ttl_s: float, router_heartbeat_s: float,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 monotonic: Callable[[], float] = time.monotonic,
                 outage_grace_s: float = 30.0,
                 probe_store: Callable[[], Awaitable[object]] | None = None) -> None:
        self.bus = bus
        # Asked before a watch restarted by a silence replays (it calls bus_unhealthy): whether
        # that silence is the bus's (hold the ages) or the fleet's (the replay re-dates them).
        self.probe_store = probe_store
        self.worker_ttl = timedelta(seconds=worker_ttl_s)
        self.router_ttl = timedelta(seconds=3 * router_heartbeat_s)
        self.stall_s = max(2.0, 2 * router_heartbeat_s)
        self.clock = clock  # wall clock: only until the first live entry of a stream
        self.monotonic = monotonic
        self._routers: dict[str, RouterStatus] = {}
        self._router_seen: dict[str, float] = {}  # bus seconds when the bus stored each status
        self._router_src = _Source(ttl_s=self.router_ttl.total_seconds(), grace_s=outage_grace_s)
        self._workers: dict[int, MembershipEvent] = {}
        self._worker_seen: dict[int, float] = {}
        self._worker_stored: dict[int, datetime] = {}  # when the bus stored each worker's last event
        self._worker_src = _Source(ttl_s=self.worker_ttl.total_seconds(), grace_s=outage_grace_s)
        self._membership_replayed = False  # the membership consumer delivered its replay
        self.holding = False  # the bus is known unable to store: ages held
        # Router status entries that could not be used: key → why (shown by GET /routers).
        self.bad_routers: dict[str, str] = {}
        self.drops = Drops(log)
        self._membership: Subscription | None = None

    async def start(self) -> None:
        """Subscribe to membership; the router watch is :meth:`watch_routers`, a task of the
        control plane's lifespan."""
        self._membership_replayed = False
        self._membership = await self.bus.ordered(STREAM_MEMBERSHIP, [MEMBERSHIP_SUBJECTS], self._on_membership)

    def bus_unhealthy(self, unhealthy: bool) -> None:
        """The bus cannot store (True) or can again (False): hold every age meanwhile."""
        if unhealthy != self.holding:
            log.warning("fleet view: the bus %s; %s", "cannot store" if unhealthy else "stores again",
                        "holding router and worker ages" if unhealthy else "ages run again")
        self.holding = unhealthy
        now = self.monotonic()
        self._router_src.clock.hold(now, unhealthy)
        self._worker_src.clock.hold(now, unhealthy)

    def quiet(self) -> bool:
        """Whether a stream that was heard has been silent past half its TTL (the moment a
        silence starts to age entries: worth asking whether the bus can store), and not yet
        past the outage grace (a silence that long with the bus storing is a fleet that left:
        no probe every second for ever)."""
        now = self.monotonic()
        return any(src.clock.heard_at is not None
                   and src.ttl_s / 2 < now - src.clock.heard_at <= src.clock.grace_s + src.ttl_s
                   for src in (self._router_src, self._worker_src))

    async def stop(self) -> None:
        if self._membership is not None:
            await self._membership.stop()
            self._membership = None

    async def watch_routers(self) -> None:
        """Until cancelled: keep the router view from the ``RUDDER_ROUTERS`` bucket."""
        while True:
            watcher: KvWatch | None = None
            live = False  # the initial values (a replay) come first, then the marker
            try:
                watcher = await (await self.bus.bucket(BUCKET_ROUTERS)).watch_all()
                while True:
                    try:
                        # Routers write every heartbeat: silence this long means the watch's
                        # consumer went with a JetStream node; start a new one.
                        entry = await watcher.next(wait_s=self.stall_s)
                    except TimeoutError:
                        log.info("router watch silent for %.1fs; restarting it", self.stall_s)
                        if self.probe_store is not None and self._routers:
                            # The replay that follows is taken as the bus answering unless the
                            # view holds: settle that first. Before, a watch restarted in a full
                            # disk's silence could replay ahead of the periodic probe's verdict
                            # and re-date the routers' statuses by the server's clock: they aged
                            # out while the view then held every age (test_full_disk_fleet, 1 run
                            # in 2). With no router known there is nothing to re-date: no probe
                            # write every restart of an empty fleet's watch.
                            await self.probe_store()
                        break
                    if entry is None:
                        live = True
                        continue
                    if entry.deleted:
                        self._forget_router(entry.key)
                        self.bad_routers.pop(entry.key, None)
                        continue
                    self._on_router_status(entry.key, entry.value, entry.stored_at, live=live)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS restart, bucket not created yet: retry
                log.debug("router watch restarting: %s", exc)
                await asyncio.sleep(1.0)
            finally:
                if watcher is not None:
                    await watcher.stop()

    def _forget_router(self, key: str) -> None:
        self._routers.pop(key, None)
        self._router_seen.pop(key, None)

    def _on_router_status(self, key: str, value: bytes, stored_at: datetime | None, *,
                          live: bool = False) -> None:
        try:
            status = decode_router_status(value)
            check_router_status_key(key, status)
        except InvalidRequest as exc:
            # The router's newest status is unusable: it is not shown as live (its old status
            # would be stale information) and is flagged instead.
            self._forget_router(key)
            self.bad_routers[key] = exc.message
            self.drops.drop("router_status", _reason(exc), f"key {key}", exc.message)
            return
        self.bad_routers.pop(key, None)
        self._routers[key] = status
        self._router_seen[key] = self._router_src.seen(stored_at, mono=self.monotonic(), wall=self.clock(),
                                                       live=live, before=self._router_seen.get(key))

    async def _on_membership(self, msg: Message) -> None:
        live = self._membership_replayed
        if msg.pending == 0:
            self._membership_replayed = True  # the last state of every worker is delivered
        self.on_membership(msg, live=live)

    def on_membership(self, msg: Message, *, live: bool) -> None:
        """One membership event; ``live``: delivered as stored (after the consumer's replay)."""
        try:
            event = decode_membership_event(msg.data)
            check_membership_subject(msg.subject, event)
        except InvalidRequest as exc:
            self.drops.drop("membership", _reason(exc), msg.subject, exc.message)
            return
        stored_at = msg.stored_at
        wid = event.worker.instance_id
        mono, wall = self.monotonic(), self.clock()
        self._workers[wid] = event
        self._worker_seen[wid] = self._worker_src.seen(stored_at, mono=mono, wall=wall, live=live,
                                                       before=self._worker_seen.get(wid))
        server_now = self._worker_src.server.now(mono, wall)
        self._worker_stored[wid] = min(stored_at or server_now, server_now)

    # ---- queries (no I/O) ----------------------------------------------------------------

    def live_routers(self, model: str | None = None) -> list[RouterStatus]:
        now = self._router_src.clock.at(self.monotonic())
        ttl = self.router_ttl.total_seconds()
        return sorted(
            (
                r for key, r in self._routers.items()
                if now - self._router_seen[key] <= ttl
                and (model is None or model in r.models)
            ),
            key=lambda r: r.router_id,
        )

    def live_workers(self, model: str | None = None) -> list[MembershipEvent]:
        now = self._worker_src.clock.at(self.monotonic())
        ttl = self.worker_ttl.total_seconds()
        return sorted(
            (
                w for wid, w in self._workers.items()
                if w.op is not MembershipOp.LEAVE and now - self._worker_seen[wid] <= ttl
                and (model is None or w.worker.model == model)
            ),
            key=lambda w: (w.worker.model, w.worker.instance_id),
        )

    def last_seen(self, instance_id: int) -> datetime | None:
        """When the bus stored the worker's last membership event."""
        return self._worker_stored.get(instance_id)

    def serves(self, model: str) -> bool:
        return bool(self.live_routers(model) or self.live_workers(model))

    def capability_violations(self, model: str, kind: PolicyKind,
                              document: dict[str, Any]) -> dict[str, list[str]]:
        """``{router_id: [weights it cannot feed]}`` among live routers serving ``model``."""
        out: dict[str, list[str]] = {}
        for router in self.live_routers(model):
            missing = missing_cache_inputs(kind, document, frozenset(CacheInput(c) for c in router.cache_inputs))
            if missing:
                out[router.router_id] = missing
        return out
