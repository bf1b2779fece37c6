"""``rudder policy``: read and change policy documents with compare-and-set.

Every write names the revision it expects (``--revision N``), or says ``--latest`` to read the head
first and write against it: an explicit read-modify-write, which still exits 3 when another writer
gets in between.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli import app as shared
from cli.client import AdminClient
from cli.errors import CliError, ExitCode
from cli.output import fmt_time, fmt_value, print_json, say, show, table
from controlplane.protocol.policy import PolicyKind, diff_documents

app = shared.new_app("Read and change routing policy documents (revisioned, compare-and-set).")

KindOpt = Annotated[
    PolicyKind, typer.Option("--kind", "-k", help="Document kind.", case_sensitive=False)
]
RevisionOpt = Annotated[
    int | None,
    typer.Option("--revision", "-r", min=0, help="Expected head revision (0 = no document yet)."),
]
LatestOpt = Annotated[
    bool, typer.Option("--latest", help="Read the head revision first and write against it.")
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Show the resulting document; publish nothing.")
]
Model = Annotated[str, typer.Argument(help="Model name, e.g. meta-llama/Llama-3.1-8B-Instruct.")]


def documents(api: AdminClient, model: str | None = None) -> list[dict[str, Any]]:
    body = api.get("/router_policy", {"model": model})
    docs = body.get("documents", []) if isinstance(body, dict) else []
    return [d for d in docs if isinstance(d, dict)]


def find_document(api: AdminClient, model: str, kind: PolicyKind) -> dict[str, Any]:
    """The (model, kind) document, or an empty revision-0 one when it does not exist yet."""
    for doc in documents(api, model):
        if doc.get("model") == model and doc.get("kind") == kind.value:
            return doc
    return {"model": model, "kind": kind.value, "revision": 0, "document": {}, "routers": []}


def head_revision(api: AdminClient, model: str, kind: PolicyKind) -> int:
    return int(find_document(api, model, kind).get("revision") or 0)


def expected_revision(
    api: AdminClient, model: str, kind: PolicyKind, revision: int | None, latest: bool
) -> int:
    if revision is not None and latest:
        raise typer.BadParameter("give --revision N or --latest, not both", param_hint="--revision")
    if revision is not None:
        return revision
    if latest:
        return head_revision(api, model, kind)
    raise typer.BadParameter(
        "a write needs --revision N (the head you expect) or --latest", param_hint="--revision"
    )


def _print_write(result: dict[str, Any]) -> None:
    if shared.json_mode():
        print_json(result)
        return
    model, kind, op = result.get("model"), result.get("kind"), result.get("op")
    if result.get("dry_run"):
        say(f"dry run: {op} of {model} {kind} at revision {result.get('revision')}; "
            "nothing published")
    else:
        say(f"{op}: {model} {kind} revision {result.get('previous_revision')} → "
            f"{result.get('revision')} (event {result.get('event_id')})")
    diff = result.get("diff")
    if isinstance(diff, dict) and diff:
        show(table(["parameter", "before", "after"], _diff_rows(diff), title="changes"))
    elif not result.get("dry_run"):
        say("no change")
    document = result.get("document") or {}
    title = "resulting document" if result.get("dry_run") else "document"
    if document:
        show(table(["parameter", "override"], sorted(document.items()), title=title))
    else:
        say(f"{title}: no overrides (every router uses its startup values)")


def _diff_rows(diff: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    rows: list[tuple[str, Any, Any]] = []
    for name, change in sorted(diff.items()):
        if isinstance(change, dict):
            rows.append((name, change.get("before"), change.get("after")))
        else:
            rows.append((name, None, change))
    return rows


@app.command("list")
def list_(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model.")] = None,
) -> None:
    """List policy documents with their revision and how many routers run them."""
    with shared.client() as api:
        docs = documents(api, model)
    if shared.json_mode():
        print_json(docs)
        return
    if not docs:
        say("no policy documents (every router runs its startup values)")
        return
    rows = []
    for d in docs:
        routers = [r for r in d.get("routers") or [] if isinstance(r, dict)]
        synced = sum(1 for r in routers if r.get("in_sync"))
        rows.append((d.get("model"), d.get("kind"), d.get("revision"), d.get("document") or {},
                     fmt_time(d.get("updated_at")), d.get("actor"), f"{synced}/{len(routers)}"))
    show(table(["model", "kind", "revision", "overrides", "updated", "actor", "routers in sync"],
               rows))


@app.command("get")
def get(
    model: Model,
    kind: Annotated[
        PolicyKind | None, typer.Option("--kind", "-k", help="Only this kind.")
    ] = None,
) -> None:
    """Show a model's documents, overrides and each router's applied revision."""
    with shared.client() as api:
        kinds = [kind] if kind else list(PolicyKind)
        found = {d.get("kind"): d for d in documents(api, model) if d.get("model") == model}
    docs = [found.get(k.value) or {"model": model, "kind": k.value, "revision": 0,
                                    "document": {}, "routers": []} for k in kinds]
    if shared.json_mode():
        print_json(docs[0] if kind else docs)
        return
    for d in docs:
        say(f"[bold]{model}[/] {d['kind']}: revision {d.get('revision', 0)}"
            + (f", updated {fmt_time(d.get('updated_at'))} by {d.get('actor')}"
               if d.get("updated_at") else ""))
        overrides = d.get("document") or {}
        if overrides:
            show(table(["parameter", "override"], sorted(overrides.items())))
        else:
            say("  no overrides")
        routers = [r for r in d.get("routers") or [] if isinstance(r, dict)]
        if routers:
            show(table(
                ["router", "applied", "in sync", "effective", "last nack"],
                [(r.get("router_id"), r.get("applied_revision"), r.get("in_sync"),
                  r.get("effective") or {}, r.get("last_nack")) for r in routers],
            ))


@app.command("set")
def set_(
    model: Model,
    parameters: Annotated[
        list[str], typer.Argument(help="name=value pairs; value is a JSON number or null.")
    ],
    kind: KindOpt = PolicyKind.SELECTION,
    revision: RevisionOpt = None,
    latest: LatestOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Set overrides: `rudder policy set MODEL overlap_score_credit=0.5 --revision 7`."""
    body: dict[str, Any] = {"model": model, "kind": kind.value,
                            "parameters": shared.parameters(parameters), "dry_run": dry_run}
    with shared.client() as api:
        body["expected_revision"] = expected_revision(api, model, kind, revision, latest)
        result = api.patch("/router_policy", body)
    _print_write(result)


