"""Signed policy events against real NATS and PostgreSQL (issue 7 item 2, DESIGN §9).

- A policy event published around the control plane, straight to JetStream (unsigned, signed by
  an unknown key, or signed by another key under the control plane's key id), is NACKed by every
  router with its reason code; the routers keep their last good values; the control plane will not
  build the next write on it; ``rudder audit reconcile`` reports it, and so does the metric of the
  periodic reconciliation. A router that starts afterwards refuses it in its start-up replay too,
  and runs the last document the control plane wrote (not its startup values).
- Rotation: while both keys are in the verify-keys file, events signed by the old and the new key
  are both applied (two control-plane replicas, one switched, one not yet); once the old key is
  retired from the file, the routers refuse it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS
from typer.testing import CliRunner

from bus.keyfiles import write_keyring, write_signing_key
from cli.embedded import EmbeddedNats
from cli.main import app as cli_app
from controlplane.audit.records import AuditEntry, AuditStage, Decision
from controlplane.audit.store import AuditStore
from controlplane.protocol.events import AckStatus, ApplyAck, PolicyEvent, decode_apply_ack
from controlplane.protocol.policy import PolicyKind, PolicyOp
from controlplane.protocol.signing import Keyring, SigningKey
from controlplane.protocol.subjects import (
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_KEY_ID,
    HDR_MSG_ID,
    HDR_SIGNATURE,
    STREAM_POLICY,
    policy_subject,
)
from tests import buskit
from tests.integration.cp_support import Tokens, client, controlplane
from tests.policy_keys import PolicyKeys, make_policy_keys
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = pytest.mark.timeout(120)
SELECTION = PolicyKind.SELECTION


@pytest.fixture
def keys(tmp_path: Path) -> PolicyKeys:
    """This test's own keypair (the rotation test rewrites its files)."""
    return make_policy_keys(tmp_path)


class Acks:
    """Every ACK/NACK routers publish, as the control plane receives them."""

    def __init__(self) -> None:
        self.seen: list[ApplyAck] = []

    async def on_msg(self, msg: Any) -> None:
        self.seen.append(decode_apply_ack(msg.data))

    def of(self, revision: int) -> dict[str, ApplyAck]:
        return {a.router_id: a for a in self.seen if a.revision == revision}

    async def wait(self, revision: int, routers: list[InProcessRouter]) -> dict[str, ApplyAck]:
        ids = {r.settings.router_id for r in routers}
        await wait_for(lambda: ids <= set(self.of(revision)), within=10)
        return self.of(revision)


@pytest.fixture
async def acks(nats_url: str) -> AsyncIterator[Acks]:
    nc = await buskit.admin_connect(nats_url)
    sink = Acks()
    await nc.subscribe("rudder.acks.>", cb=sink.on_msg)
    try:
        yield sink
    finally:
        await nc.close()


def _routers(nats_url: str, model: str, keys: PolicyKeys, n: int = 2) -> list[InProcessRouter]:
    return [InProcessRouter(router_settings(nats_url, model, policy_verify_keys=keys.verify_path))
            for _ in range(n)]


def _cp_keys(keys: PolicyKeys) -> dict[str, Any]:
    return {"policy_signing_key": keys.seed_path, "policy_verify_keys": keys.verify_path}


def _event(model: str, document: dict[str, float], expected: int) -> PolicyEvent:
    return PolicyEvent(
        event_id=uuid.uuid4(), model=model, kind=SELECTION, op=PolicyOp.PATCH, expected_revision=expected,
        changes=dict(document), document=dict(document), actor="operator-claimed-by-a-forger",
        request_id="forged", at=datetime.now(UTC))


async def publish_around(nc: NATS, event: PolicyEvent, signature: dict[str, str] | None) -> int:
    """Straight to JetStream around the control plane (on a connection with the bus admin's rights,
    i.e. NATS permissions bypassed), with CAS like the control plane."""
    subject = policy_subject(event.model, event.kind.value)
    headers = {HDR_EXPECTED_LAST_SUBJECT_SEQ: str(event.expected_revision), HDR_MSG_ID: str(event.event_id),
               **(signature or {})}
    ack = await nc.jetstream().publish(subject, event.to_bytes(), headers=headers)
    return int(ack.seq)


