"""``rudder keys``: the control plane's policy signing keys (DESIGN §9), as local files.

- ``new``: a new seed file (mode 0600) and its public key added to the verify-keys file;
- ``list``: the keys of a verify-keys file, and which one the seed file holds;
- ``rotate``: a new key joins the verify-keys file first, then, after ``--wait`` seconds (routers
  re-read the file on their tick), replaces the seed file; control planes re-read it within their
  ``key_poll_s``. Both keys stay valid until ``retire`` removes the old one;
- ``retire``: remove a key from the verify-keys file (never the one the seed file holds).

Paths come from ``--signing-key`` / ``--verify-keys``, then ``RUDDER_POLICY_SIGNING_KEY`` /
``RUDDER_POLICY_VERIFY_KEYS``, then the files ``rudder up`` keeps under ``.rudder/keys/``.
The seed itself is never printed.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Annotated

import typer

from cli import app as shared
from cli.errors import CliError, ExitCode
from cli.output import note, print_json, say, show, table
from controlplane.protocol.errors import KeyFileInvalid
from controlplane.protocol.signing import (
    Keyring,
    SigningKey,
    load_keyring,
    load_signing_key,
    write_keyring,
    write_signing_key,
)

app = shared.new_app("Policy signing keys: Ed25519 seed (secret) and verify-keys file (public).")

KEYS_DIR = Path(".rudder") / "keys"
SEED_NAME = "policy.seed"
PUB_NAME = "policy.pub"

def _fail(exc: KeyFileInvalid) -> CliError:
    return CliError(ExitCode.USAGE, exc.message)


def _keyring_or_empty(path: Path) -> Keyring:
    if not path.exists():
        return Keyring({})
    try:
        return load_keyring(path)
    except KeyFileInvalid as exc:
        if "holds no public key" in exc.message:
            return Keyring({})
        raise _fail(exc) from exc


def add_public_key(verify_keys: Path, key: SigningKey) -> Keyring:
    """Add ``key``'s public key to the verify-keys file (created if missing); returns the result."""
    ring = _keyring_or_empty(verify_keys).union(Keyring.of([key.public_key]))
    write_keyring(verify_keys, ring)
    return ring


def ensure_key(seed: Path, pub: Path) -> tuple[SigningKey, bool]:
    """The key of ``seed``, made if the file is missing; its public key is added to ``pub`` if
    it is not there. Returns (key, whether it was made)."""
    made = False
    try:
        if seed.exists():
            key = load_signing_key(seed)
        else:
            key, made = SigningKey.generate(), True
            write_signing_key(seed, key)
    except KeyFileInvalid as exc:
        raise CliError(ExitCode.ERROR, exc.message) from exc
    if key.key_id not in _keyring_or_empty(pub).keys:
        add_public_key(pub, key)
    return key, made


def ensure_keys(keys_dir: Path) -> tuple[Path, Path, bool]:
    """``rudder up``: the seed and verify-keys files under ``keys_dir`` (mode 0700), made on the
    first start and reused after. Returns (seed path, verify-keys path, whether a key was made)."""
    keys_dir.mkdir(parents=True, exist_ok=True)
    keys_dir.chmod(0o700)
    seed, pub = keys_dir / SEED_NAME, keys_dir / PUB_NAME
    _, made = ensure_key(seed, pub)
    return seed, pub, made


def _default(path: Path | None, name: str) -> Path:
    return path if path is not None else KEYS_DIR / name



SigningKeyOpt = Annotated[Path | None, typer.Option(
    "--signing-key", envvar="RUDDER_POLICY_SIGNING_KEY",
    help="The control plane's seed file [default: .rudder/keys/policy.seed].")]
VerifyKeysOpt = Annotated[Path | None, typer.Option(
    "--verify-keys", envvar="RUDDER_POLICY_VERIFY_KEYS",
    help="The verify-keys file routers read [default: .rudder/keys/policy.pub].")]

