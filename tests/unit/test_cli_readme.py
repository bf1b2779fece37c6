"""The README's quick start and ``.ci/run`` must agree: CI runs exactly the documented tests."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)\n```", quick, flags=re.S)


def test_quick_start_is_exactly_two_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert commands[0].endswith("rudder up")
    assert "pytest" in commands[1]
    for command in commands:  # each does its own install
        assert command.startswith("python3 -m venv .venv && .venv/bin/pip install -e ")


def test_ci_runs_the_readme_test_command() -> None:
    pytest_part = _readme_commands()[1].split(" && ")[-1]
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert pytest_part in ci_lines
    install_part = _readme_commands()[1].split(" && ")[1]
    assert install_part.replace("pip install", "pip install --quiet") in ci_lines
