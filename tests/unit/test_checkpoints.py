"""Pure parts of the audit checkpoints: payload validation, signatures, key files, SCRAM."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime
from pathlib import Path

import nacl.signing
import pytest

from cli.embedded import scram_verifier
from controlplane.checkpoints import (
    KeyFileError,
    Signer,
    generate_key_file,
    load_signer,
    load_verify_keys,
    public_line,
    signature_problem,
)
from controlplane.protocol.checkpoints import AuditCheckpoint, ChainSegment, decode_checkpoint
from controlplane.protocol.errors import InvalidRequest
from controlplane.protocol.subjects import AUDIT_CHECKPOINTS_SUBJECT, HDR_SIGNATURE

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
    keys = {signer.key_id: signer.verify_key}
    payload = checkpoint([(1, H1)]).to_bytes()
    headers = signer.headers(AUDIT_CHECKPOINTS_SUBJECT, payload)
    assert signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, headers, keys) is None
    assert "does not verify" in str(signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload + b" ", headers, keys))
    assert "does not verify" in str(signature_problem("rudder.other", payload, headers, keys))
    assert signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, {}, keys) == "is not signed"
    other = Signer(key_id="k2", key=nacl.signing.SigningKey.generate())
    assert "not trusted" in str(signature_problem(
        AUDIT_CHECKPOINTS_SUBJECT, payload, other.headers(AUDIT_CHECKPOINTS_SUBJECT, payload), keys))
    forged = {**headers, HDR_SIGNATURE: base64.b64encode(b"x" * 64).decode()}
    assert "does not verify" in str(signature_problem(AUDIT_CHECKPOINTS_SUBJECT, payload, forged, keys))


def test_key_files_round_trip_and_bad_ones_name_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "audit.key"
    signer = generate_key_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_signer(path).key_id == signer.key_id
    assert generate_key_file(path).key_id == signer.key_id  # an existing key is kept
    assert "seed" not in repr(signer) and base64.b64encode(bytes(signer.key)).decode() not in repr(signer)
    pub = tmp_path / "verify"
    pub.write_text(f"# trusted\n{public_line(signer)}\n")
    assert set(load_verify_keys(pub)) == {signer.key_id}
    for text, setting, loader in (
        ("not base64!", "RUDDER_AUDIT_SIGNING_KEY", load_signer),
        ("kid " + base64.b64encode(b"short").decode(), "RUDDER_AUDIT_SIGNING_KEY", load_signer),
        ("only-one-field", "RUDDER_AUDIT_VERIFY_KEYS", load_verify_keys),
        ("# nothing", "RUDDER_AUDIT_VERIFY_KEYS", load_verify_keys),
    ):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(KeyFileError) as info:
            loader(bad)
        assert info.value.field == setting
    with pytest.raises(KeyFileError) as missing:
        load_signer(tmp_path / "absent")
    assert missing.value.field == "RUDDER_AUDIT_SIGNING_KEY"


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
