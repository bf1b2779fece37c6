"""Policy events bound to their place in the chain, and the restore answer (issue 17 item 3):
``router.policy_state`` alone, no network."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

from controlplane.protocol.events import PolicyRestored, SignedRestore
from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
from controlplane.protocol.signing import SigningKey
from controlplane.protocol.subjects import HDR_KEY_ID, HDR_SIGNATURE, restore_subject
from router.policy_state import Outcome, PolicyState, replay_reason
from tests.policy_keys import session_keys

SEL = PolicyKind.SELECTION
NONCE = "n" * 32


def _state() -> PolicyState:
    startup = {k: startup_values(k, cache_inputs=ALL_CACHE_INPUTS) for k in PolicyKind}
    return PolicyState(router_id="r-1", models=["m"], startup=startup, cache_inputs=ALL_CACHE_INPUTS,
                       keyring=session_keys().keyring)


def _event(temperature: float, *, expected: int) -> bytes:
    doc = {"router_temperature": temperature}
    return json.dumps({
        "event_id": str(uuid.uuid4()), "model": "m", "kind": "selection", "op": "patch",
        "expected_revision": expected, "changes": doc, "document": doc, "actor": "t",
        "request_id": "q", "at": datetime.now(UTC).isoformat(),
    }).encode()


def _apply(st: PolicyState, revision: int, payload: bytes, previous: int | None = None) -> Outcome:
    return st.apply("m", SEL, revision, payload, session_keys().headers_for("m", SEL, payload),
                    previous=previous).outcome


def test_replay_reason() -> None:
    assert replay_reason(4, 5, seen=4, previous=None) is None  # in its place
    assert replay_reason(9, 12, seen=5, previous=None) is None  # a gap, not a replay
    assert str(replay_reason(2, 12, seen=5, previous=None)).startswith("replayed:")  # behind seen
    assert replay_reason(2, 12, seen=0, previous=2) is None  # the stream says nothing between
    assert str(replay_reason(2, 12, seen=0, previous=3)).startswith("replayed:")  # 3 is between


def test_a_replayed_event_is_nacked_live_and_at_start() -> None:
    st = _state()
    first = _event(0.25, expected=0)
    assert _apply(st, 1, first) is Outcome.ACK
    assert _apply(st, 2, _event(0.5, expected=1)) is Outcome.ACK
    assert _apply(st, 3, first) is Outcome.NACK  # the same bytes again, later
    doc = st.get("m", SEL)
    assert str(doc.last_nack).startswith("replayed:") and doc.effective["router_temperature"] == 0.5
    fresh = _state()  # a router that starts with the replay as the head
    assert _apply(fresh, 3, first, previous=1) is Outcome.NACK
    assert fresh.get("m", SEL).revision == 0


def _answer(*, revision: int = 7, nonce: str = NONCE, router_id: str = "r-1",
            signer: SigningKey | None = None, temperature: float = 0.5) -> bytes:
    payload = PolicyRestored(router_id=router_id, model="m", kind=SEL, nonce=nonce, revision=revision,
                             document={"router_temperature": temperature}).to_bytes()
    headers = (signer or session_keys().signer).sign(restore_subject(router_id), payload)
    return SignedRestore(payload=payload.decode(), key_id=headers[HDR_KEY_ID],
                         signature=headers[HDR_SIGNATURE]).to_bytes()


def test_a_restore_answer_is_applied_only_when_signed_for_this_question() -> None:
    st = _state()
    assert _apply(st, 70, b"junk") is Outcome.NACK
    for bad in (_answer(nonce="x" * 32), _answer(router_id="r-2"), _answer(signer=SigningKey.generate()),
                b"not json"):
        assert st.restore("m", SEL, bad, nonce=NONCE).outcome is Outcome.NACK
    assert st.get("m", SEL).revision == 0
    result = st.restore("m", SEL, _answer(), nonce=NONCE)
    assert result.outcome is Outcome.ACK and result.revision == 7
    doc = st.get("m", SEL)
    assert doc.revision == 7 and doc.effective["router_temperature"] == 0.5 and doc.seen == 70
    # Applied once: a document with a revision is not restored again.
    assert st.restore("m", SEL, _answer(temperature=0.9), nonce=NONCE).outcome is Outcome.SKIP
    # The next event continues the stream's chain (written on the junk head).
    assert _apply(st, 71, _event(0.75, expected=70)) is Outcome.ACK
