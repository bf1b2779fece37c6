"""Shared pieces of every sub-app: the group that turns ``CliError`` into an exit code, and the
accessors commands use to reach the global options (``--server``, ``--token``, ``--json``)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import replace
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from cli.client import AdminClient
from cli.config import Settings
from cli.errors import CliError
from cli.output import report_error
from cli.params import PairError, Parameters, parse_names, parse_parameters

JSON_HELP = "Print only JSON on stdout (for scripts)."


def _json_after_subcommand(value: bool) -> None:
    # Parsed after the root callback has stored the settings, so it only ever turns JSON on.
    if value:
        use_settings(replace(settings(), json=True))


def _json_option() -> Any:
    """``--json`` as an option of a command: the same flag as the root's, built by typer itself
    (from a one-parameter command) so that help and parsing are typer's own."""
    probe = typer.Typer(add_completion=False)

    @probe.command()
    def probe_command(
        json_output: Annotated[bool, typer.Option(
            "--json", help=JSON_HELP, callback=_json_after_subcommand, expose_value=False)] = False,
    ) -> None:
        """Never run."""

    return typer.main.get_command(probe).params[0]


def _add_json_option(group: TyperGroup, option: Any) -> None:
    for command in group.commands.values():
        if isinstance(command, TyperGroup):
            _add_json_option(command, option)
        elif not any("--json" in p.opts for p in command.params):
            command.params.append(option)


class RudderGroup(TyperGroup):
    """The root group. Reports a ``CliError`` raised by any command on stderr and exits with its
    code (caught once here, commands stay free of try/except boilerplate), and gives every
    command a ``--json`` of its own, so ``rudder workers list --json`` means ``rudder --json
    workers list`` (as with kubectl, gh and docker).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _add_json_option(self, _json_option())

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as err:
            report_error(err, json_mode=settings().json)
            raise typer.Exit(int(err.exit_code)) from None


_SETTINGS: ContextVar[Settings | None] = ContextVar("rudder_cli_settings", default=None)


def use_settings(value: Settings) -> None:
    """Called by the root callback once per invocation."""
    _SETTINGS.set(value)


def settings() -> Settings:
    return _SETTINGS.get() or Settings()


def json_mode() -> bool:
    return settings().json


def client() -> AdminClient:
    return AdminClient(settings())


def parameters(values: list[str], param_hint: str = "NAME=VALUE") -> Parameters:
    """Parse ``name=value`` arguments into a write's parameters; a bad pair is a usage error
    (exit 2) naming the pair."""
    try:
        return parse_parameters(values)
    except PairError as exc:
        raise typer.BadParameter(str(exc), param_hint=param_hint) from None


def names(values: list[str], param_hint: str = "NAME") -> list[str]:
    try:
        return parse_names(values)
    except PairError as exc:
        raise typer.BadParameter(str(exc), param_hint=param_hint) from None


def new_app(help_text: str) -> typer.Typer:
    return typer.Typer(
        help=help_text, no_args_is_help=True, add_completion=False, rich_markup_mode=None
    )
