"""CLI conventions users of kubectl, gh and docker expect: ``--json`` before or after the command,
``rudder --version``, shell completion that installs and completes."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner

from cli.embedded import free_port
from cli.errors import ExitCode
from cli.main import app

NO_ENV = {"RUDDER_TOKEN": None, "RUDDER_SERVER": None}

# Commands that ask the admin API something; with nothing listening they end in exit code 5,
# whose error is JSON on stderr exactly when --json is in effect.
READ_COMMANDS = [
    ["workers", "list"],
    ["routers", "list"],
    ["policy", "list"],
    ["policy", "get", "m"],
    ["threshold", "get", "m"],
    ["audit", "log"],
]


def _unreachable() -> list[str]:
    return ["--server", f"http://127.0.0.1:{free_port()}", "--token", "t"]


@pytest.mark.parametrize("command", READ_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("where", ["before", "after"])
def test_json_before_or_after_the_command(command: list[str], where: str) -> None:
    argv = ["--json", *command] if where == "before" else [*command, "--json"]
    result = CliRunner().invoke(app, [*_unreachable(), *argv], env=NO_ENV)
    assert result.exit_code == ExitCode.UNAVAILABLE, result.output
    assert result.stdout == ""
    assert json.loads(result.stderr)["error"]["exit_code"] == ExitCode.UNAVAILABLE


@pytest.mark.parametrize("command", READ_COMMANDS[:2], ids=" ".join)
def test_without_json_the_error_is_for_humans(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*_unreachable(), *command], env=NO_ENV)
    assert result.exit_code == ExitCode.UNAVAILABLE
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.stderr)
    assert "cannot reach the control plane" in result.stderr


def test_every_command_takes_json() -> None:
    missing = []

    def walk(group: TyperGroup, path: list[str]) -> None:
        for name, command in group.commands.items():
            if isinstance(command, TyperGroup):
                walk(command, [*path, name])
            elif sum("--json" in p.opts for p in command.params) != 1:
                missing.append(" ".join([*path, name]))

    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    walk(root, [])
    assert not missing
    help_text = CliRunner().invoke(app, ["workers", "list", "--help"]).stdout
    assert "--json" in help_text


def test_json_after_the_command_is_still_a_flag_not_an_argument() -> None:
    # `policy get` takes one model: --json after it must not be taken as a second argument.
    result = CliRunner().invoke(app, [*_unreachable(), "policy", "get", "--json", "m"], env=NO_ENV)
    assert result.exit_code == ExitCode.UNAVAILABLE
    assert json.loads(result.stderr)["error"]["exit_code"] == ExitCode.UNAVAILABLE


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"rudder {version('rudder')}"
    # Eager: it answers before anything needs a server or a subcommand.
    assert CliRunner().invoke(app, ["--server", "not a url", "--version"]).exit_code == 0


def test_show_completion_prints_a_script_for_the_shell() -> None:
    result = CliRunner().invoke(app, ["--show-completion", "bash"], prog_name="rudder")
    assert result.exit_code == 0, result.output
    assert "_RUDDER_COMPLETE=complete_bash" in result.stdout
    assert "complete -o default -F _rudder_completion rudder" in result.stdout


def test_install_completion_writes_it_into_the_shell_startup(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["--install-completion", "bash"], prog_name="rudder",
                                env={"HOME": str(tmp_path)})
    assert result.exit_code == 0, result.output
    bashrc = (tmp_path / ".bashrc").read_text()
    script = tmp_path / ".bash_completions" / "rudder.sh"
    assert str(script.relative_to(tmp_path)) in bashrc or str(script) in bashrc
    assert "_rudder_completion" in script.read_text()


@pytest.mark.parametrize(
    ("words", "expected"),
    [("rudder wor", "workers"), ("rudder workers l", "list"), ("rudder workers list --j", "--json"),
     ("rudder --ver", "--version")],
)
def test_completion_completes(words: str, expected: str) -> None:
    """What the installed script asks the program, answered by the real command tree."""
    env = {"_RUDDER_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - 1)}
    result = CliRunner().invoke(app, [], prog_name="rudder", env=env)
    assert expected in result.stdout.split(), result.stdout
