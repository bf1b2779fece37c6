"""Signing-key and verify-key files on disk (the texts are :mod:`controlplane.protocol.signing`'s).

Every process that signs or verifies reads its keys through here: the control plane (policy and
checkpoint signing keys, their verify keys), routers (policy verify keys), the CLI (``rudder
keys``). It lives in ``bus/`` because what these keys sign are bus messages, and ``bus`` is the
one package every process imports.

- A **seed file** must be mode 0600 (nobody but its owner may read it) and is written atomically
  with that mode. A legacy checkpoint key file (``<key id> <base64 seed>``, as ``rudder audit
  keygen`` wrote before the two schemes were one) is read as it is; ``rudder keys`` writes it
  again in the current form when it touches it.
- A **verify-keys file** is public (0644).
- :class:`KeyringFile` and :class:`SigningKeyFile` re-read their file when it changes (routers and
  control planes poll them), which is how a rotation needs no restart; a bad new content keeps the
  last good keys.

Raises :class:`~controlplane.protocol.errors.KeyFileInvalid` naming the setting (``field``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from controlplane.protocol.errors import KeyFileInvalid
from controlplane.protocol.signing import (
    Keyring,
    Purpose,
    SigningKey,
    format_keyring,
    parse_keyring,
    parse_signing_key,
)


def _read(path: Path, what: str, field: str | None) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise KeyFileInvalid(f"{what} file {path} does not exist", field=field) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileInvalid(f"{what} file {path} is not readable: {type(exc).__name__}",
                             field=field) from exc


def load_keyring(path: str | os.PathLike[str], *, field: str | None = None,
                 purpose: Purpose = Purpose.POLICY) -> Keyring:
    p = Path(path)
    return parse_keyring(_read(p, "verify keys", field), source=str(p), field=field, purpose=purpose)


def read_signing_key(path: str | os.PathLike[str], *, field: str | None = None,
                     purpose: Purpose = Purpose.POLICY) -> tuple[SigningKey, bool]:
    """The key of a seed file and whether the file is in the legacy form. Refuses a file others
    may read (group or world bits set)."""
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
    return parse_signing_key(_read(p, "signing key", field), source=f"signing key file {p}", field=field,
                             purpose=purpose)


def load_signing_key(path: str | os.PathLike[str], *, field: str | None = None,
                     purpose: Purpose = Purpose.POLICY) -> SigningKey:
    """Read a seed file (see :func:`read_signing_key`)."""
    return read_signing_key(path, field=field, purpose=purpose)[0]


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

    def __init__(self, path: str | os.PathLike[str], field: str | None, purpose: Purpose) -> None:
        self.path = Path(path)
        self.field = field
        self.purpose = purpose
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

    def __init__(self, path: str | os.PathLike[str], *, field: str | None = None,
                 purpose: Purpose = Purpose.POLICY) -> None:
        super().__init__(path, field, purpose)
        self._changed()
        self.keyring = load_keyring(self.path, field=field, purpose=purpose)

    def refresh(self) -> bool:
        """Re-read the file if it changed; True if the keyring changed. A bad new content
        raises KeyFileInvalid and leaves the last good keyring in place."""
        if not self._changed():
            return False
        new = load_keyring(self.path, field=self.field, purpose=self.purpose)
        if new == self.keyring:
            return False
        self.keyring = new
        return True


class SigningKeyFile(_Watched):
    """A seed file and the key it held when last read successfully (re-read on change, so a
    rotation needs no restart of the control plane)."""

    def __init__(self, path: str | os.PathLike[str], *, field: str | None = None,
                 purpose: Purpose = Purpose.POLICY) -> None:
        super().__init__(path, field, purpose)
        self._changed()
        self.key = load_signing_key(self.path, field=field, purpose=purpose)

    def refresh(self) -> bool:
        if not self._changed():
            return False
        new = load_signing_key(self.path, field=self.field, purpose=self.purpose)
        if new.key_id == self.key.key_id:
            return False
        self.key = new
        return True