@app.command("new")
def new(
    signing_key: SigningKeyOpt = None,
    verify_keys: VerifyKeysOpt = None,
    if_missing: Annotated[bool, typer.Option(
        "--if-missing", help="Keep an existing seed (and make sure its public key is listed): for "
                             "deployment jobs that run on every start.")] = False,
) -> None:
    """Make a signing key: a seed file (0600) and its public key in the verify-keys file."""
    seed, pub = _default(signing_key, SEED_NAME), _default(verify_keys, PUB_NAME)
    if seed.exists() and not if_missing:
        raise CliError(ExitCode.USAGE, f"{seed} exists; `rudder keys rotate` replaces a key")
    key, made = ensure_key(seed, pub)
    ring = load_keyring(pub)
    if shared.json_mode():
        print_json({"key_id": key.key_id, "public_key": key.public_line.split()[1], "made": made,
                    "signing_key": str(seed), "verify_keys": str(pub), "valid_keys": ring.key_ids})
        return
    if made:
        say(f"key {key.key_id}: seed {seed} (mode 0600), public key added to {pub}")
    else:
        say(f"key {key.key_id}: kept {seed}; its public key is in {pub}")


def _current(verify_keys: Path | None, signing_key: Path | None) -> tuple[Path, Path, Keyring, str | None]:
    """(verify-keys file, seed file, the valid keys, the signing key's id if the seed exists)."""
    pub, seed = _default(verify_keys, PUB_NAME), _default(signing_key, SEED_NAME)
    try:
        ring = load_keyring(pub)
        signing = load_signing_key(seed).key_id if seed.exists() else None
    except KeyFileInvalid as exc:
        raise _fail(exc) from exc
    return pub, seed, ring, signing


@app.command("list")
def list_keys(
    verify_keys: VerifyKeysOpt = None,
    signing_key: SigningKeyOpt = None,
) -> None:
    """The valid public keys, and which one signs."""
    pub, _, ring, signing = _current(verify_keys, signing_key)
    rows = [{"key_id": kid, "public_key": base64.b64encode(ring.keys[kid]).decode(),
             "signing": kid == signing} for kid in ring.key_ids]
    if shared.json_mode():
        print_json(rows)
        return
    show(table(["key id", "public key", "signing"],
               [(r["key_id"], str(r["public_key"]), "yes" if r["signing"] else "") for r in rows]))
    if signing is not None and signing not in ring.keys:
        note(f"the signing key {signing} is NOT in {pub}: routers refuse what it signs")


@app.command("rotate")
def rotate(
    signing_key: SigningKeyOpt = None,
    verify_keys: VerifyKeysOpt = None,
    wait: Annotated[float, typer.Option(
        "--wait", min=0, help="Seconds between publishing the new public key and switching the seed "
                              "(routers must have re-read the verify-keys file).")] = 3.0,
) -> None:
    """New key: add its public key, wait, switch the seed. The old key stays valid until retired."""
    seed, pub = _default(signing_key, SEED_NAME), _default(verify_keys, PUB_NAME)
    try:
        old = load_signing_key(seed)
    except KeyFileInvalid as exc:
        raise _fail(exc) from exc
    new_key = SigningKey.generate()
    ring = add_public_key(pub, new_key)
    if not shared.json_mode():
        say(f"1/2 public key {new_key.key_id} added to {pub} (valid: {', '.join(ring.key_ids)})")
    time.sleep(wait)
    write_signing_key(seed, new_key)
    if shared.json_mode():
        print_json({"old_key_id": old.key_id, "new_key_id": new_key.key_id, "signing_key": str(seed),
                    "verify_keys": str(pub), "valid_keys": ring.key_ids})
        return
    say(f"2/2 {seed} now holds {new_key.key_id}; control planes re-read it within a second")
    say(f"when every document's head is signed by {new_key.key_id}: rudder keys retire {old.key_id}")


@app.command("retire")
def retire(
    key_id: Annotated[str, typer.Argument(help="Key id to remove from the verify-keys file.")],
    verify_keys: VerifyKeysOpt = None,
    signing_key: SigningKeyOpt = None,
) -> None:
    """Stop accepting a key: routers refuse what it signs once they re-read the file."""
    pub, seed, ring, signing = _current(verify_keys, signing_key)
    if key_id not in ring.keys:
        raise CliError(ExitCode.USAGE, f"key {key_id} is not in {pub} (valid: {', '.join(ring.key_ids)})")
    if key_id == signing:
        raise CliError(ExitCode.USAGE, f"key {key_id} is the signing key in {seed}; rotate first")
    rest = Keyring({k: v for k, v in ring.keys.items() if k != key_id})
    if not rest.keys:
        raise CliError(ExitCode.USAGE, f"key {key_id} is the last key in {pub}")
    write_keyring(pub, rest)
    if shared.json_mode():
        print_json({"retired": key_id, "valid_keys": rest.key_ids})
        return
    say(f"key {key_id} retired from {pub} (valid: {', '.join(rest.key_ids)})")
