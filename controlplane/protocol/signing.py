"""Rudder's one Ed25519 signature scheme (DESIGN §9), for every signed message on the bus.

Three :class:`Purpose` s use it: **policy** events (the control plane signs every event it
publishes; routers, and the control plane itself when it reads the stream back, verify), audit
**checkpoints** (the control plane signs each checkpoint of the audit and ACK chains; ``rudder
audit verify`` checks them) and worker **manifests** (what a worker may claim; signed with the
policy key, verified by routers with the policy verify keys). Each purpose has its own domain
prefix (policy and checkpoints their own key too), so a signature of one purpose never verifies
as another. Verification uses a :class:`Keyring` of
every public key that is currently valid for the purpose, so two keys can be valid at once while
a key rotates.

- **Signed bytes**: ``domain + subject + b"\\0" + payload``, the domain being
  ``b"rudder-policy-v1\\0"``, ``b"rudder-audit-checkpoint-v1\\0"`` or
  ``b"rudder-worker-manifest-v1\\0"``. The subject is signed so a
  message cannot be replayed onto another subject.
- **Headers**: ``Rudder-Key-Id`` (the key id) and ``Rudder-Signature`` (base64 of the 64-byte
  signature); names in :mod:`controlplane.protocol.subjects`.
- **Key id**: the first 16 hex digits of SHA-256 of the 32-byte public key, so it is derived, never
  chosen, and a verify-keys line whose id does not match its key is refused.
  Checkpoints signed before the two schemes were one carry the id with an ``ed25519-`` prefix;
  :func:`normalize_key_id` drops it, so they still verify.
- **Seed file** (the secret): comment lines and one line with the base64 32-byte Ed25519 seed.
  The seed never appears in ``repr``. A legacy checkpoint key file (one line
  ``<key id> <base64 seed>``) parses too.
- **Verify-keys file**: one ``<key id> <base64 public key>`` per line; ``#`` comments and blank
  lines are allowed.

Pure: no NATS, database, HTTP or files; the files themselves are read and written by
:mod:`bus.keyfiles` (modes, atomic replacement, re-reading on change).

Raises :class:`~controlplane.protocol.errors.SignatureInvalid` (verification) and
:class:`~controlplane.protocol.errors.KeyFileInvalid` (key files).
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import nacl.exceptions
import nacl.signing

from controlplane.protocol.errors import KeyFileInvalid, SignatureInvalid
from controlplane.protocol.subjects import HDR_KEY_ID, HDR_SIGNATURE

KEY_ID_HEX = 16
SEED_BYTES = 32
#: The prefix checkpoint key ids had before the two signature schemes were one.
LEGACY_KEY_ID_PREFIX = "ed25519-"


class Purpose(enum.StrEnum):
    """What a key signs. Each purpose has its own domain prefix in the signed bytes."""

    POLICY = "policy"
    CHECKPOINT = "checkpoint"
    #: Worker manifests (what a worker may claim). Signed with the policy key under its own
    #: domain: the same holder (the control plane), the same rotation, the same verify keys on
    #: routers, and a manifest signature never verifies as a policy event or the reverse.
    MANIFEST = "manifest"

    @property
    def domain(self) -> bytes:
        return _DOMAINS[self]


_DOMAINS = {Purpose.POLICY: b"rudder-policy-v1\0", Purpose.CHECKPOINT: b"rudder-audit-checkpoint-v1\0",
            Purpose.MANIFEST: b"rudder-worker-manifest-v1\0"}

SIGNATURE_MISSING = "signature_missing"
SIGNATURE_UNKNOWN_KEY = "signature_unknown_key"
SIGNATURE_INVALID = "signature_invalid"


def signed_bytes(subject: str, payload: bytes, purpose: Purpose = Purpose.POLICY) -> bytes:
    """The exact bytes a signature covers."""
    return purpose.domain + subject.encode("utf-8") + b"\0" + payload


def key_id(public_key: bytes) -> str:
    """Short, derived id of a public key (16 hex digits of its SHA-256)."""
    return hashlib.sha256(public_key).hexdigest()[:KEY_ID_HEX]


def normalize_key_id(kid: str) -> str:
    """A key id without the legacy ``ed25519-`` prefix of early checkpoint keys."""
    return kid[len(LEGACY_KEY_ID_PREFIX):] if kid.startswith(LEGACY_KEY_ID_PREFIX) else kid


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, *, size: int | None = None) -> bytes:
    raw = base64.b64decode(text.strip(), validate=True)
    if size is not None and len(raw) != size:
        raise ValueError(f"expected {size} bytes, got {len(raw)}")
    return raw


class SigningKey:
    """One Ed25519 private key for one purpose. ``repr`` and ``str`` show its key id only."""

    __slots__ = ("_key", "key_id", "public_key", "purpose")

    def __init__(self, seed: bytes, purpose: Purpose = Purpose.POLICY) -> None:
        if len(seed) != SEED_BYTES:
            raise ValueError(f"an Ed25519 seed is {SEED_BYTES} bytes, got {len(seed)}")
        self._key = nacl.signing.SigningKey(seed)
        self.purpose = purpose
        self.public_key: bytes = bytes(self._key.verify_key)
        self.key_id: str = key_id(self.public_key)

    @classmethod
    def generate(cls, purpose: Purpose = Purpose.POLICY) -> SigningKey:
        return cls(bytes(nacl.signing.SigningKey.generate()), purpose)

    def for_purpose(self, purpose: Purpose) -> SigningKey:
        """The same key signing under another purpose's domain (the policy key signs manifests)."""
        return SigningKey(bytes(self._key), purpose)

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id!r}, purpose={self.purpose.value!r})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:  # never pickled into a log or a cache by accident
        raise TypeError("SigningKey is not picklable")

    @property
    def public_line(self) -> str:
        """This key's line in a verify-keys file."""
        return f"{self.key_id} {_b64(self.public_key)}"

    def sign(self, subject: str, payload: bytes) -> dict[str, str]:
        """The signature headers of ``payload`` published on ``subject`` (a fresh dict)."""
        signature = self._key.sign(signed_bytes(subject, payload, self.purpose)).signature
        return {HDR_KEY_ID: self.key_id, HDR_SIGNATURE: _b64(signature)}

    def seed_file_text(self) -> str:
        return (f"# Rudder {self.purpose.value} signing key {self.key_id} (Ed25519 seed, base64). "
                f"Secret: mode 0600.\n{_b64(bytes(self._key))}\n")


