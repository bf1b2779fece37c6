"""Policy event signatures (DESIGN §9): the pure signing module and the router's policy state."""

from __future__ import annotations

import json
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bus.keyfiles import (
    KeyringFile,
    SigningKeyFile,
    load_keyring,
    load_signing_key,
    write_keyring,
    write_signing_key,
)
from controlplane.protocol.errors import KeyFileInvalid, SignatureInvalid
from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
from controlplane.protocol.signing import (
    SIGNATURE_INVALID,
    SIGNATURE_MISSING,
    SIGNATURE_UNKNOWN_KEY,
    Keyring,
    SigningKey,
    format_keyring,
    key_id,
    parse_keyring,
)
from controlplane.protocol.subjects import HDR_KEY_ID, HDR_SIGNATURE, policy_subject
from router.policy_state import Outcome, PolicyState
from router.settings import RouterSettings

SUBJECT = policy_subject("m", "selection")


def _event(doc: dict[str, float], *, expected: int = 0) -> bytes:
    return json.dumps({
        "event_id": str(uuid.uuid4()), "model": "m", "kind": "selection", "op": "patch",
        "expected_revision": expected, "changes": doc, "document": doc, "actor": "t",
        "request_id": "q", "at": datetime.now(UTC).isoformat(),
    }).encode()


def test_sign_and_verify_over_subject_and_exact_bytes() -> None:
    key = SigningKey.generate()
    ring = Keyring.of([key.public_key])
    payload = b'{"a": 1}'
    headers = key.sign(SUBJECT, payload)
    assert set(headers) == {HDR_KEY_ID, HDR_SIGNATURE} and headers[HDR_KEY_ID] == key.key_id
    assert ring.verify(SUBJECT, payload, headers) == key.key_id
    # One byte more, or the same bytes on another document's subject: refused.
    with pytest.raises(SignatureInvalid) as bad:
        ring.verify(SUBJECT, payload + b" ", headers)
    assert bad.value.reason_code == SIGNATURE_INVALID
    with pytest.raises(SignatureInvalid) as moved:
        ring.verify(policy_subject("other", "selection"), payload, headers)
    assert moved.value.reason_code == SIGNATURE_INVALID


@pytest.mark.parametrize(("headers", "code"), [
    (None, SIGNATURE_MISSING),
    ({}, SIGNATURE_MISSING),
    ({HDR_KEY_ID: "abc"}, SIGNATURE_MISSING),
    ({HDR_KEY_ID: "0123456789abcdef", HDR_SIGNATURE: "AAAA"}, SIGNATURE_UNKNOWN_KEY),
    ("garbage-signature", SIGNATURE_INVALID),
    ("short-signature", SIGNATURE_INVALID),
])
def test_every_bad_signature_has_its_reason_code(headers: object, code: str) -> None:
    key = SigningKey.generate()
    ring = Keyring.of([key.public_key])
    if headers == "garbage-signature":
        headers = {HDR_KEY_ID: key.key_id, HDR_SIGNATURE: "not base64!"}
    elif headers == "short-signature":
        headers = {HDR_KEY_ID: key.key_id, HDR_SIGNATURE: "AAAA"}
    with pytest.raises(SignatureInvalid) as exc:
        ring.verify(SUBJECT, b"{}", headers)  # type: ignore[arg-type]
    assert exc.value.reason_code == code


def test_a_signature_by_another_key_with_a_known_key_id_does_not_verify() -> None:
    good, forger = SigningKey.generate(), SigningKey.generate()
    ring = Keyring.of([good.public_key])
    forged = forger.sign(SUBJECT, b"{}")
    forged[HDR_KEY_ID] = good.key_id  # claims to be the control plane's key
    with pytest.raises(SignatureInvalid) as exc:
        ring.verify(SUBJECT, b"{}", forged)
    assert exc.value.reason_code == SIGNATURE_INVALID and exc.value.key_id == good.key_id


def test_two_keys_are_valid_at_once() -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    ring = Keyring.of([old.public_key, new.public_key])
    assert ring.verify(SUBJECT, b"x", old.sign(SUBJECT, b"x")) == old.key_id
    assert ring.verify(SUBJECT, b"x", new.sign(SUBJECT, b"x")) == new.key_id
    assert ring.key_ids == sorted([old.key_id, new.key_id])


def test_key_id_is_derived_from_the_public_key() -> None:
    key = SigningKey.generate()
    assert key.key_id == key_id(key.public_key) and len(key.key_id) == 16
    assert SigningKey(bytes(32)).key_id == SigningKey(bytes(32)).key_id


def test_seed_never_in_repr(tmp_path: Path) -> None:
    key = SigningKey.generate()
    path = tmp_path / "k.seed"
    write_signing_key(path, key)
    seed_line = next(ln for ln in path.read_text().splitlines() if not ln.startswith("#"))
    for text in (repr(key), str(key), f"{key}", repr(SigningKeyFile(path).key)):
        assert seed_line not in text and key.key_id in text
    with pytest.raises(TypeError):
        __import__("pickle").dumps(key)


