"""``GET /decisions/{request_id}``: the routers' sampled records of one request, asked over the
bus (request/reply on ``rudder.decisions.<router_id>``, one request per live router, at once), so
nothing is added to the routers' inference port. A router that does not answer in time is named
in ``unanswered``; a reply that names another router than the one asked is dropped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from bus.client import Bus
from controlplane.fleet import FleetView
from controlplane.protocol.errors import NotFound, RudderError
from controlplane.protocol.events import DecisionQuery, decode_decision_reply
from controlplane.protocol.subjects import decisions_subject

log = logging.getLogger(__name__)


class DecisionQueries:
    def __init__(self, bus: Bus, fleet: FleetView, *, wait_s: float = 1.0) -> None:
        self.bus = bus
        self.fleet = fleet
        self.wait_s = wait_s

    async def _ask(self, router_id: str, query: bytes) -> list[dict[str, Any]] | None:
        """The router's records ([] if it has none), or None when it did not answer."""
        try:
            msg = await self.bus.request(decisions_subject(router_id), query, wait_s=self.wait_s)
            reply = decode_decision_reply(msg.data)
        except RudderError as exc:
            log.info("router %s did not answer a decision query: %s", router_id, exc.message)
            return None
        if reply.router_id != router_id:
            log.warning("decision reply on %s names router %s: dropped", router_id, reply.router_id)
            return None
        return reply.decisions

    async def find(self, request_id: str) -> dict[str, Any]:
        """Every live router's records of ``request_id``. Raises NotFound when none has one."""
        query = DecisionQuery(request_id=request_id).to_bytes()
        routers = [r.router_id for r in self.fleet.live_routers()]
        answers = await asyncio.gather(*(self._ask(rid, query) for rid in routers))
        decisions = [d for found in answers if found for d in found]
        unanswered = [rid for rid, found in zip(routers, answers, strict=True) if found is None]
        if not decisions:
            raise NotFound(
                f"no router holds a decision record of request {request_id} (not sampled: "
                f"RUDDER_DECISION_SAMPLE; or dropped from the bounded log; "
                f"{len(unanswered)} of {len(routers)} routers did not answer)", field="request_id")
        decisions.sort(key=lambda d: d.get("at") or 0)
        return {"request_id": request_id, "decisions": decisions, "unanswered": unanswered}
