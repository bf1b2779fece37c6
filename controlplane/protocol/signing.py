"""Signatures of policy events (DESIGN §9): Ed25519 over the exact subject and payload bytes.

The control plane signs every event it publishes with one :class:`SigningKey`; routers (and the
control plane itself, when it reads the stream back) verify with a :class:`Keyring` of every
public key that is currently valid, so two keys can be valid at once while a key rotates.

- **Signed bytes**: ``b"rudder-policy-v1\\0" + subject + b"\\0" + payload``. The prefix separates
  these signatures from any other use of the same key; the subject is signed so an event cannot
  be replayed onto another document's subject.
- **Headers**: ``Rudder-Key-Id`` (the key id) and ``Rudder-Signature`` (base64 of the 64-byte
  signature); names in :mod:`controlplane.protocol.subjects`.
- **Key id**: the first 16 hex digits of SHA-256 of the 32-byte public key, so it is derived, never
  chosen, and a verify-keys line whose id does not match its key is refused.
- **Seed file** (the secret): comment lines and one line with the base64 32-byte Ed25519 seed.
  It must be mode 0600 (nobody but its owner may read it); the seed never appears in ``repr``.
- **Verify-keys file**: one ``<key id> <base64 public key>`` per line; ``#`` comments and blank
  lines are allowed. :class:`KeyringFile` re-reads it when it changes (routers poll it on their
  tick), which is how a new key becomes valid without a restart.

Pure: no NATS, database or HTTP; files are read only by the ``load_*`` functions.

Raises :class:`~controlplane.protocol.errors.SignatureInvalid` (verification) and
:class:`~controlplane.protocol.errors.KeyFileInvalid` (key files).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import nacl.exceptions
import nacl.signing

from controlplane.protocol.errors import KeyFileInvalid, SignatureInvalid
from controlplane.protocol.subjects import HDR_KEY_ID, HDR_SIGNATURE

DOMAIN = b"rudder-policy-v1\0"
KEY_ID_HEX = 16
SEED_BYTES = 32

SIGNATURE_MISSING = "signature_missing"
SIGNATURE_UNKNOWN_KEY = "signature_unknown_key"
SIGNATURE_INVALID = "signature_invalid"


def signed_bytes(subject: str, payload: bytes) -> bytes:
    """The exact bytes a signature covers."""
    return DOMAIN + subject.encode("utf-8") + b"\0" + payload


def key_id(public_key: bytes) -> str:
    """Short, derived id of a public key (16 hex digits of its SHA-256)."""
    return hashlib.sha256(public_key).hexdigest()[:KEY_ID_HEX]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, *, size: int | None = None) -> bytes:
    raw = base64.b64decode(text.strip(), validate=True)
    if size is not None and len(raw) != size:
        raise ValueError(f"expected {size} bytes, got {len(raw)}")
    return raw


class SigningKey:
    """One Ed25519 private key. ``repr`` and ``str`` show its key id only."""

    __slots__ = ("_key", "key_id", "public_key")

    def __init__(self, seed: bytes) -> None:
        if len(seed) != SEED_BYTES:
            raise ValueError(f"an Ed25519 seed is {SEED_BYTES} bytes, got {len(seed)}")
        self._key = nacl.signing.SigningKey(seed)
        self.public_key: bytes = bytes(self._key.verify_key)
        self.key_id: str = key_id(self.public_key)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(bytes(nacl.signing.SigningKey.generate()))

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id!r})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:  # never pickled into a log or a cache by accident
        raise TypeError("SigningKey is not picklable")

    @property
    def public_line(self) -> str:
        """This key's line in a verify-keys file."""
        return f"{self.key_id} {_b64(self.public_key)}"

    def sign(self, subject: str, payload: bytes) -> dict[str, str]:
        """The signature headers of ``payload`` published on ``subject`` (a fresh dict)."""
        signature = self._key.sign(signed_bytes(subject, payload)).signature
        return {HDR_KEY_ID: self.key_id, HDR_SIGNATURE: _b64(signature)}

    def seed_file_text(self) -> str:
        return (f"# Rudder policy signing key {self.key_id} (Ed25519 seed, base64). Secret: mode 0600.\n"
                f"{_b64(bytes(self._key))}\n")


@dataclass(frozen=True, slots=True)
class Keyring:
    """The public keys that are valid now, by key id."""

    keys: Mapping[str, bytes]

    @classmethod
    def of(cls, public_keys: Iterable[bytes]) -> Keyring:
        return cls({key_id(pk): bytes(pk) for pk in public_keys})

    @property
    def key_ids(self) -> list[str]:
        return sorted(self.keys)

    def union(self, other: Keyring) -> Keyring:
        return Keyring({**self.keys, **other.keys})

    def verify(self, subject: str, payload: bytes, headers: Mapping[str, str] | None) -> str:
        """Return the key id that signed ``payload`` on ``subject``. Raises SignatureInvalid."""
        headers = headers or {}
        kid = headers.get(HDR_KEY_ID)
        sig = headers.get(HDR_SIGNATURE)
        if not kid or not sig:
            raise SignatureInvalid(
                f"unsigned: no {HDR_KEY_ID}/{HDR_SIGNATURE} headers", reason_code=SIGNATURE_MISSING)
        public = self.keys.get(kid)
        if public is None:
            raise SignatureInvalid(
                f"signed by key {kid[:32]!r}, which is not among the valid keys "
                f"({', '.join(self.key_ids) or 'none'})",
                reason_code=SIGNATURE_UNKNOWN_KEY, key_id=kid[:32])
        try:
            signature = _unb64(sig, size=64)
            nacl.signing.VerifyKey(public).verify(signed_bytes(subject, payload), signature)
        except (ValueError, binascii.Error, nacl.exceptions.BadSignatureError) as exc:
            raise SignatureInvalid(f"signature by key {kid} does not verify",
                                   reason_code=SIGNATURE_INVALID, key_id=kid) from exc
        return kid