@app.command("unset")
def unset(
    model: Model,
    parameters: Annotated[list[str], typer.Argument(help="Parameter names to remove.")],
    kind: KindOpt = PolicyKind.SELECTION,
    revision: RevisionOpt = None,
    latest: LatestOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Remove overrides (routers return to their startup values for these parameters)."""
    names = shared.names(parameters)
    with shared.client() as api:
        expected = expected_revision(api, model, kind, revision, latest)
        result = api.patch("/router_policy", {
            "model": model, "kind": kind.value, "expected_revision": expected,
            "parameters": dict.fromkeys(names), "dry_run": dry_run,
        })
    _print_write(result)


@app.command("reset")
def reset(
    model: Model,
    kind: KindOpt = PolicyKind.SELECTION,
    revision: RevisionOpt = None,
    latest: LatestOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Remove every override of the document."""
    with shared.client() as api:
        expected = expected_revision(api, model, kind, revision, latest)
        result = api.patch("/router_policy", {
            "model": model, "kind": kind.value, "expected_revision": expected,
            "reset": True, "dry_run": dry_run,
        })
    _print_write(result)


def history_of(
    api: AdminClient, model: str, kind: PolicyKind, limit: int | None = None
) -> list[dict[str, Any]]:
    body = api.get("/router_policy/history", {"model": model, "kind": kind.value, "limit": limit})
    revs = body.get("revisions", []) if isinstance(body, dict) else []
    return [r for r in revs if isinstance(r, dict)]


@app.command("history")
def history(
    model: Model,
    kind: KindOpt = PolicyKind.SELECTION,
    limit: Annotated[int | None, typer.Option("--limit", "-n", min=1)] = None,
) -> None:
    """Revisions of a document, newest first."""
    with shared.client() as api:
        revs = history_of(api, model, kind, limit)
    if shared.json_mode():
        print_json(revs)
        return
    if not revs:
        say(f"no history for {model} {kind.value}")
        return
    show(table(
        ["revision", "at", "actor", "op", "expected", "changes", "document"],
        [(r.get("revision"), fmt_time(r.get("at")), r.get("actor"), r.get("op"),
          r.get("expected_revision"), fmt_value(r.get("changes") or {}),
          fmt_value(r.get("document") or {})) for r in revs],
        title=f"{model} {kind.value}",
    ))


@app.command("diff")
def diff(
    model: Model,
    from_revision: Annotated[
        int, typer.Option("--from", min=0, help="Older revision (0 = before the first write).")
    ],
    to_revision: Annotated[
        int | None, typer.Option("--to", min=0, help="Newer revision (default: the head).")
    ] = None,
    kind: KindOpt = PolicyKind.SELECTION,
) -> None:
    """What changed between two revisions of a document (from its history)."""
    with shared.client() as api:
        revs = history_of(api, model, kind, limit=1000)
    by_rev = {int(r["revision"]): r.get("document") or {} for r in revs if "revision" in r}
    head = max(by_rev, default=0)
    to_rev = head if to_revision is None else to_revision

    def document_at(rev: int) -> dict[str, Any]:
        if rev == 0:
            return {}
        if rev not in by_rev:
            known = ", ".join(str(r) for r in sorted(by_rev)) or "none"
            raise CliError(ExitCode.NOT_FOUND,
                           f"revision {rev} is not in the history of {model} {kind.value} "
                           f"(known: {known})")
        return dict(by_rev[rev])

    before, after = document_at(from_revision), document_at(to_rev)
    changes = diff_documents(before, after)
    if shared.json_mode():
        print_json({"model": model, "kind": kind.value, "from_revision": from_revision,
                    "to_revision": to_rev, "from_document": before, "to_document": after,
                    "changes": changes})
        return
    say(f"{model} {kind.value}: revision {from_revision} → {to_rev}")
    if not changes:
        say("no differences")
        return
    show(table(["parameter", f"r{from_revision}", f"r{to_rev}"], _diff_rows(changes)))


@app.command("rollback")
def rollback(
    model: Model,
    to: Annotated[int, typer.Option("--to", min=0, help="Revision whose document to restore.")],
    kind: KindOpt = PolicyKind.SELECTION,
    revision: RevisionOpt = None,
    latest: LatestOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Restore an older revision's document as a new forward revision."""
    with shared.client() as api:
        expected = expected_revision(api, model, kind, revision, latest)
        result = api.post("/router_policy/rollback", {
            "model": model, "kind": kind.value, "to_revision": to,
            "expected_revision": expected, "dry_run": dry_run,
        })
    _print_write(result)
