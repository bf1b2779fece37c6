"""``rudder keys new|list|rotate|retire`` on real files (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from bus.keyfiles import load_keyring, load_signing_key
from cli.keys import ensure_keys
from cli.main import app


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), env={"RUDDER_POLICY_SIGNING_KEY": None,
                                                      "RUDDER_POLICY_VERIFY_KEYS": None})
    return result.exit_code, result.stdout, result.stderr


def test_new_list_rotate_retire(tmp_path: Path) -> None:
    seed, pub = tmp_path / "cp.seed", tmp_path / "routers.pub"
    files = ["--signing-key", str(seed), "--verify-keys", str(pub)]
    code, out, _ = run("--json", "keys", "new", *files)
    assert code == 0, out
    first = json.loads(out)["key_id"]
    assert seed.stat().st_mode & 0o777 == 0o600
    assert load_keyring(pub).key_ids == [first] and load_signing_key(seed).key_id == first
    seed_text = seed.read_text().splitlines()[-1]

    code, _, err = run("keys", "new", *files)
    assert code == 2 and "exists" in err  # never overwrites a key
    code, out, _ = run("--json", "keys", "new", "--if-missing", *files)
    assert code == 0 and json.loads(out)["key_id"] == first and json.loads(out)["made"] is False

    code, out, _ = run("--json", "keys", "rotate", *files, "--wait", "0")
    assert code == 0, out
    rotated = json.loads(out)
    second = rotated["new_key_id"]
    assert rotated["old_key_id"] == first and sorted(rotated["valid_keys"]) == sorted([first, second])
    assert load_signing_key(seed).key_id == second
    assert seed.stat().st_mode & 0o777 == 0o600
    assert set(load_keyring(pub).key_ids) == {first, second}  # both valid until retired

    code, out, _ = run("--json", "keys", "list", *files)
    assert code == 0
    assert {(k["key_id"], k["signing"]) for k in json.loads(out)} == {(first, False), (second, True)}

    code, _, err = run("keys", "retire", second, *files)
    assert code == 2 and "signing key" in err
    code, _, err = run("keys", "retire", "0000000000000000", *files)
    assert code == 2 and "not in" in err
    code, out, _ = run("keys", "retire", first, *files)
    assert code == 0, out
    assert load_keyring(pub).key_ids == [second]
    assert seed_text not in out and seed.read_text().splitlines()[-1] not in out


def test_ensure_keys_makes_once_and_reuses(tmp_path: Path) -> None:
    seed, pub, made = ensure_keys(tmp_path / "keys")
    assert made and (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    kid = load_signing_key(seed).key_id
    again_seed, again_pub, made_again = ensure_keys(tmp_path / "keys")
    assert not made_again and (again_seed, again_pub) == (seed, pub)
    assert load_signing_key(seed).key_id == kid and load_keyring(pub).key_ids == [kid]
    pub.unlink()  # a lost verify-keys file is rebuilt from the seed
    ensure_keys(tmp_path / "keys")
    assert load_keyring(pub).key_ids == [kid]
