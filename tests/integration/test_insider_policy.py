"""A stolen control-plane NATS credential without the signing key (issue 17 item 3), against real
NATS and PostgreSQL, real routers and a real control plane.

The attacker holds the control plane's ``.creds`` (it may publish on ``rudder.policy.>``) but
not its signing seed, so the only signed events it has are the old ones on the stream: it
publishes the bytes and headers of an old event again (without its ``Nats-Msg-Id``, so the
stream's duplicate window does not drop it), or junk.

- every router NACKs the replay (``replayed``) and keeps the last good values; one that starts
  with the replay as the head refuses it too (the stream says what precedes it);
- the control plane does not take the replay as its head: a write naming the last audited
  revision is refused (409, the intruder named), one naming the replay's revision replaces it and
  builds on the last audited document (no override is dropped), recorded
  ``replaced_unaudited_head``;
- ``rudder audit reconcile`` reports the replay (``replayed``, with the routers that refused it);
- 64 junk heads evict every good revision from the stream: the next write still keeps every
  override, and rollback reaches any revision through the audit log.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from bus.identities import Identity, IdentityKind
from controlplane.protocol.events import doc_key
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import HDR_KEY_ID, HDR_SIGNATURE, STREAM_POLICY, policy_subject
from tests import buskit
from tests.integration.cp_support import Tokens, client, controlplane
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = pytest.mark.timeout(120)
SELECTION = PolicyKind.SELECTION


async def replay(nats_url: str, nc: NATS, model: str, revision: int) -> int:
    """Publish the stored bytes and signature headers of ``revision`` again, with the control
    plane's NATS credential; returns the replay's revision."""
    old = await nc.jetstream().get_msg(STREAM_POLICY, seq=revision, direct=True)
    assert old.headers is not None
    headers = {HDR_KEY_ID: old.headers[HDR_KEY_ID], HDR_SIGNATURE: old.headers[HDR_SIGNATURE]}
    thief = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
    try:
        ack = await thief.jetstream().publish(policy_subject(model, SELECTION.value), old.data,
                                              headers=headers)
    finally:
        await thief.close()
    return int(ack.seq)


async def flood(nats_url: str, model: str, n: int) -> int:
    """``n`` unsigned junk messages on the document's subject (the control plane's credential);
    returns the last one's revision."""
    thief = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
    try:
        js = thief.jetstream()
        last = 0
        for i in range(n):
            last = int((await js.publish(policy_subject(model, SELECTION.value), b"junk %d" % i)).seq)
        return last
    finally:
        await thief.close()


def _applied(router: InProcessRouter, model: str) -> Any:
    return router.runtime.scheduler.view.applied[doc_key(model, SELECTION)]