# ---------------------------------------------------------------------------------------------
# Files


def parse_keyring(text: str, *, source: str = "verify keys", field: str | None = None) -> Keyring:
    """Parse ``<key id> <base64 public key>`` lines. Raises KeyFileInvalid naming the line."""
    keys: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileInvalid(f"{source} line {number}: expected '<key id> <base64 public key>'",
                                 field=field)
        kid, b64 = parts
        try:
            public = _unb64(b64, size=32)
        except (ValueError, binascii.Error) as exc:
            raise KeyFileInvalid(f"{source} line {number}: not a base64 32-byte public key",
                                 field=field) from exc
        if key_id(public) != kid:
            raise KeyFileInvalid(f"{source} line {number}: key id {kid} does not match its key "
                                 f"(expected {key_id(public)})", field=field)
        keys[kid] = public
    if not keys:
        raise KeyFileInvalid(f"{source} holds no public key", field=field)
    return Keyring(keys)


def format_keyring(keyring: Keyring) -> str:
    lines = ["# Rudder policy verify keys: <key id> <base64 Ed25519 public key>, one per line."]
    lines += [f"{kid} {_b64(keyring.keys[kid])}" for kid in keyring.key_ids]
    return "\n".join(lines) + "\n"


def _read(path: Path, what: str, field: str | None) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise KeyFileInvalid(f"{what} file {path} does not exist", field=field) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileInvalid(f"{what} file {path} is not readable: {type(exc).__name__}",
                             field=field) from exc


def load_keyring(path: str | os.PathLike[str], *, field: str | None = None) -> Keyring:
    p = Path(path)
    return parse_keyring(_read(p, "verify keys", field), source=str(p), field=field)


def load_signing_key(path: str | os.PathLike[str], *, field: str | None = None) -> SigningKey:
    """Read a seed file. Refuses a file others may read (group or world bits set)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError as exc:
        raise KeyFileInvalid(f"signing key file {p} does not exist", field=field) from exc
    except OSError as exc:
        raise KeyFileInvalid(f"signing key file {p} is not readable: {type(exc).__name__}",
                             field=field) from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileInvalid(f"signing key file {p} has mode {stat.S_IMODE(mode):04o}; it must be "
                             f"0600 (chmod 600 {p})", field=field)
    lines = [ln.strip() for ln in _read(p, "signing key", field).splitlines()]
    body = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(body) != 1:
        raise KeyFileInvalid(f"signing key file {p} must hold exactly one base64 seed line",
                             field=field)
    try:
        return SigningKey(_unb64(body[0], size=SEED_BYTES))
    except (ValueError, binascii.Error) as exc:
        raise KeyFileInvalid(f"signing key file {p}: not a base64 {SEED_BYTES}-byte seed",
                             field=field) from exc


def _write_atomic(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_signing_key(path: str | os.PathLike[str], key: SigningKey) -> None:
    """Write (or atomically replace) a seed file, mode 0600."""
    _write_atomic(Path(path), key.seed_file_text(), 0o600)


def write_keyring(path: str | os.PathLike[str], keyring: Keyring) -> None:
    """Write (or atomically replace) a verify-keys file (public: mode 0644)."""
    _write_atomic(Path(path), format_keyring(keyring), 0o644)


class _Watched:
    """A file re-read when its (mtime, size, inode) changes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None

    def _changed(self) -> bool:
        try:
            st = self.path.stat()
        except OSError:
            return False  # a file being replaced or gone for a moment: keep what we have
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


class KeyringFile(_Watched):
    """A verify-keys file and the keyring it held when last read successfully."""

    def __init__(self, path: str | os.PathLike[str], *, field: str | None = None) -> None:
        super().__init__(path)
        self.field = field
        self._changed()
        self.keyring = load_keyring(self.path, field=field)

    def refresh(self) -> bool:
        """Re-read the file if it changed; True if the keyring changed. A bad new content
        raises KeyFileInvalid and leaves the last good keyring in place."""
        if not self._changed():
            return False
        new = load_keyring(self.path, field=self.field)
        if new == self.keyring:
            return False
        self.keyring = new
        return True


class SigningKeyFile(_Watched):
    """A seed file and the key it held when last read successfully (re-read on change, so a
    rotation needs no restart of the control plane)."""

    def __init__(self, path: str | os.PathLike[str], *, field: str | None = None) -> None:
        super().__init__(path)
        self.field = field
        self._changed()
        self.key = load_signing_key(self.path, field=field)

    def refresh(self) -> bool:
        if not self._changed():
            return False
        new = load_signing_key(self.path, field=self.field)
        if new.key_id == self.key.key_id:
            return False
        self.key = new
        return True
