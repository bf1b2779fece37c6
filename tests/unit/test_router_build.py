"""router.build: a compiled module older than its source is named (the router logs it at start,
the suite refuses to run on it), in a source checkout only."""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

from router import build

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _checkout(root: Path, *, source_newer: bool, project: bool = True) -> None:
    (root / "router" / "cost").mkdir(parents=True)
    (root / "controlplane").mkdir()
    if project:
        (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    for module in ("router/scheduler", "router/cost/time"):
        source, ext = root / f"{module}.py", root / f"{module}{SUFFIX}"
        source.write_text("x = 1\n")
        ext.write_bytes(b"\0")
        older, newer = (ext, source) if source_newer else (source, ext)
        os.utime(older, (1_000_000, 1_000_000))
        os.utime(newer, (2_000_000, 2_000_000))
    (root / "router" / "helper.so").write_bytes(b"\0")  # an extension with no source: not ours


def test_a_module_edited_after_its_build_is_named(tmp_path: Path) -> None:
    _checkout(tmp_path, source_newer=True)
    assert build.stale_modules(tmp_path) == ["router/cost/time.py", "router/scheduler.py"]
    assert "router/scheduler.py" in build.advice(build.stale_modules(tmp_path))
    assert "pip install -e ." in build.advice(["router/scheduler.py"])


def test_a_fresh_build_is_not_stale(tmp_path: Path) -> None:
    _checkout(tmp_path, source_newer=False)
    assert [p.name for p in build.compiled_modules(tmp_path)] == [f"time{SUFFIX}", f"scheduler{SUFFIX}"]
    assert build.stale_modules(tmp_path) == []


def test_an_installed_package_is_not_looked_at(tmp_path: Path) -> None:
    _checkout(tmp_path, source_newer=True, project=False)  # a wheel's files: unpack times
    assert build.stale_modules(tmp_path) == []


def test_this_checkout_is_not_stale() -> None:
    """What the suite runs on (tests/conftest.py refuses it otherwise)."""
    assert build.stale_modules() == []
