"""Exit codes: the mapping from admin-API statuses, and what the CLI does with them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.embedded import free_port
from cli.errors import ExitCode, error_for_status, exit_code_for_status
from cli.main import app


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (200, ExitCode.OK), (400, ExitCode.USAGE), (413, ExitCode.USAGE),
        (415, ExitCode.USAGE), (422, ExitCode.USAGE), (409, ExitCode.CONFLICT),
        (401, ExitCode.AUTH), (403, ExitCode.AUTH), (404, ExitCode.NOT_FOUND),
        (503, ExitCode.UNAVAILABLE), (500, ExitCode.ERROR), (502, ExitCode.ERROR),
    ],
)
def test_status_to_exit_code(status: int, code: ExitCode) -> None:
    assert exit_code_for_status(status) is code


def test_error_for_status_uses_the_api_error_shape() -> None:
    body = {"error": {"code": "revision_conflict", "message": "stale",
                      "expected_revision": 3, "head_revision": 5}}
    err = error_for_status(409, body)
    assert err.exit_code is ExitCode.CONFLICT
    assert "revision_conflict" in err.message and "head is 5" in err.message
    assert err.body["head_revision"] == 5


def test_error_for_status_without_a_body() -> None:
    err = error_for_status(502, None)
    assert err.exit_code is ExitCode.ERROR and "502" in err.message


def test_help_documents_the_exit_codes() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "3 revision conflict (409)" in text and "6 not found" in text


def test_a_bad_pair_is_a_usage_error_naming_it() -> None:
    result = CliRunner().invoke(app, ["policy", "set", "m", "credit=abc", "--revision", "1"])
    assert result.exit_code == 2
    assert "credit=abc" in result.output


def test_a_write_needs_a_revision() -> None:
    result = CliRunner().invoke(app, ["--server", f"http://127.0.0.1:{free_port()}",
                                      "policy", "set", "m", "x=1"])
    assert result.exit_code == 2
    assert "--revision" in result.output


def test_connection_refused_exits_5_with_json_error_on_stderr() -> None:
    server = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["--server", server, "--token", "t", "--json",
                                      "policy", "list"])
    assert result.exit_code == ExitCode.UNAVAILABLE
    assert result.stdout == ""
    err = json.loads(result.stderr)["error"]
    assert err["exit_code"] == 5 and server in err["message"]
