"""Shared pieces of every sub-app: the group that turns ``CliError`` into an exit code, and the
accessors commands use to reach the global options (``--server``, ``--token``, ``--json``)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import typer
from typer.core import TyperGroup

from cli.client import AdminClient
from cli.config import Settings
from cli.errors import CliError
from cli.output import report_error
from cli.params import PairError, Value, parse_names, parse_pairs


class RudderGroup(TyperGroup):
    """Report a ``CliError`` raised by any command on stderr and exit with its code.

    Catching it once here, at the root group, keeps commands free of try/except boilerplate.
    """

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


def pairs(values: list[str], param_hint: str = "NAME=VALUE") -> dict[str, Value]:
    """Parse ``name=value`` arguments; a bad pair is a usage error (exit 2) naming the pair."""
    try:
        return parse_pairs(values)
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
