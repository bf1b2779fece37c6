"""controlplane.telemetry.logs: the one log setup (text by default, JSON lines on request)."""

from __future__ import annotations

import io
import json
import logging

import pytest

from controlplane.telemetry import logs


@pytest.fixture
def restore_root() -> object:
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved:
        root.addHandler(h)
    root.setLevel(level)


def test_text_is_the_default(restore_root: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(logs.FORMAT_ENV, raising=False)
    out = io.StringIO()
    logs.configure_logging("INFO", stream=out)
    logging.getLogger("rudder.test").info("plain %s", "line")
    assert out.getvalue().rstrip().endswith("INFO rudder.test: plain line")


def test_json_lines_carry_bound_ids_and_extra(restore_root: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    out = io.StringIO()
    logs.configure_logging("INFO", stream=out)
    log = logging.getLogger("rudder.test")
    with logs.bound(request_id="r-1", router_id="r1"):
        log.info("first\nline")
        log.warning("second", extra={"revision": 7, "router_id": "other"})
    log.info("outside")
    first, second, outside = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["message"] == "first\nline" and first["level"] == "INFO" and first["logger"] == "rudder.test"
    assert first["request_id"] == "r-1" and first["router_id"] == "r1" and "revision" not in first
    assert second["revision"] == 7 and second["router_id"] == "other"  # extra wins
    assert "request_id" not in outside


def test_binding_none_removes_an_id_and_binding_adds_to_the_context() -> None:
    with logs.bound(request_id="r-1", worker_id=5):
        with logs.bound(worker_id=None, revision="selection=3"):
            assert logs.current_ids() == {"request_id": "r-1", "revision": "selection=3"}
        assert logs.current_ids() == {"request_id": "r-1", "worker_id": 5}
    assert logs.current_ids() == {}


def test_a_bad_format_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="RUDDER_LOG_FORMAT"):
        logs.log_format("yaml")