def effective(router: InProcessRouter, model: str) -> dict[str, Any]:
    doc = router.runtime.scheduler.policy.get(model, SELECTION)
    return {"revision": doc.revision, "temperature": doc.effective["router_temperature"],
            "last_nack": doc.last_nack}


async def patch(http: httpx.AsyncClient, model: str, expected: int, temperature: float) -> int:
    r = await http.patch("/router_policy", json={"model": model, "expected_revision": expected,
                                                 "parameters": {"router_temperature": temperature}})
    assert r.status_code == 200, r.text
    return int(r.json()["revision"])


def reconcile_cli(server: str, token: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli_app, ["--server", server, "--token", token, "--json", "audit", "reconcile"],
                                env={"RUDDER_TOKEN": None, "RUDDER_SERVER": None})
    return result.exit_code, json.loads(result.stdout)


async def problems_metric(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("rudder_reconcile_problems{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


async def test_events_written_around_the_control_plane_are_nacked_and_reported(
        nats_url: str, db: str, tokens: Tokens, keys: PolicyKeys, acks: Acks, nc: NATS) -> None:
    model = f"sig/{uuid.uuid4().hex[:6]}"
    routers = [await r.start() for r in _routers(nats_url, model, keys)]
    late: InProcessRouter | None = None
    try:
        async with controlplane(nats_url, db, reconcile_interval_s=0.3, **_cp_keys(keys)) as cp, \
                client(cp, tokens.operator) as op, client(cp, tokens.auditor) as auditor:
            good = await patch(op, model, 0, 0.5)
            assert all(a.status is AckStatus.ACK for a in (await acks.wait(good, routers)).values())
            stored = await nc.jetstream().get_msg(STREAM_POLICY, seq=good, direct=True)
            assert stored.headers[HDR_KEY_ID] == keys.signer.key_id and stored.headers[HDR_SIGNATURE]

            stranger = SigningKey.generate()
            claimed = stranger.sign  # signed by another key, claiming the control plane's key id
            forged_cases: list[tuple[str, Any]] = [
                ("signature_missing", lambda subject, payload: None),
                ("signature_unknown_key", stranger.sign),
                ("signature_invalid",
                 lambda subject, payload: {**claimed(subject, payload), HDR_KEY_ID: keys.signer.key_id}),
            ]
            expected, forged = good, []
            for code, sign in forged_cases:
                event = _event(model, {"router_temperature": 3.0}, expected)
                subject = policy_subject(model, SELECTION.value)
                revision = await publish_around(nc, event, sign(subject, event.to_bytes()))
                forged.append((revision, code))
                for rid, ack in (await acks.wait(revision, routers)).items():
                    assert ack.status is AckStatus.NACK, (rid, ack)
                    assert ack.detail.startswith(f"{code}:"), ack.detail
                    assert ack.event_id is None  # nothing of the forged payload is believed
                for router in routers:  # last good values kept
                    nack = acks.of(revision)[router.settings.router_id].detail
                    assert effective(router, model) == {"revision": good, "temperature": 0.5, "last_nack": nack}
                expected = revision

            # The control plane never builds a write on a document it did not sign: an ordinary
            # write gets 409 naming the forged head (which only a write naming it may replace).
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": good,
                                                        "parameters": {"router_temperature": 0.7}})
            assert r.status_code == 409 and r.json()["error"]["malformed_head"] is True, r.text
            assert "signature_invalid" in r.json()["error"]["message"], r.text
            head = (await nc.jetstream().stream_info(STREAM_POLICY)).state.last_seq
            assert head == expected  # nothing was published

            # The periodic reconciliation exports it as a metric ...
            async def metric_shows() -> bool:
                found = await problems_metric(auditor)
                return found.get("bad_signatures") == 3 and found.get("events_without_decision") == 3
            await wait_for(metric_shows, within=10)
            # ... and `rudder audit reconcile` reports each one, with its reason, and exits 1.
            code, report = await asyncio.to_thread(reconcile_cli, cp.url, tokens.auditor)
            assert code == 1 and report["ok"] is False
            assert sorted((b["revision"], b["reason_code"]) for b in report["bad_signatures"]) == forged
            assert {e["revision"] for e in report["events_without_decision"]} == {rev for rev, _ in forged}
            assert not report["document_mismatches"] and not report["reused_msg_ids"]

            # A router started now replays the last message of the subject: the forged head is
            # refused there too, so it runs neither the forger's values nor its startup values but
            # the last document the control plane wrote, which it asks the control plane for
            # (issue 17: before, it ran its startup values, revision 0 and temperature 0.0).
            late = await _routers(nats_url, model, keys, n=1)[0].start()
            last_rev, last_code = forged[-1]
            await wait_for(lambda: late is not None and late.settings.router_id in acks.of(last_rev), within=10)
            assert acks.of(last_rev)[late.settings.router_id].detail.startswith(last_code)
            await wait_for(lambda: late is not None and effective(late, model)["revision"] == good)
            assert effective(late, model)["temperature"] == 0.5

            # An audited write naming the forged head's revision replaces it; every router ACKs it.
            r = await op.patch("/router_policy", json={"model": model, "expected_revision": expected,
                                                        "parameters": {"router_temperature": 0.7}})
            assert r.status_code == 200, r.text
            fixed = r.json()["revision"]
            for rid, ack in (await acks.wait(fixed, [*routers, late])).items():
                assert ack.status is AckStatus.ACK, (rid, ack)
    finally:
        for r in [*routers, *([late] if late else [])]:
            await r.stop()