def test_seed_file_roundtrip_is_0600_and_refused_when_open(tmp_path: Path) -> None:
    key = SigningKey.generate()
    path = tmp_path / "k.seed"
    write_signing_key(path, key)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert load_signing_key(path).key_id == key.key_id
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileInvalid, match="must be 0600") as exc:
        load_signing_key(path, field="RUDDER_POLICY_SIGNING_KEY")
    assert exc.value.field == "RUDDER_POLICY_SIGNING_KEY"
    with pytest.raises(KeyFileInvalid, match="does not exist"):
        load_signing_key(tmp_path / "missing")
    bad = tmp_path / "bad.seed"
    bad.write_text("# comment\nnot-a-seed\n")
    os.chmod(bad, 0o600)
    with pytest.raises(KeyFileInvalid, match="seed"):
        load_signing_key(bad)


def test_verify_keys_file_comments_and_refusals(tmp_path: Path) -> None:
    a, b = SigningKey.generate(), SigningKey.generate()
    text = f"# the control plane's keys\n\n{a.public_line}\n  {b.public_line}\n"
    ring = parse_keyring(text)
    assert ring.key_ids == sorted([a.key_id, b.key_id])
    assert parse_keyring(format_keyring(ring)) == ring
    with pytest.raises(KeyFileInvalid, match="line 1: key id"):
        parse_keyring(f"{b.key_id} {a.public_line.split()[1]}")  # id of another key
    with pytest.raises(KeyFileInvalid, match="line 2"):
        parse_keyring(f"{a.public_line}\njunk\n")
    with pytest.raises(KeyFileInvalid, match="no public key"):
        parse_keyring("# nothing\n")
    with pytest.raises(KeyFileInvalid, match="does not exist"):
        load_keyring(tmp_path / "none.pub", field="RUDDER_POLICY_VERIFY_KEYS")


def test_keyring_file_reloads_on_change_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    a, b = SigningKey.generate(), SigningKey.generate()
    path = tmp_path / "keys.pub"
    write_keyring(path, Keyring.of([a.public_key]))
    watched = KeyringFile(path)
    assert not watched.refresh()
    write_keyring(path, Keyring.of([a.public_key, b.public_key]))
    assert watched.refresh() and watched.keyring.key_ids == sorted([a.key_id, b.key_id])
    path.write_text("garbage\n")
    with pytest.raises(KeyFileInvalid):
        watched.refresh()
    assert watched.keyring.key_ids == sorted([a.key_id, b.key_id])


def test_router_settings_refuse_to_start_without_verify_keys(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUDDER_POLICY_VERIFY_KEYS", raising=False)
    with pytest.raises(ValueError, match="RUDDER_POLICY_VERIFY_KEYS"):
        RouterSettings(models=["m"])
    with pytest.raises(ValueError, match="does not exist"):
        RouterSettings(models=["m"], policy_verify_keys=tmp_path / "missing.pub")


def test_controlplane_settings_refuse_to_start_without_signing_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.settings import ControlPlaneSettings

    monkeypatch.delenv("RUDDER_POLICY_SIGNING_KEY", raising=False)
    with pytest.raises(ValueError, match="RUDDER_POLICY_SIGNING_KEY"):
        ControlPlaneSettings()


def _state(ring: Keyring) -> PolicyState:
    startup = {k: startup_values(k) for k in PolicyKind}
    return PolicyState(router_id="r-1", models=["m"], startup=startup, cache_inputs=ALL_CACHE_INPUTS,
                       keyring=ring)


def test_policy_state_nacks_unsigned_unknown_and_bad_keeping_last_good_values() -> None:
    key, stranger = SigningKey.generate(), SigningKey.generate()
    st = _state(Keyring.of([key.public_key]))
    good = _event({"router_temperature": 0.5})
    assert st.apply("m", PolicyKind.SELECTION, 1, good, key.sign(SUBJECT, good)).outcome is Outcome.ACK
    cases = [
        (None, "signature_missing"),
        (stranger.sign(SUBJECT, _event({})), "signature_unknown_key"),
        ({**key.sign(SUBJECT, b"other bytes")}, "signature_invalid"),
    ]
    for revision, (headers, code) in enumerate(cases, start=2):
        r = st.apply("m", PolicyKind.SELECTION, revision, _event({"router_temperature": 2.0}, expected=1),
                     headers)
        assert r.outcome is Outcome.NACK and r.detail.startswith(code + ":"), r.detail
        assert r.event_id is None  # nothing of an unverified payload is believed
        doc = st.get("m", PolicyKind.SELECTION)
        assert doc.revision == 1 and doc.effective["router_temperature"] == 0.5
        assert doc.last_nack is not None and doc.last_nack.startswith(code)


def test_policy_state_accepts_a_new_key_after_use_keyring() -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    st = _state(Keyring.of([old.public_key]))
    ev = _event({"router_temperature": 0.1})
    assert st.apply("m", PolicyKind.SELECTION, 1, ev, new.sign(SUBJECT, ev)).outcome is Outcome.NACK
    st.use_keyring(Keyring.of([old.public_key, new.public_key]))
    ev2 = _event({"router_temperature": 0.2}, expected=1)
    assert st.apply("m", PolicyKind.SELECTION, 2, ev2, new.sign(SUBJECT, ev2)).outcome is Outcome.ACK
    ev3 = _event({"router_temperature": 0.3}, expected=2)
    assert st.apply("m", PolicyKind.SELECTION, 3, ev3, old.sign(SUBJECT, ev3)).outcome is Outcome.ACK
