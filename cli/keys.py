"""``rudder keys``: the control plane's signing keys (DESIGN §9), as local files, for both
purposes of the one signature scheme: ``--purpose policy`` (the default: policy events, which
routers verify) and ``--purpose checkpoint`` (audit checkpoints, which ``rudder audit verify``
checks).

- ``new``: a new seed file (mode 0600) and its public key added to the verify-keys file
  (``rudder audit keygen PATH`` is an alias of ``new --purpose checkpoint --signing-key PATH
  --if-missing``); a legacy checkpoint key file is read and written again in the current form;
- ``list``: the keys of a verify-keys file, and which one the seed file holds;
- ``rotate``: a new key joins the verify-keys file first, then, after ``--wait`` seconds (routers
  re-read the file on their tick), replaces the seed file; control planes re-read it within their
  ``key_poll_s``. Both keys stay valid until ``retire`` removes the old one;
- ``retire``: remove a key from the verify-keys file (never the one the seed file holds; never a
  checkpoint key: the checkpoints it signed must stay verifiable).

Paths come from ``--signing-key`` / ``--verify-keys``, then the purpose's settings
(``RUDDER_POLICY_SIGNING_KEY`` / ``RUDDER_POLICY_VERIFY_KEYS``, or ``RUDDER_AUDIT_SIGNING_KEY`` /
``RUDDER_AUDIT_VERIFY_KEYS``), then the files ``rudder up`` keeps under ``.rudder/keys/``
(``<purpose>.seed``, ``<purpose>.pub``). The seed itself is never printed.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from bus.keyfiles import load_keyring, read_signing_key, write_keyring, write_signing_key
from cli import app as shared
from cli.errors import CliError, ExitCode
from cli.output import note, print_json, say, show, table
from controlplane.protocol.errors import KeyFileInvalid
from controlplane.protocol.signing import Keyring, Purpose, SigningKey

app = shared.new_app("Signing keys (policy events, audit checkpoints): Ed25519 seed (secret) and "
                     "verify-keys file (public).")

KEYS_DIR = Path(".rudder") / "keys"
#: The settings that name each purpose's files (signing key, verify keys).
SETTINGS = {Purpose.POLICY: ("RUDDER_POLICY_SIGNING_KEY", "RUDDER_POLICY_VERIFY_KEYS"),
            Purpose.CHECKPOINT: ("RUDDER_AUDIT_SIGNING_KEY", "RUDDER_AUDIT_VERIFY_KEYS")}


def seed_name(purpose: Purpose) -> str:
    return f"{purpose.value}.seed"


def pub_name(purpose: Purpose) -> str:
    return f"{purpose.value}.pub"

def _fail(exc: KeyFileInvalid) -> CliError:
    return CliError(ExitCode.USAGE, exc.message)


def _keyring_or_empty(path: Path, purpose: Purpose) -> Keyring:
    if not path.exists():
        return Keyring({}, purpose)
    try:
        return load_keyring(path, purpose=purpose)
    except KeyFileInvalid as exc:
        if "holds no public key" in exc.message:
            return Keyring({}, purpose)
        raise _fail(exc) from exc


def add_public_key(verify_keys: Path, key: SigningKey) -> Keyring:
    """Add ``key``'s public key to the verify-keys file (created if missing); returns the result."""
    ring = _keyring_or_empty(verify_keys, key.purpose).union(Keyring.of([key.public_key], key.purpose))
    write_keyring(verify_keys, ring)
    return ring


def ensure_key(seed: Path, pub: Path, purpose: Purpose = Purpose.POLICY) -> tuple[SigningKey, bool]:
    """The key of ``seed``, made if the file is missing (a legacy checkpoint key file is written
    again in the current form); its public key is added to ``pub`` if it is not there. Returns
    (key, whether it was made)."""
    made = False
    try:
        if seed.exists():
            key, legacy = read_signing_key(seed, purpose=purpose)
            if legacy:
                write_signing_key(seed, key)
        else:
            key, made = SigningKey.generate(purpose), True
            write_signing_key(seed, key)
    except KeyFileInvalid as exc:
        raise CliError(ExitCode.ERROR, exc.message) from exc
    if key.key_id not in _keyring_or_empty(pub, purpose).keys:
        add_public_key(pub, key)
    return key, made


