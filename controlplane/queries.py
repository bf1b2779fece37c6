"""Read side of the admin API: documents, history, routers and workers, as JSON-ready dicts."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from controlplane.eventlog import PolicyLog, StoredEvent
from controlplane.fleet import FleetView
from controlplane.protocol.events import RouterStatus, doc_key
from controlplane.protocol.policy import PolicyKind


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _router_view(router: RouterStatus, model: str, kind: PolicyKind, head: int) -> dict[str, Any]:
    applied = router.applied.get(doc_key(model, kind))
    return {
        "router_id": router.router_id,
        "applied_revision": applied.revision if applied else 0,
        "effective": applied.effective if applied else router.startup.get(kind.value, {}),
        "in_sync": (applied.revision if applied else 0) == head,
        "last_nack": applied.last_nack if applied else None,
        "last_nack_revision": applied.last_nack_revision if applied else None,
    }


def _event_view(stored: StoredEvent) -> dict[str, Any]:
    ev = stored.event
    if ev is None:
        return {"revision": stored.revision, "event_id": stored.msg_id, "op": None, "error": stored.error}
    return {
        "revision": stored.revision, "event_id": str(ev.event_id), "op": ev.op.value,
        "expected_revision": ev.expected_revision, "actor": ev.actor, "at": _iso(ev.at),
        "changes": ev.changes, "document": ev.document, "rollback_to": ev.rollback_to,
        "request_id": ev.request_id, "signed_by": stored.signed_by,
    }


class Queries:
    def __init__(self, log_: PolicyLog, fleet: FleetView) -> None:
        self.log = log_
        self.fleet = fleet

    async def _document(self, model: str, kind: PolicyKind) -> dict[str, Any]:
        head = await self.log.head(model, kind)
        revision = head.revision if head else 0
        ev = head.event if head else None
        return {
            "model": model, "kind": kind.value, "revision": revision,
            "document": dict(ev.document) if ev else {},
            "updated_at": _iso(ev.at) if ev else None, "actor": ev.actor if ev else None,
            "routers": [_router_view(r, model, kind, revision) for r in self.fleet.live_routers(model)],
        }

    async def documents(self, model: str | None = None) -> list[dict[str, Any]]:
        if model is not None:
            return [await self._document(model, kind) for kind in PolicyKind]
        keys = {(m, k) for m, k, _ in await self.log.documents()}
        for router in self.fleet.live_routers():
            keys.update((m, k) for m in router.models for k in PolicyKind)
        return [await self._document(m, k) for m, k in sorted(keys)]

    async def history(self, model: str, kind: PolicyKind, limit: int = 64) -> list[dict[str, Any]]:
        events = [_event_view(s) async for s in self.log.history(model, kind)]
        return list(reversed(events))[: max(limit, 0)]

    async def thresholds(self, model: str) -> dict[str, Any]:
        head = await self.log.head(model, PolicyKind.BUSY_THRESHOLD)
        return {
            "model": model, "revision": head.revision if head else 0,
            "thresholds": dict(head.event.document) if head and head.event else {},
        }

    async def routers(self, model: str | None = None) -> dict[str, Any]:
        routers = self.fleet.live_routers(model)
        heads: dict[str, int] = {}
        for router in routers:
            for m in router.models:
                for kind in PolicyKind:
                    key = doc_key(m, kind)
                    if key not in heads:
                        head = await self.log.head(m, kind)
                        heads[key] = head.revision if head else 0
        return {
            "routers": [
                {
                    "router_id": r.router_id, "models": r.models, "role": r.role.value, "mode": r.mode,
                    "url": r.url, "cache_inputs": [c.value for c in r.cache_inputs],
                    "applied": {k: v.model_dump() for k, v in r.applied.items()},
                    "startup": r.startup, "heartbeat_at": _iso(r.heartbeat_at),
                    "started_at": _iso(r.started_at),
                    "policy_resync": r.policy_resync.model_dump(mode="json") if r.policy_resync else None,
                    "calibration": [c.model_dump() for c in r.calibration],
                }
                for r in routers
            ],
            "heads": heads,
            # Status entries dropped as unusable (naive timestamp, key ≠ router_id, too large).
            "rejected": [{"key": k, "reason": why} for k, why in sorted(self.fleet.bad_routers.items())],
        }

    def workers(self, model: str | None = None) -> list[dict[str, Any]]:
        """Live workers; ``quarantined``: per live router that no longer believes a worker's
        claims, which (``cache``, ``timing``)."""
        quarantined: dict[int, list[dict[str, Any]]] = {}
        for router in self.fleet.live_routers(model):
            for q in router.quarantined:
                kinds = [k for k, on in (("cache", q.cache), ("timing", q.timing)) if on]
                quarantined.setdefault(q.instance_id, []).append({"router_id": router.router_id, "claims": kinds})
        return [
            {
                **w.worker.model_dump(mode="json"),
                "last_seen": _iso(self.fleet.last_seen(w.worker.instance_id) or w.at), "state": w.op.value,
                "load": [load.model_dump() for load in w.load],
                "quarantined": quarantined.get(w.worker.instance_id, []),
            }
            for w in self.fleet.live_workers(model)
        ]
