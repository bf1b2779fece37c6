"""``rudder audit``: the insert-only, hash-chained audit log (auditor or admin role)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import app as shared
from cli.errors import CliError, ExitCode
from cli.output import fmt_time, fmt_value, print_json, say, show, table
from cli.params import PairError, parse_time

app = shared.new_app("Audit log: who changed what, when, from what; accepted and rejected.")

PAGE = 100


def _time(value: str | None, hint: str) -> str | None:
    if value is None:
        return None
    try:
        return parse_time(value, now=datetime.now(UTC))
    except PairError as exc:
        raise typer.BadParameter(str(exc), param_hint=hint) from None


@app.command("log")
def log(
    model: Annotated[str | None, typer.Option("--model", "-m")] = None,
    kind: Annotated[str | None, typer.Option("--kind", "-k")] = None,
    actor: Annotated[str | None, typer.Option("--actor", "-a")] = None,
    decision: Annotated[
        str | None, typer.Option("--decision", help="accepted, rejected or pending.")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="ISO-8601 time or a duration ago (15m, 2h, 7d).")
    ] = None,
    until: Annotated[str | None, typer.Option("--until", help="ISO-8601 time or duration.")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="Rows to show.")] = 50,
    all_rows: Annotated[
        bool, typer.Option("--all", help="Every matching row (follows the cursor).")
    ] = False,
) -> None:
    """Audit rows, newest first."""
    if decision is not None and decision not in ("accepted", "rejected", "pending"):
        raise typer.BadParameter("must be accepted, rejected or pending", param_hint="--decision")
    params: dict[str, Any] = {
        "model": model, "kind": kind, "actor": actor, "decision": decision,
        "since": _time(since, "--since"), "until": _time(until, "--until"),
    }
    rows: list[dict[str, Any]] = []
    cursor: str | None = None
    with shared.client() as api:
        while True:
            page = PAGE if all_rows else min(PAGE, limit - len(rows))
            body = api.get("/audit", {**params, "cursor": cursor, "limit": page})
            items = [r for r in (body or {}).get("items") or [] if isinstance(r, dict)]
            rows.extend(items)
            cursor = (body or {}).get("next_cursor")
            if not cursor or not items or (not all_rows and len(rows) >= limit):
                break
    if not all_rows:
        rows = rows[:limit]
    if shared.json_mode():
        print_json(rows)
        return
    if not rows:
        say("no audit rows match")
        return
    show(table(
        ["id", "at", "actor", "stage", "decision", "model", "kind", "op", "expected", "new",
         "reason"],
        [(str(r.get("id")), fmt_time(r.get("at")), r.get("actor"), r.get("stage"),
          r.get("decision"), r.get("model"), r.get("kind"), r.get("op"),
          r.get("expected_revision"), r.get("new_revision"),
          r.get("reason_code") or r.get("reason")) for r in rows],
    ))
    if cursor and not all_rows:
        say("(more rows: raise --limit or pass --all)")


@app.command("show")
def show_row(row_id: Annotated[str, typer.Argument(metavar="ID", help="Audit row id.")]) -> None:
    """One audit row with every field."""
    with shared.client() as api:
        row = api.get(f"/audit/{row_id}")
    if shared.json_mode():
        print_json(row)
        return
    show(table(["field", "value"],
               [(k, fmt_time(v) if k == "at" else fmt_value(v)) for k, v in (row or {}).items()]))


def _expected_head(value: str) -> tuple[int, str]:
    row_id, sep, row_hash = value.partition(":")
    if not sep or not row_id.isdigit() or len(row_hash) != 64:
        raise typer.BadParameter("must be ID:HASH (an audit head printed by an earlier verify)",
                                 param_hint="--expect")
    return int(row_id), row_hash.lower()


@app.command("verify")
def verify(
    expect: Annotated[
        list[str] | None,
        typer.Option("--expect", metavar="ID:HASH",
                     help="An audit head kept from an earlier verify: that row must still have "
                          "that hash (repeatable)."),
    ] = None,
) -> None:
    """Check the audit and ACK chains against the database and every signed checkpoint; exit 1
    naming the first bad row. Prints the verified heads: keep them elsewhere to compare later."""
    expected = [_expected_head(v) for v in expect or []]
    with shared.client() as api:
        result = api.get("/audit/verify")
        result = result if isinstance(result, dict) else {}
        for row_id, row_hash in expected:
            if not result.get("ok"):
                break
            try:
                row = api.get(f"/audit/{row_id}")
            except CliError as exc:
                if exc.exit_code != ExitCode.NOT_FOUND:
                    raise
                row = None
            got = (row or {}).get("row_hash") if isinstance(row, dict) else None
            if got != row_hash:
                result = {**result, "ok": False, "chain": "audit", "first_broken_id": row_id,
                          "reason": f"audit row {row_id} " + ("is gone" if got is None else
                                    "differs") + " from the head kept with --expect"}
    if shared.json_mode():
        print_json(result)
    if not result.get("ok"):
        if result.get("first_broken_id") is not None:
            message = (f"{result.get('chain') or 'audit'} chain broken at row "
                       f"{result.get('first_broken_id')}: {result.get('reason')} "
                       f"({result.get('checked')} audit rows checked)")
        else:
            message = f"audit checkpoints do not verify: {result.get('reason')}"
        raise CliError(ExitCode.ERROR, message, body=result)
    if shared.json_mode():
        return
    chains = result.get("chains") or {}
    checkpoint = result.get("checkpoint")
    rows = []
    for name in ("audit", "acks"):
        c = chains.get(name) or {}
        head = c.get("head") or {}
        rows.append((name, str(c.get("checked")), str(head.get("last_id")),
                     str(head.get("last_hash")), str(c.get("unanchored"))))
    show(table(["chain", "rows", "head id", "head hash", "unanchored"], rows))
    if checkpoint:
        say(f"ok: both chains intact and match every checkpoint; newest checkpoint "
            f"{checkpoint.get('seq')} at {fmt_time(checkpoint.get('at'))} (key {checkpoint.get('key_id')})")
    else:
        say(f"ok: hash chain intact over {result.get('checked')} rows (no checkpoint yet: "
            "the newest rows are not anchored)")


@app.command("keygen")
def keygen(
    path: Annotated[Path, typer.Argument(help="Where to write the Ed25519 seed (mode 0600).")],
) -> None:
    """Alias of `rudder keys new --purpose checkpoint --signing-key PATH --if-missing`: a checkpoint
    signing key (RUDDER_AUDIT_SIGNING_KEY), its public key in PATH.pub (RUDDER_AUDIT_VERIFY_KEYS).
    Prints the public line. An existing file is kept."""
    from cli.keys import make_key
    from controlplane.protocol.signing import Purpose

    existed = path.exists()
    pub = path.with_name(path.name + ".pub")
    key, _ = make_key(Purpose.CHECKPOINT, path, pub, if_missing=True)
    if shared.json_mode():
        print_json({"path": str(path), "key_id": key.key_id, "public": key.public_line,
                    "verify_keys": str(pub), "created": not existed})
        return
    say(key.public_line)


@app.command("reconcile")
def reconcile() -> None:
    """Resolve pending records, then check stream ↔ audit both ways, event signatures, documents
    against their audit records and Nats-Msg-Id reuse; exit 1 if not clean."""
    with shared.client() as api:
        result = api.post("/audit/reconcile", {})
    result = result if isinstance(result, dict) else {}
    if shared.json_mode():
        print_json(result)
    else:
        show(table(["check", "result"], [(k, fmt_value(v)) for k, v in result.items()]))
    if not result.get("ok"):
        problems = [f"{k}={fmt_value(result.get(k))}" for k in
                    ("events_without_decision", "decisions_without_event", "duplicate_decisions",
                     "bad_signatures", "document_mismatches", "reused_msg_ids", "replayed", "undeterminable")
                    if result.get(k)]
        raise CliError(ExitCode.ERROR,
                       "stream and audit log disagree: " + (", ".join(problems) or "not ok"),
                       body=result)
