"""A real router and a real control plane on one bus (issue 3): the control plane refuses a weight
a live cache-free router cannot feed; a document that reaches the router anyway (written around
the control plane) is NACKed, the router keeps its last good values, and the control plane shows
the NACK and its reason, in the policy listing and in the stored ACK history."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest

from bus.identities import Identity, IdentityKind
from controlplane.protocol.events import PolicyEvent
from controlplane.protocol.policy import PolicyKind, PolicyOp
from tests import buskit
from tests.integration.cp_support import Tokens, client, controlplane
from tests.policy_keys import session_keys
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = pytest.mark.timeout(120)


async def test_nack_of_a_cache_free_router_is_shown_by_the_control_plane(nats_url: str, db: str,
                                                                          tokens: Tokens) -> None:
    model = f"rr/{uuid.uuid4().hex[:6]}"
    router = await InProcessRouter(router_settings(nats_url, model, mode="round_robin")).start()
    rid = router.settings.router_id
    try:
        async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as op, \
                client(cp, tokens.auditor) as auditor:
            await wait_for(lambda: bool(cp.controlplane.fleet.live_routers(model)), within=10)
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                        "parameters": {"router_temperature": 0.25}})
            assert r.status_code == 200, r.text
            good = r.json()["revision"]
            # The write path refuses what this live router cannot feed, naming it.
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": good,
                                                        "parameters": {"host_cache_hit_weight": 0.5}})
            assert r.status_code == 422 and r.json()["error"]["routers"] == [rid], r.text
            # Written around the control plane, it reaches the router, which NACKs it.
            nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
            try:
                bad = (await session_keys().policy_log(nc).publish(PolicyEvent(
                    event_id=uuid.uuid4(), model=model, kind=PolicyKind.SELECTION, op=PolicyOp.PATCH,
                    expected_revision=good, changes={"host_cache_hit_weight": 0.5},
                    document={"router_temperature": 0.25, "host_cache_hit_weight": 0.5},
                    actor="around-the-control-plane", request_id="test", at=datetime.now(UTC)))).revision
            finally:
                await nc.close()

            async def shown() -> dict[str, object] | None:
                docs = (await op.get("/router_policy", params={"model": model})).json()["documents"]
                selection = next(d for d in docs if d["kind"] == "selection")
                mine = next((x for x in selection["routers"] if x["router_id"] == rid), None)
                return mine if mine and mine["last_nack"] else None

            view = None
            for _ in range(100):
                view = await shown()
                if view:
                    break
                await asyncio.sleep(0.05)
            assert view is not None
            assert "host_cache_hit_weight" in str(view["last_nack"])
            assert view["last_nack_revision"] == bad
            assert view["applied_revision"] == good and view["in_sync"] is False
            assert view["effective"]["router_temperature"] == 0.25  # type: ignore[index]
            assert view["effective"]["host_cache_hit_weight"] == 0.0  # type: ignore[index]
            acks: list[dict[str, object]] = []
            for _ in range(100):
                acks = (await auditor.get("/routers/acks", params={"router_id": rid})).json()["acks"]
                if any(a["revision"] == bad for a in acks):
                    break
                await asyncio.sleep(0.05)
            statuses = {a["revision"]: (a["status"], a["detail"]) for a in acks}
            assert statuses[good][0] == "ACK"
            assert statuses[bad][0] == "NACK" and "host_cache_hit_weight" in str(statuses[bad][1])
    finally:
        await router.stop()
