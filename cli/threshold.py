"""``rudder threshold``: busy thresholds (admission) through the compatible endpoint.

No revision is needed: the control plane merges with the head and retries its own CAS, so
concurrent partial updates of different thresholds never lose each other. ``--revision`` makes a
write conditional anyway.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli import app as shared
from cli.output import print_json, say, show, table

app = shared.new_app("Busy thresholds: when a worker counts as busy (admission).")

Model = Annotated[str, typer.Argument(help="Model name.")]
RevisionOpt = Annotated[
    int | None,
    typer.Option("--revision", "-r", min=0, help="Only write if this is the head revision."),
]
PATH = "/router_policy/busy_threshold"


def _print(result: dict[str, Any]) -> None:
    if shared.json_mode():
        print_json(result)
        return
    changed = result.get("changed")
    suffix = "" if changed is None else (" (changed)" if changed else " (unchanged)")
    say(f"{result.get('model')} busy_threshold: revision {result.get('revision')}{suffix}")
    thresholds = {k: v for k, v in (result.get("thresholds") or {}).items()}
    if thresholds:
        show(table(["threshold", "value"], sorted(thresholds.items())))
    else:
        say("  no thresholds set (checks disabled unless a router's startup value sets one)")


@app.command("get")
def get(model: Model) -> None:
    """Show the busy thresholds of a model."""
    with shared.client() as api:
        _print(api.get(PATH, {"model": model}))


@app.command("set")
def set_(
    model: Model,
    parameters: Annotated[
        list[str],
        typer.Argument(help="name=value, e.g. active_decode_blocks_threshold=0.8."),
    ],
    create: Annotated[
        bool, typer.Option("--create", help="Create the model's document if it is unknown.")
    ] = False,
    revision: RevisionOpt = None,
) -> None:
    """Set thresholds; thresholds not named keep their value."""
    # The compatible API takes the parameters as top-level fields.
    body: dict[str, Any] = {"model": model, **shared.parameters(parameters)}
    if create:
        body["create"] = True
    if revision is not None:
        body["expected_revision"] = revision
    with shared.client() as api:
        _print(api.post(PATH, body))


@app.command("unset")
def unset(
    model: Model,
    thresholds: Annotated[list[str], typer.Argument(help="Threshold names to remove.")],
    revision: RevisionOpt = None,
) -> None:
    """Remove threshold overrides (back to the routers' startup values)."""
    body: dict[str, Any] = {"model": model, "unset": shared.names(thresholds)}
    if revision is not None:
        body["expected_revision"] = revision
    with shared.client() as api:
        _print(api.post(PATH, body))
