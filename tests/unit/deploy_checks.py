"""What deployment files (compose.yaml, deploy/kubernetes) are held against: the real CLI and the
real settings classes.

A container's arguments are parsed by the click command behind ``rudder`` (unknown commands or
options are usage errors, as they would be at start-up); each ``RUDDER_*`` variable must name a
field of the settings class of the process it is given to (``RUDDER_VLLM__MODEL_PATH`` a nested
one), or an environment fallback of a CLI option (``RUDDER_SERVER``). Names the deployments use
ahead of the work that brings them are listed once, in tests/unit/test_kubernetes.py
(``PENDING_SETTINGS``, ``PENDING_COMMANDS``), until that work lands.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import typer
from pydantic import BaseModel
from pydantic_settings import BaseSettings
from typer._click.core import Command  # typer (0.29) carries its own copy of click
from typer._click.exceptions import UsageError
from typer.core import TyperGroup

from bus.settings import BusAdminSettings
from cli.main import app
from controlplane.settings import ControlPlaneSettings
from router.settings import RouterSettings
from worker.settings import WorkerSettings

# The settings object each command builds (cli/serve.py, cli/bus.py; `db upgrade` reads
# RUDDER_DATABASE_URL and falls back to ControlPlaneSettings, cli/config.py).
SETTINGS_OF: dict[tuple[str, ...], type[BaseSettings]] = {
    ("serve", "controlplane"): ControlPlaneSettings,
    ("serve", "router"): RouterSettings,
    ("serve", "worker"): WorkerSettings,
    ("db", "upgrade"): ControlPlaneSettings,
    ("bus", "init"): BusAdminSettings,
    ("bus", "setup"): BusAdminSettings,
}
# Commands that build that settings object at start (so its values must validate); `db upgrade`
# only reads RUDDER_DATABASE_URL (its names are still checked against ControlPlaneSettings).
BUILDS_SETTINGS = {("serve", "controlplane"), ("serve", "router"), ("serve", "worker"),
                   ("bus", "init"), ("bus", "setup")}
# What a settings object cannot be built without, when neither a flag nor a variable gives it.
REQUIRED: dict[type[BaseSettings], dict[str, Any]] = {
    RouterSettings: {"models": ["m"]},
    WorkerSettings: {"model": "m"},
}


@functools.cache
def root_command() -> TyperGroup:
    """The CLI's click tree, built once per run (typer builds it from the functions' signatures:
    ~85 ms each time, and the checks ask for it for every container)."""
    command = typer.main.get_command(app)
    assert isinstance(command, TyperGroup)
    return command


def command_path(args: list[str], pending: Collection[tuple[str, ...]]) -> tuple[tuple[str, ...], bool]:
    """Parse ``rudder ARGS`` down to the leaf command, with every option checked; return the
    command's path and whether it is a pending one (not built yet, so not parsed further).

    Raises ``UsageError`` for an unknown command or option, a bad value, a missing argument.
    """
    command: Command = root_command()
    ctx = command.make_context("rudder", list(args))
    path: tuple[str, ...] = ()
    while isinstance(command, TyperGroup):
        # click 8 keeps the subcommand's name apart from its arguments until the group is invoked.
        rest = [*getattr(ctx, "_protected_args", ()), *ctx.args]
        if not rest:
            raise UsageError(f"`rudder {' '.join(path)}` needs a subcommand")
        name = rest[0]
        if command.get_command(ctx, name) is None:
            wanted = (*path, name)
            for p in pending:
                if p[: len(wanted)] == wanted and tuple(rest[: len(p) - len(path)]) == p[len(path):]:
                    return p, True
        found, sub, sub_args = command.resolve_command(ctx, rest)
        assert found is not None and sub is not None
        path = (*path, found)
        ctx = sub.make_context(found, sub_args, parent=ctx)
        command = sub
    return path, False


@functools.cache
def cli_envvars() -> frozenset[str]:
    """Every environment fallback of an option anywhere in the CLI (``RUDDER_SERVER``, ...)."""
    names: set[str] = set()

    def walk(command: Command) -> None:
        for param in command.params:
            env = getattr(param, "envvar", None)
            if isinstance(env, str):
                names.add(env)
            elif env:
                names.update(env)
        if isinstance(command, TyperGroup):
            for sub in command.commands.values():
                walk(sub)

    walk(root_command())
    return frozenset(names)


@functools.cache
def cli_reads() -> frozenset[str]:
    """``RUDDER_*`` variables the CLI's commands read from the environment themselves (no settings
    object: ``db upgrade``'s RUDDER_DATABASE_OWNER_URL), found in cli/'s source."""
    import re
    from pathlib import Path

    import cli

    names: set[str] = set()
    for source in Path(cli.__file__).parent.glob("*.py"):
        names.update(re.findall(r"""environ(?:\.get\(|\[)["'](RUDDER_[A-Z0-9_]+)["']""", source.read_text()))
    return frozenset(names)


def allowed_names(path: tuple[str, ...]) -> frozenset[str]:
    """Names a command may be given besides its settings' fields: its options' variables, and for
    commands that build no settings object, what the CLI reads itself."""
    return cli_envvars() | (frozenset() if path in BUILDS_SETTINGS else cli_reads())


def names_a_field(settings: type[BaseSettings], env_name: str) -> bool:
    """Whether ``env_name`` sets a field of ``settings`` (pydantic-settings' own mapping:
    prefix, case-insensitive, nested models joined by the nested delimiter)."""
    config = settings.model_config
    prefix = str(config.get("env_prefix") or "")
    if not env_name.upper().startswith(prefix.upper()):
        return False
    key = env_name[len(prefix):].lower()
    delimiter = config.get("env_nested_delimiter")
    parts = key.split(delimiter) if delimiter else [key]
    fields = settings.model_fields
    for i, part in enumerate(parts):
        if part not in fields:
            return False
        if i < len(parts) - 1:
            annotation = fields[part].annotation
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return False
            fields = annotation.model_fields
    return True


@contextmanager
def only_these_variables(env: Mapping[str, str]) -> Iterator[None]:
    """The process environment with every ``RUDDER_*`` variable replaced by ``env``."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("RUDDER_")}
    for key in saved:
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(saved)


def build_settings(settings: type[BaseSettings], env: Mapping[str, str]) -> BaseSettings:
    """Build ``settings`` from exactly ``env``, as the process would (raises ValidationError)."""
    given = {k.lower() for k in env}
    prefix = str(settings.model_config.get("env_prefix") or "").lower()
    required = {k: v for k, v in REQUIRED.get(settings, {}).items() if prefix + k not in given}
    with only_these_variables(env):
        return settings(**required)
