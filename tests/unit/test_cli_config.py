"""Where the CLI finds its server and token: flag, environment, then ``.rudder/credentials``."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from cli.config import (
    DEFAULT_SERVER,
    parse_credentials,
    read_credentials,
    resolve,
    write_credentials,
)


def test_parse_credentials() -> None:
    text = """
# comment
RUDDER_SERVER=http://127.0.0.1:9090/
export RUDDER_TOKEN="rdr_abc=="
garbage line
=nokey
OTHER='x y'
"""
    assert parse_credentials(text) == {
        "RUDDER_SERVER": "http://127.0.0.1:9090/", "RUDDER_TOKEN": "rdr_abc==", "OTHER": "x y",
    }


def test_write_then_read_round_trip_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / ".rudder" / "credentials"
    write_credentials(path, {"RUDDER_SERVER": "http://h:1", "RUDDER_TOKEN": "t=1"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_credentials(path) == {"RUDDER_SERVER": "http://h:1", "RUDDER_TOKEN": "t=1"}


def test_missing_file_is_empty(tmp_path: Path) -> None:
    assert read_credentials(tmp_path / "nope") == {}


def test_resolution_order() -> None:
    creds = {"RUDDER_SERVER": "http://file:1/", "RUDDER_TOKEN": "file-token"}
    s = resolve(None, None, credentials=creds)
    assert (s.server, s.token) == ("http://file:1", "file-token")
    s = resolve("http://flag:2", None, credentials=creds)
    assert (s.server, s.token) == ("http://flag:2", "file-token")
    s = resolve("http://flag:2", "flag-token", credentials=creds)
    assert (s.server, s.token) == ("http://flag:2", "flag-token")
    s = resolve(None, None, credentials={})
    assert (s.server, s.token) == (DEFAULT_SERVER, None)


def test_cwd_credentials_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_credentials(tmp_path / ".rudder" / "credentials",
                      {"RUDDER_SERVER": "http://cwd:3", "RUDDER_TOKEN": "cwd-token"})
    monkeypatch.chdir(tmp_path)
    s = resolve(None, None)
    assert (s.server, s.token) == ("http://cwd:3", "cwd-token")


def test_token_never_in_repr() -> None:
    assert "secret" not in repr(resolve("http://x", "secret", credentials={}))