async def test_reconcile_reports_document_mismatch_and_reused_msg_id(
        own_nats: EmbeddedNats, db: str, tokens: Tokens, keys: PolicyKeys) -> None:
    """Properly signed is not enough: an event whose document is not what the audit log accepted,
    and an event id used twice on the stream (a replay once the duplicate window has passed) are
    both reported."""
    model = f"sig/{uuid.uuid4().hex[:6]}"
    subject = policy_subject(model, SELECTION.value)
    async with await buskit.admin_connect(own_nats.url) as nc:
        # A stream whose duplicate window is short, so that the test need not wait two minutes
        # for a replayed Nats-Msg-Id to be stored again (the bus admin may set it so).
        info = await nc.jetstream().stream_info(STREAM_POLICY)
        info.config.duplicate_window = 0.5
        await nc.jetstream().update_stream(info.config)
        async with controlplane(own_nats.url, db, **_cp_keys(keys)) as cp, client(cp, tokens.operator) as op, \
                client(cp, tokens.auditor) as auditor:
            good = await patch(op, model, 0, 0.5)
            stored = await nc.jetstream().get_msg(STREAM_POLICY, seq=good, direct=True)
            before = (await auditor.post("/audit/reconcile")).json()
            assert not before["document_mismatches"] and not before["reused_msg_ids"]

            # 1. The audit log accepted one document, the stream carries another under that id.
            event = _event(model, {"router_temperature": 0.8}, good)
            payload = event.to_bytes()
            ack = await nc.jetstream().publish(subject, payload, headers={
                HDR_EXPECTED_LAST_SUBJECT_SEQ: str(good), HDR_MSG_ID: str(event.event_id),
                **keys.signer.sign(subject, payload)})
            audit = AuditStore.from_url(db)
            try:
                await audit.append(AuditEntry(
                    event_id=event.event_id, stage=AuditStage.DECISION, decision=Decision.ACCEPTED,
                    reason_code="accepted", reason="test", actor="test", model=model, kind=SELECTION.value,
                    op="patch", expected_revision=good, new_revision=int(ack.seq), changes={},
                    after={"router_temperature": 0.6}))
            finally:
                await audit.close()

            # 2. The first event replayed verbatim (its signature is valid) after the window.
            await asyncio.sleep(0.6)  # the stream's duplicate window, set above, must pass
            replay = await nc.jetstream().publish(subject, stored.data, headers={
                HDR_MSG_ID: stored.headers[HDR_MSG_ID], HDR_KEY_ID: stored.headers[HDR_KEY_ID],
                HDR_SIGNATURE: stored.headers[HDR_SIGNATURE]})
            assert not replay.duplicate

            report = (await auditor.post("/audit/reconcile")).json()
            assert report["ok"] is False and not report["bad_signatures"]
            assert [(m["revision"], m["after"], m["document"]) for m in report["document_mismatches"]] == [
                (int(ack.seq), {"router_temperature": 0.6}, {"router_temperature": 0.8})]
            assert report["reused_msg_ids"] == [{"event_id": stored.headers[HDR_MSG_ID],
                                                 "revisions": [good, int(replay.seq)], "subject": subject}]


