"""Issue 19, the operators' view: structured logs, fleet metrics and dashboards, traces, and
"why did this request go there" — against a real bus, real routers and a real control plane."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import uuid

import httpx
import pytest

from router.settings import new_router_id
from tests.support_router.workers import (
    TestWorker,
    free_port,
    spawn_router,
    wait_http_ok,
)

pytestmark = pytest.mark.timeout(90)


async def test_json_logs_parse_line_by_line_and_carry_the_ids(nats_url: str) -> None:
    """A router process run with RUDDER_LOG_FORMAT=json: every line of its log is one JSON object
    with time, level, logger and message, and the line of a routed request carries the request
    id, the router id, the chosen worker id, the policy revisions and the trace id."""
    model = f"logs/{uuid.uuid4().hex[:6]}"
    worker = await TestWorker(nats_url, model).start()
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
