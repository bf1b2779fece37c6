"""Issue 19, the operators' view: structured logs, fleet metrics and dashboards, traces, and
"why did this request go there" — against a real bus, real routers and a real control plane."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import Result

from cli.errors import ExitCode
from cli.main import app as cli_app
from controlplane.protocol.hashing import chain_hashes
from controlplane.protocol.tokenizer import encode_chat
from controlplane.server import Running
from controlplane.telemetry import logs, traces
from router.settings import new_router_id
from tests.cli_runner import invoke
from tests.integration.cp_support import Tokens, client, controlplane
from tests.support_router.workers import (
    InProcessRouter,
    MockWorker,
    free_port,
    router_settings,
    spawn_router,
    start_worker,
    wait_for,
    wait_http_ok,
)

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


async def test_json_logs_parse_line_by_line_and_carry_the_ids(nats_url: str) -> None:
    """A router process run with RUDDER_LOG_FORMAT=json: every line of its log is one JSON object
    with time, level, logger and message, and the line of a routed request carries the request
    id, the router id, the chosen worker id, the policy revisions and the trace id."""
    model = f"logs/{uuid.uuid4().hex[:6]}"
    worker = await start_worker(nats_url, model)
    port, rid = free_port(), new_router_id()
    with tempfile.TemporaryFile() as log_file:
        proc = spawn_router(nats_url, model, port=port, router_id=rid, stderr=log_file,
                            RUDDER_LOG_FORMAT="json", RUDDER_LOG_LEVEL="INFO")
        try:
            await wait_http_ok(f"http://127.0.0.1:{port}/health")
            request_id = uuid.uuid4().hex
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                r = await http.post("/v1/chat/completions", headers={"x-request-id": request_id},
                                    json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 20)
            await worker.stop()
        log_file.seek(0)
        lines = log_file.read().decode().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]  # every line parses
    assert records
    for rec in records:
        assert {"time", "level", "logger", "message"} <= rec.keys(), rec
        assert rec["time"].endswith("Z")
    routed = [rec for rec in records if rec.get("request_id") == request_id and "→" in rec["message"]]
    assert len(routed) == 1, records
    line = routed[0]
    assert line["router_id"] == rid
    assert line["worker_id"] == worker.instance_id
    assert line["revision"] == r.headers["x-rudder-policy-revisions"]
    assert line["logger"] == "router.api" and line["level"] == "INFO"
    # The start-up line, logged by the lifespan's task, carries the router id too.
    assert any(rec.get("router_id") == rid and "serving" in rec["message"] for rec in records)


# -- a fleet: a control plane, a router and two workers on one bus ----------------------------


@dataclass
class Fleet:
    cp: Running
    router: InProcessRouter
    workers: list[MockWorker]
    model: str
    tokens: Tokens


@pytest.fixture(scope="module")
async def fleet(nats_url: str, db: str, tokens: Tokens) -> AsyncIterator[Fleet]:
    model = f"ops/{uuid.uuid4().hex[:6]}"
    workers = [await start_worker(nats_url, model) for _ in range(2)]
    router = await InProcessRouter(router_settings(nats_url, model, decision_sample=1.0,
                                                   policy_lag_s=0.2)).start()
    try:
        async with controlplane(nats_url, db) as cp:
            await wait_for(lambda: router.runtime.scheduler.view.workers.get(model) == 2)
            await wait_for(lambda: bool(cp.controlplane.fleet.live_routers(model)), within=10)
            yield Fleet(cp, router, workers, model, tokens)
    finally:
        await router.stop()
        for w in workers:
            await w.stop()


_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_info", "_created")


def exported(text: str) -> set[str]:
    """Every metric family and sample name of a Prometheus text exposition."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def used_metrics() -> set[str]:
    """Every ``rudder_*`` metric the shipped dashboard and alerts read."""
    dashboard = json.loads((ROOT / "deploy/grafana/rudder.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())
    exprs += [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]
    return {name for e in exprs for name in re.findall(r"\brudder_[a-z0-9_]+", e)}


def sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


async def test_dashboard_and_alerts_read_only_exported_metrics(fleet: Fleet) -> None:
    """Scrape a real router and a real control plane after a PATCH and a chat: every metric the
    Grafana dashboard and the alert rules use is exported, and the fleet figures are right."""
    model = fleet.model
    async with client(fleet.cp, fleet.tokens.operator) as op:
        r = await op.patch("/router_policy", json={"model": model, "expected_revision": 0,
                                                    "parameters": {"router_temperature": 0.0}})
        assert r.status_code == 200, r.text
        revision = r.json()["revision"]
    async with httpx.AsyncClient(base_url=fleet.router.url) as http:
        r = await http.post("/v1/chat/completions",
                            json={"model": model, "messages": [{"role": "user", "content": "metrics " * 40}]})
        assert r.status_code == 200, r.text
        worker = r.headers["x-worker-instance-id"]

        async def lag_gone() -> bool:
            text = (await http.get("/metrics")).text
            return sample(text, "rudder_router_policy_revisions_behind", model=model, kind="selection") == 0.0 \
                and sample(text, "rudder_router_policy_head_revision", model=model, kind="selection") == revision

        await wait_for(lag_gone)
        router_text = (await http.get("/metrics")).text
    async with client(fleet.cp, None) as anon:
        cp_text = (await anon.get("/metrics")).text
    names = exported(router_text) | exported(cp_text)
    missing = set()
    for name in used_metrics():
        base = next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s)), name)
        if name not in names and base not in names:
            missing.add(name)
    assert not missing, f"dashboard/alerts use metrics nobody exports: {sorted(missing)}"
    assert sample(router_text, "rudder_router_applied_revision", model=model, kind="selection") == revision
    assert sample(router_text, "rudder_router_worker_requests_total", model=model, instance_id=worker,
                  status="200") == 1.0
    assert sample(router_text, "rudder_router_reported_cached_tokens_total", model=model) is not None
    assert sample(router_text, "rudder_router_scheduler_queue_depth") is not None
    assert sample(router_text, "rudder_build_info", component="router") == 1.0
    assert sample(cp_text, "rudder_build_info", component="controlplane") == 1.0
    assert sample(cp_text, "rudder_policy_head_revision", model=model, kind="selection") == revision
    assert sample(cp_text, "rudder_policy_routers", model=model, kind="selection", state="in_sync") == 1.0
    assert (sample(cp_text, "rudder_audit_append_seconds_count", outcome="ok") or 0) >= 2  # received, decision


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span of this process, kept in memory (tracing is off again after the module)."""
    exporter = InMemorySpanExporter()
    traces.install(SimpleSpanProcessor(exporter), service_name="rudder-test")
    yield exporter
    traces.disable()
    exporter.shutdown()  # FastAPI's own spans (global provider) are no longer kept either


def descendants(finished: Sequence[ReadableSpan], ancestor: ReadableSpan) -> list[ReadableSpan]:
    """The spans under ``ancestor`` (children, their children, ...)."""
    parent_of = {s.context.span_id: (s.parent.span_id if s.parent else None) for s in finished}
    out = []
    for s in finished:
        up = parent_of.get(s.context.span_id)
        while up is not None and up != ancestor.context.span_id:
            up = parent_of.get(up)
        if up is not None:
            out.append(s)
    return out


def _hex(n: int, width: int) -> str:
    return format(n, f"0{width}x")


async def test_a_patch_and_a_chat_are_traced_with_their_links(fleet: Fleet, spans: InMemorySpanExporter) -> None:
    """One PATCH: its steps are children of the admin request span, and the router's apply span
    links to its publish span (over the bus message's traceparent). One chat sent with a client
    traceparent: the router's request span is its child, with tokenize / select / first token /
    done under it; the worker gets the request span's traceparent; the log line carries its
    trace id."""
    model = fleet.model
    spans.clear()
    cp_lines = io.StringIO()
    cp_handler = logs.handler("json", cp_lines)
    cp_log = logging.getLogger("controlplane.writepath")
    cp_log.addHandler(cp_handler)
    cp_log.setLevel(logging.INFO)
    async with client(fleet.cp, fleet.tokens.operator) as op:
        head = (await op.get("/router_policy", params={"model": model})).json()["documents"]
        expected = next(d["revision"] for d in head if d["kind"] == "selection")
        r = await op.patch("/router_policy", json={"model": model, "expected_revision": expected,
                                                    "parameters": {"router_temperature": 0.0,
                                                                   "prefill_interference_weight": 0.2}})
        assert r.status_code == 200, r.text
        revision = r.json()["revision"]
    cp_log.removeHandler(cp_handler)
    # The control plane's JSON log line of the write carries its request id, revision and trace.
    accepted = [json.loads(line) for line in cp_lines.getvalue().splitlines()]
    line = next(x for x in accepted if x["message"].startswith("accepted"))
    assert line["request_id"] == r.headers["x-request-id"] and line["revision"] == revision
    assert line["model"] == model and len(line["trace_id"]) == 32

    def named(name: str) -> list[ReadableSpan]:
        return [s for s in spans.get_finished_spans() if s.name == name]

    await wait_for(lambda: any(s.attributes.get("rudder.revision") == revision for s in named("policy apply")))
    admin = next(s for s in named("admin PATCH /router_policy"))
    # (FastAPI's own spans, when OpenTelemetry is installed, may sit between them.)
    steps = {s.name: s for s in descendants(spans.get_finished_spans(), admin)}
    assert {"authenticate", "validate", "head", "audit received", "publish", "decision"} <= steps.keys()
    assert steps["publish"].attributes["rudder.revision"] == revision
    assert steps["decision"].attributes["rudder.decision"] == "accepted"
    apply = next(s for s in named("policy apply") if s.attributes["rudder.revision"] == revision)
    assert apply.attributes["rudder.router_id"] == fleet.router.settings.router_id
    assert apply.attributes["rudder.outcome"] == "ACK"
    assert [(link.context.trace_id, link.context.span_id) for link in apply.links] == [
        (admin.context.trace_id, steps["publish"].context.span_id)]

    # A chat with the client's own trace context.
    client_trace, client_span = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    log_lines = io.StringIO()
    handler = logs.handler("json", log_lines)
    logging.getLogger("router.api").addHandler(handler)
    logging.getLogger("router.api").setLevel(logging.INFO)
    try:
        async with httpx.AsyncClient(base_url=fleet.router.url) as http:
            r = await http.post("/v1/chat/completions", headers={
                "traceparent": f"00-{_hex(client_trace, 32)}-{_hex(client_span, 16)}-01"},
                json={"model": model, "messages": [{"role": "user", "content": "trace me"}], "stream": True})
            assert r.status_code == 200, r.text
    finally:
        logging.getLogger("router.api").removeHandler(handler)
    request_id = r.headers["x-request-id"]
    await wait_for(lambda: any(s.attributes.get("rudder.request_id") == request_id for s in named("router request")))
    root = next(s for s in named("router request") if s.attributes["rudder.request_id"] == request_id)
    assert root.context.trace_id == client_trace and root.parent is not None
    assert root.parent.span_id == client_span
    worker_id = int(r.headers["x-worker-instance-id"])
    assert root.attributes["rudder.worker_id"] == worker_id
    children = {s.name: s for s in spans.get_finished_spans()
                if s.parent is not None and s.parent.span_id == root.context.span_id}
    assert {"tokenize", "select", "first token", "done"} <= children.keys()
    select = children["select"]
    assert select.attributes["rudder.worker_id"] == worker_id
    assert select.attributes["rudder.policy_revision.selection"] == revision
    # the sampled decision's figures (router.decisions), as `rudder explain` shows them
    terms = ("queued_prefill_ms", "prefill_ms", "decode_ms", "busy_ms", "interference_ms", "decode_growth_ms",
             "arrival_wait_ms")
    assert sum(select.attributes[f"rudder.decision.{t}"] for t in terms) == pytest.approx(
        select.attributes["rudder.decision.cost_ms"], rel=1e-9)
    assert select.attributes["rudder.decision.why"] in ("lowest_cost", "tie")
    assert children["tokenize"].end_time <= select.start_time + 1_000  # in order (ns)
    assert children["first token"].end_time <= children["done"].end_time <= root.end_time
    # The worker got the router request span as its parent.
    worker = next(w for w in fleet.workers if w.instance_id == worker_id)
    sent = next(h for h in reversed(worker.request_headers) if h.get("x-request-id") == request_id)
    assert sent["traceparent"] == f"00-{_hex(client_trace, 32)}-{_hex(root.context.span_id, 16)}-01"
    # The request's log line carries the trace id.
    routed = [json.loads(line) for line in log_lines.getvalue().splitlines()]
    assert any(line.get("request_id") == request_id and line.get("trace_id") == _hex(client_trace, 32)
               for line in routed), routed


def _rudder(*args: str) -> Result:
    return invoke(cli_app, list(args))


async def test_rudder_explain_shows_every_candidates_cost_terms_and_the_measured_ttft(fleet: Fleet) -> None:
    """A chat through the router, then ``rudder explain`` (a viewer token): every candidate with
    each term of its predicted-time cost, adding up to its cost, the chosen one's sum equal to
    the cost the selection computed, and the measured TTFT and cached tokens of the request."""
    model = fleet.model
    # Long enough that the owner's cached prefix outweighs, by milliseconds, what a late load
    # report can add to its cost (at a few hundred tokens the margin was a fraction of one).
    prompt = "why did this request go there? " * 200
    async with httpx.AsyncClient(base_url=fleet.router.url) as http:
        first = await http.post("/v1/chat/completions",
                                json={"model": model, "messages": [{"role": "user", "content": prompt}]})
        owner = int(first.headers["x-worker-instance-id"])
        # Until the router has indexed the first answer's blocks on its worker.
        messages = [{"role": "user", "content": prompt}]
        hashes = chain_hashes(encode_chat(messages), 16)
        await wait_for(lambda: fleet.router.runtime.scheduler.inspect(
            lambda s: (owner, 0) in s.index.overlaps(hashes)))
        r = await http.post("/v1/chat/completions",
                            json={"model": model, "messages": [{"role": "user", "content": prompt}]})
        assert r.status_code == 200, r.text
    request_id = r.headers["x-request-id"]
    worker = int(r.headers["x-worker-instance-id"])
    reported = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    base = ["--server", fleet.cp.url, "--token", fleet.tokens.viewer]

    shown = await asyncio.to_thread(_rudder, *base, "--json", "explain", request_id)
    assert shown.exit_code == 0, (shown.stdout, shown.stderr)
    body = json.loads(shown.stdout)
    (record,) = body["decisions"]
    assert record["request_id"] == request_id and record["router_id"] == fleet.router.settings.router_id
    assert record["instance_id"] == worker and record["mode"] == "kv"
    assert record["why"][0] in ("lowest_cost", "tie")
    assert record["candidates_total"] == 2 and len(record["candidates"]) == 2
    terms = ("queued_prefill_ms", "prefill_ms", "decode_ms", "busy_ms", "interference_ms", "decode_growth_ms",
             "arrival_wait_ms")
    for c in record["candidates"]:
        assert all(c[t] is not None for t in (*terms, "cache_credit_ms", "ttft_ms")), c
        assert sum(c[t] for t in terms) == pytest.approx(c["cost_ms"], rel=1e-9, abs=1e-9)
    (chosen,) = [c for c in record["candidates"] if c["chosen"]]
    assert chosen["instance_id"] == worker
    assert sum(chosen[t] for t in terms) == pytest.approx(record["cost_ms"], rel=1e-9, abs=1e-9)
    assert record["cost_ms"] == min(c["cost_ms"] for c in record["candidates"])
    assert record["revisions"] and record["status"] == "200"
    assert record["measured_ttft_ms"] is not None and record["measured_ttft_ms"] > 0
    assert record["reported_cached_tokens"] == reported
    assert chosen["cached_tokens"] == int(r.headers["x-rudder-predicted-cached-tokens"])

    # The same as a table for humans.
    human = await asyncio.to_thread(_rudder, *base, "explain", request_id)
    assert human.exit_code == 0, (human.stdout, human.stderr)
    text = human.stdout
    assert f"chosen: worker {worker}" in text and "measured TTFT" in text
    for c in record["candidates"]:
        assert str(c["instance_id"]) in text.replace("\n", "")
    assert "queued prefill" in text and "arrival wait" in text and "cost ms" in text

    # A request no router kept: 404, exit code 6.
    missing = await asyncio.to_thread(_rudder, *base, "explain", "no-such-request")
    assert missing.exit_code == ExitCode.NOT_FOUND, (missing.stdout, missing.stderr)

    # The decision-quality counters.
    async with httpx.AsyncClient(base_url=fleet.router.url) as http:
        metrics = (await http.get("/metrics")).text
    assert (sample(metrics, "rudder_router_decisions_total", model=model) or 0) >= 1
    assert sample(metrics, "rudder_router_decision_ttft_error_seconds_count", model=model,
                  instance_id=str(worker)) is not None
    assert (sample(metrics, "rudder_router_decision_prompt_tokens_total", model=model) or 0) > 0