async def test_rotation_both_keys_valid_while_both_listed(
        nats_url: str, db: str, tokens: Tokens, keys: PolicyKeys, acks: Acks, tmp_path: Path) -> None:
    model = f"rot/{uuid.uuid4().hex[:6]}"
    old = keys.signer
    new = SigningKey.generate()
    routers = [await r.start() for r in _routers(nats_url, model, keys)]
    try:
        async with controlplane(nats_url, db, key_poll_s=0.1, **_cp_keys(keys)) as cp_a:
            # Step 1: the new public key joins the verify-keys file; routers re-read it on their tick.
            write_keyring(keys.verify_path, Keyring.of([old.public_key, new.public_key]))
            both = sorted([old.key_id, new.key_id])
            await wait_for(lambda: all(r.runtime.scheduler.policy.keyring.key_ids == both for r in routers))
            # Step 2: replica B already signs with the new key, replica A still with the old one.
            new_seed = tmp_path / "new.seed"
            write_signing_key(new_seed, new)
            async with controlplane(nats_url, db, policy_signing_key=new_seed,
                                    policy_verify_keys=keys.verify_path) as cp_b, \
                    client(cp_a, tokens.operator) as op_a, client(cp_b, tokens.operator) as op_b:
                revision = 0
                for i, (http, signer) in enumerate([(op_a, old), (op_b, new), (op_a, old), (op_b, new)]):
                    revision = await patch(http, model, revision, 0.1 * (i + 1))
                    for ack in (await acks.wait(revision, routers)).values():
                        assert ack.status is AckStatus.ACK, ack.detail
                    for router in routers:
                        assert effective(router, model)["revision"] == revision
                    stored = await cp_a.controlplane.log.get(model, SELECTION, revision)
                    assert stored is not None and stored.signed_by == signer.key_id
                # Step 3: replica A switches by rewriting its seed file; no restart.
                write_signing_key(keys.seed_path, new)
                await wait_for(lambda: cp_a.controlplane.log.signer.key_id == new.key_id)
                revision = await patch(op_a, model, revision, 0.9)
                stored = await cp_a.controlplane.log.get(model, SELECTION, revision)
                assert stored is not None and stored.signed_by == new.key_id
                assert all(a.status is AckStatus.ACK for a in (await acks.wait(revision, routers)).values())
                history = (await op_a.get("/router_policy/history", params={"model": model})).json()
                items = history["revisions"]
                assert [e["signed_by"] for e in items] == [new.key_id, new.key_id, old.key_id, new.key_id,
                                                           old.key_id]
            # Step 4: the old key is retired from the file; an event it signs is refused now.
            write_keyring(keys.verify_path, Keyring.of([new.public_key]))
            await wait_for(lambda: all(r.runtime.scheduler.policy.keyring.key_ids == [new.key_id]
                                       for r in routers))
            async with await buskit.admin_connect(nats_url) as nc:
                late_old = _event(model, {"router_temperature": 0.2}, revision)
                subject = policy_subject(model, SELECTION.value)
                stale = await publish_around(nc, late_old, old.sign(subject, late_old.to_bytes()))
            for ack in (await acks.wait(stale, routers)).values():
                assert ack.status is AckStatus.NACK and ack.detail.startswith("signature_unknown_key:")
            for router in routers:
                assert effective(router, model)["revision"] == revision
    finally:
        for r in routers:
            await r.stop()