def ensure_keys(keys_dir: Path, purpose: Purpose = Purpose.POLICY, *,
                legacy_seed: Path | None = None) -> tuple[Path, Path, bool]:
    """``rudder up``: the seed and verify-keys files of ``purpose`` under ``keys_dir`` (mode
    0700), made on the first start and reused after. ``legacy_seed``: a key file an earlier
    version kept elsewhere; when it exists and the seed does not, its key moves here (converted),
    so what it signed still verifies. Returns (seed path, verify-keys path, whether a key was
    made)."""
    keys_dir.mkdir(parents=True, exist_ok=True)
    keys_dir.chmod(0o700)
    seed, pub = keys_dir / seed_name(purpose), keys_dir / pub_name(purpose)
    if legacy_seed is not None and legacy_seed.exists() and not seed.exists():
        try:
            write_signing_key(seed, read_signing_key(legacy_seed, purpose=purpose)[0])
        except KeyFileInvalid as exc:
            raise CliError(ExitCode.ERROR, exc.message) from exc
    _, made = ensure_key(seed, pub, purpose)
    return seed, pub, made


def _paths(purpose: Purpose, signing_key: Path | None, verify_keys: Path | None) -> tuple[Path, Path]:
    """(seed file, verify-keys file): the options, else the purpose's settings, else the files
    ``rudder up`` keeps."""
    seed_env, pub_env = SETTINGS[purpose]
    seed = signing_key or (Path(os.environ[seed_env]) if os.environ.get(seed_env) else KEYS_DIR / seed_name(purpose))
    pub = verify_keys or (Path(os.environ[pub_env]) if os.environ.get(pub_env) else KEYS_DIR / pub_name(purpose))
    return seed, pub


PurposeOpt = Annotated[Purpose, typer.Option(
    "--purpose", case_sensitive=False,
    help="What the key signs: policy events, or audit checkpoints.")]
SigningKeyOpt = Annotated[Path | None, typer.Option(
    "--signing-key",
    help="The control plane's seed file [default: RUDDER_POLICY_SIGNING_KEY or "
         "RUDDER_AUDIT_SIGNING_KEY by purpose, else .rudder/keys/<purpose>.seed].")]
VerifyKeysOpt = Annotated[Path | None, typer.Option(
    "--verify-keys",
    help="The verify-keys file [default: RUDDER_POLICY_VERIFY_KEYS or RUDDER_AUDIT_VERIFY_KEYS by "
         "purpose, else .rudder/keys/<purpose>.pub].")]


def make_key(purpose: Purpose, seed: Path, pub: Path, *, if_missing: bool) -> tuple[SigningKey, bool]:
    """``rudder keys new``: (key, whether it was made). Refuses to replace an existing seed
    unless ``if_missing``."""
    if seed.exists() and not if_missing:
        raise CliError(ExitCode.USAGE, f"{seed} exists; `rudder keys rotate` replaces a key")
    return ensure_key(seed, pub, purpose)


@app.command("new")
def new(
    purpose: PurposeOpt = Purpose.POLICY,
    signing_key: SigningKeyOpt = None,
    verify_keys: VerifyKeysOpt = None,
    if_missing: Annotated[bool, typer.Option(
        "--if-missing", help="Keep an existing seed (and make sure its public key is listed): for "
                             "deployment jobs that run on every start.")] = False,
) -> None:
    """Make a signing key: a seed file (0600) and its public key in the verify-keys file."""
    seed, pub = _paths(purpose, signing_key, verify_keys)
    key, made = make_key(purpose, seed, pub, if_missing=if_missing)
    ring = load_keyring(pub, purpose=purpose)
    if shared.json_mode():
        print_json({"key_id": key.key_id, "public_key": key.public_line.split()[1], "made": made,
                    "signing_key": str(seed), "verify_keys": str(pub), "valid_keys": ring.key_ids})
        return
    if made:
        say(f"key {key.key_id}: seed {seed} (mode 0600), public key added to {pub}")
    else:
        say(f"key {key.key_id}: kept {seed}; its public key is in {pub}")


