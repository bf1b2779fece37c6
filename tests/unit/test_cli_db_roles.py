"""`rudder db upgrade` runs as the schema owner only: it never falls back to the app role's URL."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.config import app_role_from_url, database_owner_url
from cli.main import app


def test_db_upgrade_without_the_owner_url_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUDDER_DATABASE_OWNER_URL", raising=False)
    monkeypatch.setenv("RUDDER_DATABASE_URL", "postgresql+asyncpg://rudder_app:pw@127.0.0.1:1/rudder")
    result = CliRunner().invoke(app, ["db", "upgrade"])
    assert result.exit_code == 2
    assert "RUDDER_DATABASE_OWNER_URL" in result.output
    assert "pw@" not in result.output


def test_owner_url_and_app_role_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUDDER_DATABASE_OWNER_URL", "postgresql+asyncpg://owner:x@h/db")
    assert database_owner_url(None) == "postgresql+asyncpg://owner:x@h/db"
    assert database_owner_url("flag") == "flag"
    assert app_role_from_url("postgresql+asyncpg://rudder_app:s3cr%40t@h:5432/db") == "rudder_app"
    assert app_role_from_url("postgresql+asyncpg://h/db") is None
    assert app_role_from_url(None) is None
