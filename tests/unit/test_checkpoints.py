"""Pure parts of the audit checkpoints: payload validation, signatures, key files (the one
signature scheme's, purpose ``checkpoint``, and the legacy checkpoint key file), SCRAM."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime
from pathlib import Path

import nacl.signing
import pytest

from bus.keyfiles import load_keyring, load_signing_key, read_signing_key
from cli.embedded import scram_verifier
from cli.keys import ensure_key, ensure_keys
from controlplane.checkpoints import signature_problem
from controlplane.protocol.checkpoints import AuditCheckpoint, ChainSegment, decode_checkpoint
from controlplane.protocol.errors import InvalidRequest, KeyFileInvalid
from controlplane.protocol.signing import Keyring, Purpose, SigningKey
from controlplane.protocol.subjects import AUDIT_CHECKPOINTS_SUBJECT, HDR_KEY_ID, HDR_SIGNATURE

CHECKPOINT = Purpose.CHECKPOINT


def generate_key_file(path: Path) -> SigningKey:
    """A checkpoint key file as `rudder keys new --purpose checkpoint --if-missing` makes it."""
    return ensure_key(path, path.with_name(path.name + ".pub"), CHECKPOINT)[0]


def load_signer(path: Path) -> SigningKey:
    return load_signing_key(path, field="RUDDER_AUDIT_SIGNING_KEY", purpose=CHECKPOINT)


def load_verify_keys(path: Path) -> Keyring:
    return load_keyring(path, field="RUDDER_AUDIT_VERIFY_KEYS", purpose=CHECKPOINT)

H1, H2 = "a" * 64, "b" * 64


def checkpoint(rows: list[tuple[int, str]]) -> AuditCheckpoint:
    head = rows[-1] if rows else (0, "0" * 64)
    return AuditCheckpoint(at=datetime.now(UTC), writer="cp-1",
                           audit=ChainSegment(last_id=head[0], last_hash=head[1], rows=rows),
                           acks=ChainSegment(last_id=0, last_hash="0" * 64))


def test_a_checkpoint_round_trips_and_bad_ones_name_the_field() -> None:
    good = checkpoint([(1, H1), (2, H2)])
    assert decode_checkpoint(good.to_bytes()) == good
    assert good.head()["audit"] == {"last_id": 2, "last_hash": H2}
    raw = good.model_dump(mode="json")
    for mutate, field in (
        (lambda d: d["audit"].update(rows=[[2, H1], [1, H2]]), "audit"),           # not ascending
        (lambda d: d["audit"].update(last_id=3), "audit"),                          # head != last row
        (lambda d: d["audit"].update(last_hash="XYZ"), "audit.last_hash"),          # not a hash
        (lambda d: d.update(extra=1), "extra"),                                     # unknown field
        (lambda d: d["acks"].update(rows=[[1, H1]] * 1001), "acks.rows"),           # too many rows
    ):
        bad = {**raw, "audit": dict(raw["audit"]), "acks": dict(raw["acks"])}
        mutate(bad)
        with pytest.raises(InvalidRequest) as info:
            decode_checkpoint(bad)
        assert info.value.field == field


def test_signatures_cover_subject_and_payload_and_only_trusted_keys_count(tmp_path: Path) -> None:
    signer = generate_key_file(tmp_path / "k")
    keys = Keyring.of([signer.public_key], CHECKPOINT)
    payload = checkpoint([(1, H1)]).to_bytes()
    headers = signer.sign(AUDIT_CHECKPOINTS_SUBJECT, payload)
    assert signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, headers, keys) is None
    assert "does not verify" in str(signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload + b" ", headers, keys))
    assert "does not verify" in str(signature_problem("rudder.other", payload, headers, keys))
    assert signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, {}, keys) == "is not signed"
    other = SigningKey.generate(CHECKPOINT)
    assert "not trusted" in str(signature_problem(
        AUDIT_CHECKPOINTS_SUBJECT, payload, other.sign(AUDIT_CHECKPOINTS_SUBJECT, payload), keys))
    # A policy key's signature of the same bytes is not a checkpoint signature (the domains differ).
    policy = SigningKey(bytes(signer._key), Purpose.POLICY)  # the same seed, the other purpose
    assert "does not verify" in str(signature_problem(
        AUDIT_CHECKPOINTS_SUBJECT, payload, policy.sign(AUDIT_CHECKPOINTS_SUBJECT, payload), keys))
    forged = {**headers, HDR_SIGNATURE: base64.b64encode(b"x" * 64).decode()}
    assert "does not verify" in str(signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, forged, keys))


def test_key_files_round_trip_and_bad_ones_name_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "audit.key"
    signer = generate_key_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_signer(path).key_id == signer.key_id
    assert generate_key_file(path).key_id == signer.key_id  # an existing key is kept
    assert "seed" not in repr(signer) and base64.b64encode(bytes(signer._key)).decode() not in repr(signer)
    pub = tmp_path / "verify"
    pub.write_text(f"# trusted\n{signer.public_line}\n")
    assert set(load_verify_keys(pub).keys) == {signer.key_id}
    for text, setting, loader in (
        ("not base64!", "RUDDER_AUDIT_SIGNING_KEY", load_signer),
        ("kid " + base64.b64encode(b"short").decode(), "RUDDER_AUDIT_SIGNING_KEY", load_signer),
        ("only-one-field", "RUDDER_AUDIT_VERIFY_KEYS", load_verify_keys),
        ("# nothing", "RUDDER_AUDIT_VERIFY_KEYS", load_verify_keys),
    ):
        bad = tmp_path / "bad"
        bad.write_text(text)
        bad.chmod(0o600)
        with pytest.raises(KeyFileInvalid) as info:
            loader(bad)
        assert info.value.field == setting
    with pytest.raises(KeyFileInvalid) as missing:
        load_signer(tmp_path / "absent")
    assert missing.value.field == "RUDDER_AUDIT_SIGNING_KEY"


def legacy_key_file(path: Path) -> tuple[nacl.signing.SigningKey, str]:
    """A checkpoint key as `rudder audit keygen` wrote it before the two signature schemes were
    one: ``<"ed25519-" + key id> <base64 seed>``, and the verify-keys line it printed."""
    key = nacl.signing.SigningKey.generate()
    kid = "ed25519-" + hashlib.sha256(bytes(key.verify_key)).hexdigest()[:16]
    path.write_text(f"{kid} {base64.b64encode(bytes(key)).decode()}\n")
    path.chmod(0o600)
    return key, f"{kid} {base64.b64encode(bytes(key.verify_key)).decode()}"


def test_an_old_checkpoint_key_file_is_read_converted_and_its_old_signatures_verify(tmp_path: Path) -> None:
    old_path = tmp_path / "audit-signing.key"
    old, old_public_line = legacy_key_file(old_path)
    payload = checkpoint([(1, H1)]).to_bytes()
    # A checkpoint the old code signed: legacy key id in the header, the checkpoint domain.
    signed = b"rudder-audit-checkpoint-v1\0" + AUDIT_CHECKPOINTS_SUBJECT.encode() + b"\0" + payload
    old_headers = {HDR_KEY_ID: old_public_line.split()[0],
                   HDR_SIGNATURE: base64.b64encode(old.sign(signed).signature).decode()}

    # Read as it is (a control plane pointed at it keeps working) ...
    key, legacy = read_signing_key(old_path, purpose=CHECKPOINT)
    assert legacy and key.public_key == bytes(old.verify_key)
    assert signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, key.sign(AUDIT_CHECKPOINTS_SUBJECT, payload),
                             Keyring.of([key.public_key], CHECKPOINT)) is None
    # ... an old verify-keys line is accepted, and what the old key signed verifies with it.
    (tmp_path / "old.pub").write_text(old_public_line + "\n")
    ring = load_verify_keys(tmp_path / "old.pub")
    assert ring.key_ids == [key.key_id]
    assert signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, old_headers, ring) is None

    # `rudder up` takes the old file over: the same key, converted, its public key listed.
    seed, pub, made = ensure_keys(tmp_path / "keys", CHECKPOINT, legacy_seed=old_path)
    assert not made and load_signer(seed).key_id == key.key_id
    assert not read_signing_key(seed, purpose=CHECKPOINT)[1]  # current form
    assert seed.stat().st_mode & 0o777 == 0o600
    assert signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, old_headers, load_verify_keys(pub)) is None
    # `rudder keys new --if-missing` (and `rudder audit keygen`) on the old file converts it in place.
    assert generate_key_file(old_path).key_id == key.key_id
    assert not read_signing_key(old_path, purpose=CHECKPOINT)[1]
    # A legacy line whose id is not its key's is refused, naming the setting.
    wrong = tmp_path / "wrong.key"
    wrong.write_text(f"ed25519-{'0' * 16} {base64.b64encode(bytes(old)).decode()}\n")
    wrong.chmod(0o600)
    with pytest.raises(KeyFileInvalid, match="does not match") as info:
        load_signer(wrong)
    assert info.value.field == "RUDDER_AUDIT_SIGNING_KEY"


def test_scram_verifier_is_what_a_client_proof_checks_against() -> None:
    salt = b"0123456789abcdef"
    verifier = scram_verifier("pencil", salt=salt)
    mech, rest = verifier.split("$", 1)
    iterations_salt, keys = rest.split("$")
    iterations, salt_b64 = iterations_salt.split(":")
    stored_b64, server_b64 = keys.split(":")
    assert mech == "SCRAM-SHA-256" and int(iterations) == 4096 and base64.b64decode(salt_b64) == salt
    # RFC 5802: StoredKey = H(HMAC(SaltedPassword, "Client Key")).
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", salt, 4096)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    assert base64.b64decode(stored_b64) == hashlib.sha256(client_key).digest()
    assert base64.b64decode(server_b64) == hmac.new(salted, b"Server Key", "sha256").digest()
    assert "pencil" not in verifier
    with pytest.raises(ValueError):
        scram_verifier("pässword")