async def test_a_replayed_signed_event_is_refused_everywhere_and_reported(
        nats_url: str, db: str, tokens: Tokens, nc: NATS) -> None:
    model = f"replay/{uuid.uuid4().hex[:6]}"
    router = await InProcessRouter(router_settings(nats_url, model, mode="round_robin")).start()
    late: InProcessRouter | None = None
    try:
        async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as op, \
                client(cp, tokens.auditor) as auditor:
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                        "parameters": {"router_temperature": 0.25}})
            assert r.status_code == 200, r.text
            first = r.json()["revision"]
            r = await op.patch("/router_policy", json={
                "model": model, "expected_revision": first,
                "parameters": {"router_temperature": 0.5, "decode_active_request_weight": 2.0}})
            assert r.status_code == 200, r.text
            good = r.json()["revision"]
            await wait_for(lambda: _applied(router, model).revision == good)

            replayed = await replay(nats_url, nc, model, first)
            await wait_for(lambda: _applied(router, model).last_nack_revision == replayed)
            applied = _applied(router, model)
            assert str(applied.last_nack).startswith("replayed:"), applied.last_nack
            assert applied.revision == good and applied.effective["router_temperature"] == 0.5

            # A router that starts now sees the replay as the head: refused there too.
            late = await InProcessRouter(router_settings(nats_url, model, mode="round_robin")).start()
            await wait_for(lambda: late is not None and _applied(late, model).last_nack_revision == replayed)
            assert str(_applied(late, model).last_nack).startswith("replayed:")
            assert _applied(late, model).effective["router_temperature"] != 0.25

            # The control plane does not build on it: naming the last audited revision is a 409
            # naming the intruder; naming the intruder replaces it, on the last audited document.
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": good,
                                                        "parameters": {"router_temperature": 0.75}})
            assert r.status_code == 409, r.text
            assert r.json()["error"]["head_revision"] == replayed
            assert r.json()["error"]["malformed_head"] is True
            assert "replayed" in r.json()["error"]["message"]
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": replayed,
                                                        "parameters": {"router_temperature": 0.75}})
            assert r.status_code == 200, r.text
            fixed = r.json()
            assert fixed["document"] == {"router_temperature": 0.75, "decode_active_request_weight": 2.0}
            await wait_for(lambda: _applied(router, model).revision == fixed["revision"])
            items = (await auditor.get("/audit", params={"model": model})).json()["items"]
            decision = next(i for i in items if i["event_id"] == fixed["event_id"] and i["stage"] == "decision")
            assert decision["reason_code"] == "replaced_unaudited_head"
            assert "replayed" in decision["reason"]

            # Reconcile reports the replay, with the routers that refused it.
            both = sorted([router.settings.router_id, late.settings.router_id])

            async def reported() -> bool:
                report = (await auditor.post("/audit/reconcile", json={})).json()
                found = [x for x in report["replayed"] if x["revision"] == replayed]
                return bool(found) and found[0].get("routers") == both
            await wait_for(reported, within=15)
            report = (await auditor.post("/audit/reconcile", json={})).json()
            assert report["ok"] is False
            assert str(next(x for x in report["replayed"] if x["revision"] == replayed)
                       ["detail"]).startswith("replayed:")

            # 64 junk heads evict every good revision from the stream's history: the next write
            # names the junk head and builds on the last audited document; rollback still reaches
            # any revision through its audit record.
            junk = await flood(nats_url, model, 64)
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": junk,
                                                        "parameters": {"router_temperature": 1.0}})
            assert r.status_code == 200, r.text
            assert r.json()["document"] == {"router_temperature": 1.0, "decode_active_request_weight": 2.0}
            with pytest.raises(NotFoundError):  # evicted from the stream's history
                await nc.jetstream().get_msg(STREAM_POLICY, seq=first, direct=True)
            r = await op.post("/router_policy/rollback", json={
                "model": model, "expected_revision": r.json()["revision"], "to_revision": first})
            assert r.status_code == 200, r.text
            assert r.json()["document"] == {"router_temperature": 0.25}
            back = r.json()["revision"]
            await wait_for(lambda: _applied(router, model).revision == back)
            assert _applied(router, model).effective["router_temperature"] == 0.25
    finally:
        await router.stop()
        if late is not None:
            await late.stop()


async def test_64_junk_heads_then_a_router_restart_runs_the_last_good_document(
        nats_url: str, db: str, tokens: Tokens) -> None:
    """Junk evicts every signed revision from the stream's history; the router that starts next
    asks the control plane (a signed answer to its nonce) instead of running its startup values,
    and the next write continues the chain."""
    model = f"junk/{uuid.uuid4().hex[:6]}"
    settings = router_settings(nats_url, model, mode="round_robin")
    router = await InProcessRouter(settings).start()
    try:
        async with controlplane(nats_url, db) as cp, client(cp, tokens.operator) as op:
            r = await op.patch("/router_policy", json={
                "model": model, "expected_revision": 0,
                "parameters": {"router_temperature": 0.5, "decode_active_request_weight": 2.0}})
            assert r.status_code == 200, r.text
            good = r.json()["revision"]
            await wait_for(lambda: _applied(router, model).revision == good)
            junk = await flood(nats_url, model, 64)
            await wait_for(lambda: _applied(router, model).last_nack_revision == junk)
            assert _applied(router, model).effective["router_temperature"] == 0.5  # it keeps them
            await router.stop()

            router = await InProcessRouter(settings).start()  # the same router, restarted
            await wait_for(lambda: _applied(router, model).last_nack_revision == junk)
            await wait_for(lambda: _applied(router, model).revision == good)
            applied = _applied(router, model)
            assert applied.effective["router_temperature"] == 0.5
            assert applied.effective["decode_active_request_weight"] == 2.0
            assert cp.controlplane.restore.answered >= 1

            r = await op.patch("/router_policy", json={"model": model, "expected_revision": junk,
                                                        "parameters": {"router_temperature": 0.75}})
            assert r.status_code == 200, r.text
            assert r.json()["document"] == {"router_temperature": 0.75, "decode_active_request_weight": 2.0}
            await wait_for(lambda: _applied(router, model).revision == r.json()["revision"])
    finally:
        await router.stop()
