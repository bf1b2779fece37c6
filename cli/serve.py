"""``rudder serve``: run one process of the fleet in the foreground.

Each subcommand builds that process's one settings object (``RUDDER_*`` environment variables,
overridden by the flags given here), configures logging (entry points are the only place that
does) and hands over to the package's blocking ``run(settings)``.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli import app as shared
from cli.errors import CliError, ExitCode
from cli.loader import load
from controlplane.telemetry.logs import configure_logging

app = shared.new_app("Run a control plane, router or worker in the foreground.")


def _configure_logging(level: str) -> None:
    """Logging, and the event loop every served process runs on: uvloop when installed
    (``uvicorn[standard]`` brings it), since each package's ``run`` uses ``asyncio.run``."""
    try:
        configure_logging(level)
    except ValueError as exc:
        raise CliError(ExitCode.USAGE, str(exc)) from exc
    try:
        import asyncio

        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


def _settings(module: str, cls: str, overrides: dict[str, Any]) -> Any:
    """Build a settings object; a bad value stops start-up with a message naming it."""
    from pydantic import ValidationError

    factory = load(module, cls)
    try:
        return factory(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{_setting_name(e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise CliError(ExitCode.USAGE, f"bad setting: {problems}") from exc


def _setting_name(loc: tuple[int | str, ...]) -> str:
    """``("mock", "speedup_ratio")`` → ``RUDDER_MOCK__SPEEDUP_RATIO`` (the variable to fix)."""
    return "RUDDER_" + "__".join(str(p) for p in loc).upper() if loc else "settings"


@app.command("controlplane")
def controlplane(
    host: Annotated[str | None, typer.Option("--host", help="Admin API host.")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Admin API port.")] = None,
    nats_url: Annotated[str | None, typer.Option("--nats-url")] = None,
    database_url: Annotated[str | None, typer.Option("--database-url")] = None,
) -> None:
    """The admin API (the only write path) with its reconciler."""
    settings = _settings("controlplane.settings", "ControlPlaneSettings", {
        "admin_host": host, "admin_port": port, "nats_url": nats_url,
        "database_url": database_url,
    })
    _configure_logging(settings.log_level)
    load("controlplane.server", "run")(settings)


@app.command("router")
def router(
    model: Annotated[
        list[str] | None, typer.Option("--model", "-m", help="Model served (repeatable).")
    ] = None,
    host: Annotated[str | None, typer.Option("--host")] = None,
    port: Annotated[int | None, typer.Option("--port", help="OpenAI API port.")] = None,
    mode: Annotated[
        str | None,
        typer.Option("--mode", help="kv (= kv-time), kv-time, kv-blocks, round_robin, random or least_loaded."),
    ] = None,
    no_kv_events: Annotated[
        bool, typer.Option("--no-kv-events", help="Approximate mode: index own decisions.")
    ] = False,
    role: Annotated[
        str | None, typer.Option("--role", help="aggregated, prefill or decode.")
    ] = None,
    nats_url: Annotated[str | None, typer.Option("--nats-url")] = None,
    router_id: Annotated[str | None, typer.Option("--router-id")] = None,
) -> None:
    """A router replica: OpenAI API, KV-aware selection, policy consumer."""
    settings = _settings("router.settings", "RouterSettings", {
        "models": model or None, "host": host, "port": port, "mode": mode,
        "kv_events": False if no_kv_events else None, "role": role, "nats_url": nats_url,
        "router_id": router_id,
    })
    _configure_logging(settings.log_level)
    load("router.app", "run")(settings)


@app.command("worker")
def worker(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model served.")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="mock or vllm.")] = None,
    host: Annotated[str | None, typer.Option("--host")] = None,
    port: Annotated[int | None, typer.Option("--port", help="OpenAI API port (0 = free).")] = None,
    role: Annotated[
        str | None, typer.Option("--role", help="aggregated, prefill or decode.")
    ] = None,
    dp_size: Annotated[int | None, typer.Option("--dp-size", min=1)] = None,
    nats_url: Annotated[str | None, typer.Option("--nats-url")] = None,
    speedup_ratio: Annotated[
        float | None, typer.Option("--speedup-ratio", help="Mock engine: divide every duration.")
    ] = None,
) -> None:
    """A worker: an engine (mock or vLLM) with membership, heartbeats and KV events."""
    overrides: dict[str, Any] = {
        "model": model, "engine": engine, "host": host, "port": port, "role": role,
        "dp_size": dp_size, "nats_url": nats_url,
    }
    if speedup_ratio is not None:
        overrides["mock"] = {"speedup_ratio": speedup_ratio}
    settings = _settings("worker.settings", "WorkerSettings", overrides)
    _configure_logging(settings.log_level)
    load("worker.agent", "run")(settings)