def _current(purpose: Purpose, verify_keys: Path | None,
             signing_key: Path | None) -> tuple[Path, Path, Keyring, str | None]:
    """(verify-keys file, seed file, the valid keys, the signing key's id if the seed exists)."""
    seed, pub = _paths(purpose, signing_key, verify_keys)
    try:
        ring = load_keyring(pub, purpose=purpose)
        signing = read_signing_key(seed, purpose=purpose)[0].key_id if seed.exists() else None
    except KeyFileInvalid as exc:
        raise _fail(exc) from exc
    return pub, seed, ring, signing


@app.command("list")
def list_keys(
    purpose: PurposeOpt = Purpose.POLICY,
    verify_keys: VerifyKeysOpt = None,
    signing_key: SigningKeyOpt = None,
) -> None:
    """The valid public keys, and which one signs."""
    pub, _, ring, signing = _current(purpose, verify_keys, signing_key)
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
    purpose: PurposeOpt = Purpose.POLICY,
    signing_key: SigningKeyOpt = None,
    verify_keys: VerifyKeysOpt = None,
    wait: Annotated[float, typer.Option(
        "--wait", min=0, help="Seconds between publishing the new public key and switching the seed "
                              "(routers must have re-read the verify-keys file).")] = 3.0,
) -> None:
    """New key: add its public key, wait, switch the seed. The old key stays valid until retired."""
    seed, pub = _paths(purpose, signing_key, verify_keys)
    try:
        old = read_signing_key(seed, purpose=purpose)[0]
    except KeyFileInvalid as exc:
        raise _fail(exc) from exc
    if old.key_id not in _keyring_or_empty(pub, purpose).keys:
        add_public_key(pub, old)  # what the old key signed stays verifiable
    new_key = SigningKey.generate(purpose)
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
    if purpose is Purpose.POLICY:
        say(f"when every document's head is signed by {new_key.key_id}: rudder keys retire {old.key_id}")
    else:
        say(f"keep {old.key_id} in {pub}: the checkpoints it signed are verified with it")


@app.command("retire")
def retire(
    key_id: Annotated[str, typer.Argument(help="Key id to remove from the verify-keys file.")],
    purpose: PurposeOpt = Purpose.POLICY,
    verify_keys: VerifyKeysOpt = None,
    signing_key: SigningKeyOpt = None,
) -> None:
    """Stop accepting a key: routers refuse what it signs once they re-read the file."""
    if purpose is Purpose.CHECKPOINT:
        raise CliError(ExitCode.USAGE, "checkpoint keys are never retired: `rudder audit verify` needs "
                                       "every key that signed a checkpoint")
    pub, seed, ring, signing = _current(purpose, verify_keys, signing_key)
    if key_id not in ring.keys:
        raise CliError(ExitCode.USAGE, f"key {key_id} is not in {pub} (valid: {', '.join(ring.key_ids)})")
    if key_id == signing:
        raise CliError(ExitCode.USAGE, f"key {key_id} is the signing key in {seed}; rotate first")
    rest = Keyring({k: v for k, v in ring.keys.items() if k != key_id}, purpose)
    if not rest.keys:
        raise CliError(ExitCode.USAGE, f"key {key_id} is the last key in {pub}")
    write_keyring(pub, rest)
    if shared.json_mode():
        print_json({"retired": key_id, "valid_keys": rest.key_ids})
        return
    say(f"key {key_id} retired from {pub} (valid: {', '.join(rest.key_ids)})")
