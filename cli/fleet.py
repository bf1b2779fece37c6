"""``rudder routers`` and ``rudder workers``: what the fleet runs right now."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from cli import app as shared
from cli.errors import CliError, ExitCode
from cli.output import escape, fmt_time, fmt_value, print_json, say, show, table

routers_app = shared.new_app("Router replicas: applied vs head revision, NACKs.")
workers_app = shared.new_app("Workers announced on the membership stream, and their issued manifests.")


def _applied(router: dict[str, Any], key: str) -> int:
    entry = (router.get("applied") or {}).get(key) or {}
    return int(entry.get("revision") or 0)


def summarize(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Per document: how many of the routers serving its model applied the head revision.

    A router counts for a document when it serves the model (``models``) or reports an applied
    entry for it; a router that has not applied it at all counts as behind.
    """
    routers = [r for r in body.get("routers") or [] if isinstance(r, dict)]
    heads: dict[str, int] = {str(k): int(v) for k, v in (body.get("heads") or {}).items()}
    keys = set(heads)
    for r in routers:
        keys |= set((r.get("applied") or {}).keys())
    out = []
    for key in sorted(keys):
        model, _, kind = key.rpartition("|")
        head = heads.get(key, 0)
        serving = [r for r in routers
                   if model in (r.get("models") or []) or key in (r.get("applied") or {})]
        on_head = sum(1 for r in serving if _applied(r, key) >= head)
        out.append({"model": model, "kind": kind, "head_revision": head,
                    "on_head": on_head, "routers": len(serving)})
    return out


@routers_app.command("list")
def routers_list() -> None:
    """Routers with the revision each applied per document, and NACK reasons."""
    with shared.client() as api:
        body = api.get("/routers")
    body = body if isinstance(body, dict) else {}
    routers = [r for r in body.get("routers") or [] if isinstance(r, dict)]
    summary = summarize(body)
    if shared.json_mode():
        print_json({"routers": routers, "heads": body.get("heads") or {}, "summary": summary})
        return
    if not routers:
        say("no live routers")
    else:
        show(table(
            ["router", "models", "role", "mode", "url", "cache inputs", "heartbeat"],
            [(r.get("router_id"), r.get("models") or [], r.get("role"), r.get("mode"),
              r.get("url"), r.get("cache_inputs") or [], fmt_time(r.get("heartbeat_at")))
             for r in routers],
        ))
        heads = body.get("heads") or {}
        rows = []
        for r in routers:
            for key, entry in sorted((r.get("applied") or {}).items()):
                entry = entry or {}
                head = heads.get(key, 0)
                applied = entry.get("revision")
                nack = entry.get("last_nack")
                if nack and entry.get("last_nack_revision") is not None:
                    nack = f"r{entry['last_nack_revision']}: {nack}"
                rows.append((r.get("router_id"), key.replace("|", " "), applied, head,
                             "yes" if (applied or 0) >= head else "NO", nack))
        if rows:
            show(table(["router", "document", "applied", "head", "on head", "last nack"], rows))
        fits = calibration_rows(routers)
        if fits:
            show(table(["router", "model", "worker", "timing", "prefill ms per step", "samples",
                        "TTFT err mean ms", "p90 ms"], fits))
    for s in summary:
        say(f"{escape(str(s['model']))} {escape(str(s['kind']))}: {s['on_head']}/{s['routers']} "
            f"routers on the head revision {s['head_revision']}")


@routers_app.command("reset-calibration")
def routers_reset_calibration(
    model: Annotated[str, typer.Argument(help="Model whose timing fits every router forgets.")],
) -> None:
    """Every router forgets its timing fits of MODEL and starts again from the workers' priors
    (a revisioned, audited patch of the selection document's calibration_epoch)."""
    with shared.client() as api:
        result = api.post("/router_policy/calibration/reset", {"model": model})
    if shared.json_mode():
        print_json(result)
        return
    say(f"{model}: calibration reset at revision {result.get('revision')}")


