"""``rudder policy``: read and change policy documents with compare-and-set.

Every write names the revision it expects (``--revision N``), or says ``--latest`` to read the head
first and write against it: an explicit read-modify-write, which still exits 3 when another writer
gets in between.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import app as shared
from cli import policyset
from cli.client import AdminClient
from cli.errors import CliError, ExitCode
from cli.output import fmt_time, fmt_value, print_json, say, show, table, to_json
from controlplane.protocol.policy import PolicyKind, diff_documents
from controlplane.protocol.policyfile import (
    PlanStep,
    drifted,
    json_schema,
    moved,
    plan,
)
from controlplane.protocol.policyfile import export as export_file
from controlplane.protocol.policyfile import revision_file as revisions_of

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
    model: Annotated[str | None, typer.Argument(help="Model name (with --from).")] = None,
    from_revision: Annotated[
        int | None, typer.Option("--from", min=0, help="Older revision (0 = before the first write).")
    ] = None,
    to_revision: Annotated[
        int | None, typer.Option("--to", min=0, help="Newer revision (default: the head).")
    ] = None,
    kind: KindOpt = PolicyKind.SELECTION,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", help="A policy file or folder: exit 1 when the live state has drifted from it.")] = None,
) -> None:
    """What changed between two revisions of a document (MODEL --from N), or how the live state
    differs from a policy file (-f FILE: exit 1 on drift, for CI)."""
    if file is not None:
        if model is not None or from_revision is not None or to_revision is not None:
            raise typer.BadParameter("give -f FILE, or MODEL --from N, not both", param_hint="--file")
        _drift(file)
        return
    if model is None or from_revision is None:
        raise typer.BadParameter("give MODEL --from N (revisions) or -f FILE (drift)", param_hint="MODEL")
    _revision_diff(model, from_revision, to_revision, kind)


def _revision_diff(model: str, from_revision: int, to_revision: int | None, kind: PolicyKind) -> None:
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


# ---- policy as code (docs/operator-guide.md, "Policy as code") --------------------------------

FileOpt = Annotated[Path, typer.Option(
    "--file", "-f", help="A policy file (YAML or JSON) or a folder of them.")]


def _drift(file: Path) -> None:
    desired = policyset.read_policy_set(file)
    with shared.client() as api:
        steps = plan(desired, policyset.live_heads(api))
    changed = drifted(steps)
    if shared.json_mode():
        print_json({"drifted": bool(changed), "plan": policyset.as_json(steps)})
    else:
        policyset.print_plan(steps, title="drift" if changed else "in sync")
    if changed:
        raise CliError(ExitCode.ERROR, f"{len(changed)} document(s) differ from {file}: "
                       + ", ".join(str(s.key) for s in changed))


@app.command("apply")
def apply(
    file: FileOpt,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan only; write nothing.")] = False,
    revision_file: Annotated[Path | None, typer.Option(
        "--revision-file", help="With --dry-run: write the head revisions the plan was shown against. "
        "Without: apply only if every document is still at those revisions (else exit 3).")] = None,
) -> None:
    """Bring the documents a policy file names to exactly its overrides: show the plan (each
    document's diff against its head, or "no change"), then write each change with
    compare-and-set on the head it was planned against. If any document moved since the plan
    was shown, nothing is applied (exit 3)."""
    desired = policyset.read_policy_set(file)
    expected = policyset.read_revision_file(revision_file) if revision_file and not dry_run else None
    with shared.client() as api:
        steps = plan(desired, policyset.live_heads(api))
        if dry_run:
            if revision_file is not None:
                revision_file.write_text(policyset.dump_yaml(revisions_of(steps)), encoding="utf-8")
            _print_plan_result(steps, [], dry_run=True)
            return
        planned = {s.key: s.revision for s in steps}
        if expected is not None:
            # The dry run's plan, or nothing: same documents, same heads, same file.
            policyset.check_revisions(steps, expected, str(revision_file))
            planned = {k: expected.revisions[k] for k in planned}
            gone = moved(planned, {s.key: s.revision for s in steps})
            if gone:
                raise policyset.conflict(gone)
            policyset.check_digest(steps, expected, str(revision_file))
        if not shared.json_mode():
            policyset.print_plan(steps)
        # The heads again, right before writing: every document must still be where the plan
        # shown was computed, or nothing is written.
        gone = moved(planned, {k: v.revision for k, v in policyset.live_heads(api).items()})
        if gone:
            raise policyset.conflict(gone)
        applied: list[dict[str, Any]] = []
        for step in steps:
            body = step.patch_body()
            if body is None:
                continue
            try:
                applied.append(api.patch("/router_policy", body))
            except CliError as err:
                # Documents are separate compare-and-set subjects: say which ones were written.
                err.message = f"{step.key}: {err.message}"
                if applied:
                    err.message += (" (applied before it: "
                                    + ", ".join(f"{a.get('model')} {a.get('kind')} r{a.get('revision')}"
                                                for a in applied) + "; fix and run apply again)")
                    err.body = {**err.body, "applied": applied}
                raise
    _print_plan_result(steps, applied, dry_run=False)


def _print_plan_result(steps: list[PlanStep], applied: list[dict[str, Any]], *, dry_run: bool) -> None:
    if shared.json_mode():
        print_json({"dry_run": dry_run, "plan": policyset.as_json(steps), "applied": applied})
        return
    if dry_run:
        policyset.print_plan(steps)
        say("dry run: nothing applied")
        return
    if not applied:
        say("nothing to apply: every document matches the file")
    for a in applied:
        say(f"applied: {a.get('model')} {a.get('kind')} revision {a.get('previous_revision')} → "
            f"{a.get('revision')} (event {a.get('event_id')})")


@app.command("export")
def export(
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write to this file (default: stdout).")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model.")] = None,
) -> None:
    """Write the live policy as a policy file (YAML; JSON with --json): every document that
    exists, with its overrides. `rudder policy apply -f` of it changes nothing."""
    with shared.client() as api:
        heads = policyset.live_heads(api)
    data = export_file({k: v for k, v in heads.items() if model is None or k.model == model})
    text = to_json(data) + "\n" if shared.json_mode() else policyset.dump_yaml(data)
    if output is None:
        sys.stdout.write(text)
        return
    output.write_text(text, encoding="utf-8")
    count = sum(len(d) for d in data["models"].values())
    if shared.json_mode():
        print_json({"output": str(output), "documents": count})
    else:
        say(f"wrote {count} document(s) to {output}")


@app.command("schema")
def schema() -> None:
    """Print the JSON Schema of a policy file (for editors and CI linters)."""
    print_json(json_schema())