@dataclass(frozen=True, slots=True)
class Keyring:
    """The public keys that are valid now for one purpose, by key id."""

    keys: Mapping[str, bytes]
    purpose: Purpose = Purpose.POLICY

    @classmethod
    def of(cls, public_keys: Iterable[bytes], purpose: Purpose = Purpose.POLICY) -> Keyring:
        return cls({key_id(pk): bytes(pk) for pk in public_keys}, purpose)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self.keys)

    def for_purpose(self, purpose: Purpose) -> Keyring:
        """The same keys verifying another purpose's signatures."""
        return Keyring(self.keys, purpose)

    def union(self, other: Keyring) -> Keyring:
        return Keyring({**self.keys, **other.keys}, self.purpose)

    def verify(self, subject: str, payload: bytes, headers: Mapping[str, str] | None) -> str:
        """Return the key id that signed ``payload`` on ``subject``. Raises SignatureInvalid."""
        headers = headers or {}
        kid = headers.get(HDR_KEY_ID)
        sig = headers.get(HDR_SIGNATURE)
        if not kid or not sig:
            raise SignatureInvalid(
                f"unsigned: no {HDR_KEY_ID}/{HDR_SIGNATURE} headers", reason_code=SIGNATURE_MISSING)
        public = self.keys.get(normalize_key_id(kid))
        if public is None:
            raise SignatureInvalid(
                f"signed by key {kid[:32]!r}, which is not among the valid keys "
                f"({', '.join(self.key_ids) or 'none'})",
                reason_code=SIGNATURE_UNKNOWN_KEY, key_id=kid[:32])
        try:
            signature = _unb64(sig, size=64)
            nacl.signing.VerifyKey(public).verify(signed_bytes(subject, payload, self.purpose), signature)
        except (ValueError, binascii.Error, nacl.exceptions.BadSignatureError) as exc:
            raise SignatureInvalid(f"signature by key {kid} does not verify",
                                   reason_code=SIGNATURE_INVALID, key_id=kid) from exc
        return kid


# ---------------------------------------------------------------------------------------------
# File texts (parsed and formatted here; read and written by :mod:`bus.keyfiles`)


def parse_keyring(text: str, *, source: str = "verify keys", field: str | None = None,
                  purpose: Purpose = Purpose.POLICY) -> Keyring:
    """Parse ``<key id> <base64 public key>`` lines. Raises KeyFileInvalid naming the line."""
    keys: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileInvalid(f"{source} line {number}: expected '<key id> <base64 public key>'",
                                 field=field)
        kid, b64 = normalize_key_id(parts[0]), parts[1]
        try:
            public = _unb64(b64, size=32)
        except (ValueError, binascii.Error) as exc:
            raise KeyFileInvalid(f"{source} line {number}: not a base64 32-byte public key",
                                 field=field) from exc
        if key_id(public) != kid:
            raise KeyFileInvalid(f"{source} line {number}: key id {parts[0]} does not match its key "
                                 f"(expected {key_id(public)})", field=field)
        keys[kid] = public
    if not keys:
        raise KeyFileInvalid(f"{source} holds no public key", field=field)
    return Keyring(keys, purpose)


def format_keyring(keyring: Keyring) -> str:
    lines = [f"# Rudder {keyring.purpose.value} verify keys: <key id> <base64 Ed25519 public key>, one per line."]
    lines += [f"{kid} {_b64(keyring.keys[kid])}" for kid in keyring.key_ids]
    return "\n".join(lines) + "\n"


def parse_signing_key(text: str, *, source: str = "signing key", field: str | None = None,
                      purpose: Purpose = Purpose.POLICY) -> tuple[SigningKey, bool]:
    """Parse a seed file: one base64 seed line (``#`` comments allowed), or the legacy
    checkpoint form ``<key id> <base64 seed>`` whose id must be the key's own. Returns the key
    and whether the text was in the legacy form (to be written again in the current one).
    Raises KeyFileInvalid."""
    body = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if len(body) != 1:
        raise KeyFileInvalid(f"{source} must hold exactly one base64 seed line", field=field)
    parts = body[0].split()
    if len(parts) not in (1, 2):
        raise KeyFileInvalid(f"{source} must hold exactly one base64 seed line", field=field)
    try:
        key = SigningKey(_unb64(parts[-1], size=SEED_BYTES), purpose)
    except (ValueError, binascii.Error) as exc:
        raise KeyFileInvalid(f"{source}: not a base64 {SEED_BYTES}-byte seed", field=field) from exc
    if len(parts) == 2 and normalize_key_id(parts[0]) != key.key_id:
        raise KeyFileInvalid(f"{source}: key id {parts[0]} does not match its key (expected "
                             f"{key.key_id})", field=field)
    return key, len(parts) == 2