def calibration_rows(routers: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """One row per (router, worker) timing fit: coefficients and prediction error."""
    rows = []
    for r in routers:
        for c in r.get("calibration") or []:
            p0, p1, p2 = c.get("prefill_ms") or (None, None, None)
            mae, p90 = c.get("ttft_mae_ms"), c.get("ttft_p90_error_ms")
            rows.append((
                r.get("router_id"), c.get("model"), c.get("instance_id"), c.get("source"),
                f"{p0:.3g} + {p1:.3g}·N + {p2:.3g}·N²" if p0 is not None else "",
                f"{c.get('prefill_samples', 0)}/{c.get('decode_samples', 0)}",
                "" if mae is None else f"{mae:.1f}", "" if p90 is None else f"{p90:.1f}",
            ))
    return rows


@routers_app.command("acks")
def routers_acks(
    router_id: Annotated[str | None, typer.Option("--router", help="Router id.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m")] = None,
    kind: Annotated[str | None, typer.Option("--kind", "-k")] = None,
    at: Annotated[
        str | None,
        typer.Option("--at", help="ISO-8601 time: what the router ran at that moment."),
    ] = None,
) -> None:
    """ACK/NACK history of routers (auditor): which revision a router ran at a given time."""
    with shared.client() as api:
        body = api.get("/routers/acks",
                       {"router_id": router_id, "model": model, "kind": kind, "at": at})
    acks = [a for a in (body or {}).get("acks") or [] if isinstance(a, dict)]
    if shared.json_mode():
        print_json(acks)
        return
    if not acks:
        say("no acknowledgements recorded")
        return
    show(table(
        ["at", "router", "model", "kind", "revision", "status", "detail"],
        [(fmt_time(a.get("at")), a.get("router_id"), a.get("model"), a.get("kind"),
          a.get("revision"), a.get("status"), fmt_value(a.get("detail"))) for a in acks],
    ))


def _load(load: Any) -> str:
    if not isinstance(load, list) or not load:
        return "-"
    parts: list[str] = []
    for rank in load:
        if isinstance(rank, dict):
            parts.append(f"r{rank.get('dp_rank', len(parts))}: run {rank.get('running', '-')} "
                         f"wait {rank.get('waiting', '-')} kv {rank.get('kv_used_blocks', '-')}")
    return "; ".join(parts) or "-"


def _quarantined(entries: Any) -> str:
    """Which claims of a worker which routers no longer believe: "cache, timing by router-1"."""
    if not isinstance(entries, list) or not entries:
        return "-"
    parts = [f"{', '.join(str(c) for c in e.get('claims') or [])} by {e.get('router_id')}"
             for e in entries if isinstance(e, dict)]
    return "; ".join(parts) or "-"


@workers_app.command("list")
def workers_list(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model.")] = None,
) -> None:
    """Workers with their model, role, URL, capacity, last reported load, and which routers no
    longer believe which of their claims (cache, timing)."""
    with shared.client() as api:
        body = api.get("/workers")
    workers = [w for w in (body or {}).get("workers") or [] if isinstance(w, dict)]
    if model:
        workers = [w for w in workers if w.get("model") == model]
    if shared.json_mode():
        print_json(workers)
        return
    if not workers:
        say("no live workers")
        return
    show(table(
        ["instance", "model", "role", "engine", "url", "dp", "block", "kv blocks", "last seen",
         "load", "quarantined"],
        [(str(w.get("instance_id")), w.get("model"), w.get("role"), w.get("engine"),
          w.get("url"), w.get("dp_size"), w.get("block_size"), w.get("kv_total_blocks"),
          fmt_time(w.get("last_seen")), _load(w.get("load")), _quarantined(w.get("quarantined")))
         for w in workers],
    ))


def manifest_body(*, model: str, role: str, dp_size: int, block_size: int, kv_blocks: int, engine: str,
                  url_allow: str, timing_json: str | None = None) -> dict[str, Any]:
    """The body of ``PUT /workers/{id}/manifest`` (the control plane checks every field)."""
    body: dict[str, Any] = {"model": model, "role": role, "max_dp_size": dp_size, "block_size": block_size,
                            "max_kv_blocks": kv_blocks, "engine": engine, "url_allow": url_allow}
    if timing_json is not None:
        try:
            body["timing"] = json.loads(timing_json)
        except json.JSONDecodeError as exc:
            raise CliError(ExitCode.USAGE, f"--timing is not JSON: {exc}") from exc
    return body


@workers_app.command("issue")
def workers_issue(
    instance_id: Annotated[int, typer.Argument(help="The worker's instance id (its credential's).")],
    model: Annotated[str, typer.Option("--model", "-m", help="The model it serves.")],
    url_allow: Annotated[str, typer.Option(
        "--url-allow", help="Where it may be reached (RUDDER_WORKER_URL_ALLOW syntax: host:port, CIDR, *.suffix).")],
    block_size: Annotated[int, typer.Option(
        "--block-size", help="Tokens per KV block: the worker's own (another is refused).")],
    dp_size: Annotated[int, typer.Option("--dp-size", help="Most data-parallel ranks.")] = 1,
    kv_blocks: Annotated[int, typer.Option("--kv-blocks", help="Most KV blocks (all ranks).")] = 16384,
    role: Annotated[str, typer.Option("--role", help="aggregated, prefill or decode.")] = "aggregated",
    engine: Annotated[str, typer.Option("--engine", help="mock or vllm.")] = "mock",
    timing: Annotated[str | None, typer.Option(
        "--timing", help='Its timing prior as JSON: {"prefill_ms": [p0,p1,p2], "decode_ms": [d0,d1,d2]}.')] = None,
) -> None:
    """Issue (or replace) a worker's manifest: what it may claim. Routers cap its membership
    record by it (admin role; signed by the control plane, audited)."""
    body = manifest_body(model=model, role=role, dp_size=dp_size, block_size=block_size, kv_blocks=kv_blocks,
                         engine=engine, url_allow=url_allow, timing_json=timing)
    with shared.client() as api:
        result = api.put(f"/workers/{instance_id}/manifest", body)
    if shared.json_mode():
        print_json(result)
        return
    say(f"worker {instance_id}: manifest issued at revision {result.get('revision')}")


@workers_app.command("manifests")
def workers_manifests() -> None:
    """The manifest issued to each worker, and whether its signature verifies."""
    with shared.client() as api:
        body = api.get("/workers/manifests")
    manifests = [m for m in (body or {}).get("manifests") or [] if isinstance(m, dict)]
    if shared.json_mode():
        print_json(manifests)
        return
    if not manifests:
        say("no manifests issued")
        return
    rows = []
    for m in manifests:
        spec = m.get("spec") or {}
        rows.append((str(m.get("instance_id") or m.get("subject")), spec.get("model"), spec.get("role"),
                     spec.get("engine"), spec.get("max_dp_size"), spec.get("block_size"),
                     spec.get("max_kv_blocks"), spec.get("url_allow"), "yes" if spec.get("timing") else "-",
                     m.get("issued_by"), fmt_time(m.get("issued_at")),
                     "yes" if m.get("verified") else f"NO: {m.get('problem')}"))
    show(table(["instance", "model", "role", "engine", "max dp", "block", "max kv blocks", "url allow",
                "timing", "issued by", "issued at", "verified"], rows))
