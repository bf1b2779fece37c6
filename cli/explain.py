"""``rudder explain REQUEST_ID``: why a request went to its worker (``GET /decisions/{id}``)."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

import typer

from cli import app as shared
from cli.output import escape, print_json, show, table
from cli.output import say as _say

# The time cost's terms, in the order they add up to the cost (router/decisions.py).
TERMS = (("queued_prefill_ms", "queued prefill"), ("prefill_ms", "prefill"), ("decode_ms", "decode"),
         ("busy_ms", "running there"),
         ("interference_ms", "interference"), ("decode_growth_ms", "decode growth"),
         ("arrival_wait_ms", "arrival wait"))


NARROW = 4  # up to this many candidates, one column each (the terms as rows)
COLUMNS = ("", "worker", "rank", "overlap blocks", "cached tokens", "uncached tokens",
           *(label + " ms" for _, label in TERMS), "= cost ms", "cache credit ms", "predicted TTFT ms")


def say(text: str) -> None:
    _say(escape(text))  # ids and reasons are data, not markup


def _count(value: Any) -> str:
    return "-" if value is None else f"{float(value):g}"


def _ms(value: Any) -> str:
    return "-" if value is None else f"{float(value):.2f}"


def candidate_rows(record: dict[str, Any]) -> list[tuple[Any, ...]]:
    rows = []
    for c in record.get("candidates") or []:
        rows.append((
            "*" if c.get("chosen") else "", c.get("instance_id"), c.get("dp_rank"), c.get("overlap_blocks"),
            f"{c.get('cached_tokens') or 0:g}", f"{c.get('uncached_tokens') or 0:g}",
            *(_ms(c.get(name)) for name, _ in TERMS), _ms(c.get("cost_ms")), _ms(c.get("cache_credit_ms")),
            _ms(c.get("ttft_ms")),
        ))
    return rows


def explain(request_id: Annotated[str, typer.Argument(help="The request's id (x-request-id).")]) -> None:
    """Why a routed request went to its worker: every candidate with each term of its predicted
    time cost (they add up to the cost), the chosen worker and why, and the measured TTFT."""
    with shared.client() as api:
        body = api.get(f"/decisions/{quote(request_id, safe='')}")
    if shared.json_mode():
        print_json(body)
        return
    for record in body.get("decisions") or []:
        say(f"request {record.get('request_id')} on router {record.get('router_id')} "
            f"(model {record.get('model')}, {record.get('pool')} pool, mode {record.get('mode')})")
        say(f"chosen: worker {record.get('instance_id')} rank {record.get('dp_rank')}, "
            f"cost {_ms(record.get('cost_ms'))} ms, why: {', '.join(record.get('why') or [])}")
        candidates = record.get("candidates") or []
        if 0 < len(candidates) <= NARROW:  # a column per candidate: its terms read down to the cost
            show(table(["", *(f"worker {c.get('instance_id')} rank {c.get('dp_rank')}"
                              + (" (chosen)" if c.get("chosen") else "") for c in candidates)],
                       [(label, *(row[i] for row in candidate_rows(record)))
                        for i, label in enumerate(COLUMNS) if i >= 3]))
        elif candidates:
            show(table(["", "worker", "rank", *COLUMNS[3:]], candidate_rows(record)))
        shown = len(record.get("candidates") or [])
        if shown < (record.get("candidates_total") or 0):
            say(f"({shown} of {record['candidates_total']} candidates shown: the cheapest and the chosen)")
        chosen: dict[str, Any] = next((c for c in record.get("candidates") or [] if c.get("chosen")), {})
        say(f"measured TTFT {_ms(record.get('measured_ttft_ms'))} ms "
            f"(predicted {_ms(chosen.get('ttft_ms'))} ms); cached tokens reported "
            f"{record.get('reported_cached_tokens', '-')} (predicted {_count(chosen.get('cached_tokens'))}); "
            f"status {record.get('status') or 'in flight'}")
        revisions = record.get("revisions") or {}
        if revisions or record.get("busy"):
            say("policy revisions " + (", ".join(f"{k} {v}" for k, v in sorted(revisions.items())) or "none")
                + (f"; busy, not candidates: {', '.join(map(str, record['busy']))}" if record.get("busy") else ""))
    if body.get("unanswered"):
        say(f"routers that did not answer: {', '.join(body['unanswered'])}")
