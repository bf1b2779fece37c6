"""The ``rudder`` command: one Typer sub-app per noun, global options in the callback."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from cli import admin, audit, bus, explain, fleet, keys, policy, serve, threshold, up
from cli.app import JSON_HELP, RudderGroup, use_settings
from cli.config import DEFAULT_SERVER, resolve
from cli.errors import EXIT_CODES_HELP

app = typer.Typer(
    cls=RudderGroup,
    name="rudder",
    help="Rudder: event-sourced control plane for fleets of KV-aware LLM routers.\n\n"
    "Server and token come from --server/--token, then RUDDER_SERVER/RUDDER_TOKEN, then "
    ".rudder/credentials in the current directory (written by `rudder up`).\n\n"
    + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, powershell)
    rich_markup_mode=None,
    pretty_exceptions_show_locals=False,
)


def rudder_version() -> str:
    try:
        return version("rudder")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"rudder {rudder_version()}")
        raise typer.Exit()


@app.callback()
def main_callback(
    server: Annotated[
        str | None,
        typer.Option("--server", envvar="RUDDER_SERVER", show_default=False,
                     help=f"Admin API URL [default: {DEFAULT_SERVER}]."),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="RUDDER_TOKEN", show_default=False, show_envvar=True,
                     help="Bearer token."),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help=JSON_HELP + " Also accepted after the command.")
    ] = False,
    _version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, expose_value=False,
                           help="Print the version and exit.")
    ] = False,
) -> None:
    use_settings(resolve(server, token, json_output=json_output))


app.add_typer(policy.app, name="policy")
app.add_typer(threshold.app, name="threshold")
app.add_typer(fleet.routers_app, name="routers")
app.add_typer(fleet.workers_app, name="workers")
app.add_typer(audit.app, name="audit")
app.add_typer(admin.token_app, name="token")
app.add_typer(admin.db_app, name="db")
app.add_typer(bus.app, name="bus")
app.add_typer(keys.app, name="keys")
app.add_typer(serve.app, name="serve")
app.command("up")(up.up)
app.command("status")(up.status)
app.command("explain")(explain.explain)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
