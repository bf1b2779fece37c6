"""The whole fleet as an operator meets it (issue 4): ``rudder up`` with two routers and two mock
workers; the official ``openai`` client chats through a router; ``rudder policy set`` changes
``router_temperature``; every router applies the new revision within one second; ``rudder audit
log`` shows the change and its actor."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import openai
import pytest

from cli.embedded import free_port
from tests.integration.test_up import MODEL, Up, rudder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def routers_on(cwd: Path) -> list[dict[str, object]]:
    result = rudder(cwd, "--json", "routers", "list")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    return list(body["routers"] if isinstance(body, dict) else body)


def test_fleet_chat_policy_change_acked_by_every_router_and_audited(tmp_path: Path) -> None:
    ports = {"admin": free_port(), "router": free_port(), "nats": free_port(), "postgres": free_port()}
    up = Up(tmp_path, ports, extra=["--routers", "2", "--workers", "2"])
    try:
        up.wait_for("rudder up: ready")
        deadline = time.monotonic() + 30
        routers: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            routers = routers_on(tmp_path)
            if len(routers) == 2:
                break
            time.sleep(0.2)
        assert len(routers) == 2, routers
        urls = sorted(str(r["url"]) for r in routers)

        # The official client, streaming and not, through each router.
        for url in urls:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
            deadline = time.monotonic() + 30
            while True:  # the router answers 503 until discovery has seen the workers
                try:
                    reply = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hello fleet"}], max_tokens=8)
                    break
                except openai.APIStatusError as exc:
                    if exc.status_code != 503 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert reply.choices[0].message.content
            assert reply.usage is not None and reply.usage.completion_tokens == 8
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello again"}], max_tokens=5, stream=True)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            assert len(text) > 0

        # An operator changes the temperature; every router applies it within one second.
        result = rudder(tmp_path, "--json", "policy", "set", MODEL, "router_temperature=0.3", "--latest")
        assert result.returncode == 0, result.stderr
        set_at = time.monotonic()
        revision = json.loads(result.stdout)["revision"]
        applied: dict[str, int] = {}
        while time.monotonic() - set_at < 5:
            for router in routers_on(tmp_path):
                doc = dict(router["applied"]).get(f"{MODEL}|selection")  # type: ignore[call-overload]
                applied[str(router["router_id"])] = int(doc["revision"]) if doc else 0
            if len(applied) == 2 and all(rev == revision for rev in applied.values()):
                break
            time.sleep(0.05)
        assert all(rev == revision for rev in applied.values()), applied
        for router in routers_on(tmp_path):
            doc = dict(router["applied"])[f"{MODEL}|selection"]  # type: ignore[call-overload]
            assert doc["effective"]["router_temperature"] == 0.3

        # The ACKs are recorded per router in the audit database.
        acks = rudder(tmp_path, "--json", "routers", "acks", "--model", MODEL)
        assert acks.returncode == 0, acks.stderr
        acks_for_rev = [a for a in json.loads(acks.stdout) if a["revision"] == revision and a["status"] == "ACK"]
        assert {a["router_id"] for a in acks_for_rev} == set(applied)

        log = rudder(tmp_path, "--json", "audit", "log", "--model", MODEL)
        assert log.returncode == 0, log.stderr
        rows = json.loads(log.stdout)
        # (The model's rows include its workers' manifest issues, whose revision is the manifest's.)
        change = [r for r in rows if r["kind"] == "selection" and r["new_revision"] == revision
                  and r["decision"] == "accepted"]
        assert len(change) == 1 and change[0]["actor"] == "rudder-up-admin"
        assert change[0]["after"]["router_temperature"] == 0.3
        # Within one second: each router's ACK time against the accepted decision's time, both
        # stamped by the system itself (the CLI's own start-up time does not count).
        accepted_at = datetime.fromisoformat(change[0]["at"].replace("Z", "+00:00"))
        for ack in acks_for_rev:
            lag = (datetime.fromisoformat(ack["at"].replace("Z", "+00:00")) - accepted_at).total_seconds()
            assert lag < 1.0, (ack["router_id"], lag)
    finally:
        assert up.stop() == 0, "".join(up.output)
