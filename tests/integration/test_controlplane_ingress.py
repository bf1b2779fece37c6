"""The admin API's ingress limits against real NATS and PostgreSQL (docs/controlplane.md,
"Failed authentication"): per-source rate limit of failed authentications before the audit chain,
one audit row per window, capped header values, trusted proxies."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

import httpx
import pytest
from sqlalchemy import func, select

from controlplane.audit.store import AuditStore
from controlplane.audit.tables import audit_log
from tests.integration.cp_support import Tokens, controlplane

pytestmark = pytest.mark.timeout(120)
LIMIT = 10
WINDOW_S = 2.0  # the 1000 attempts span about 2.5 windows (5 s; were 10 s of 4 s windows)


def from_address(url: str, address: str, token: str | None, **headers: str) -> httpx.AsyncClient:
    """A client whose connections leave from ``address`` (any 127.0.0.0/8 address is loopback)."""
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=30,
                             transport=httpx.AsyncHTTPTransport(local_address=address))


async def audit_rows(audit: AuditStore) -> int:
    async with audit.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(audit_log))).scalar_one())


def body() -> dict[str, object]:
    return {"model": f"ing/model-{uuid.uuid4().hex[:8]}", "expected_revision": 0,
            "parameters": {"router_temperature": 0.5}}


async def test_1000_wrong_tokens_from_one_address_are_limited_and_audited_in_bounded_rows(
    nats_url: str, db: str, tokens: Tokens,
) -> None:
    audit = AuditStore.from_url(db)
    served: list[int] = []
    try:
        before = await audit_rows(audit)
        async with controlplane(nats_url, db, auth_failure_limit=LIMIT,
                                auth_failure_window_s=WINDOW_S) as cp:
            attacker = from_address(cp.url, "127.0.0.2", "rdr_wrong-token-guess")
            honest = from_address(cp.url, "127.0.0.3", tokens.viewer)
            done = asyncio.Event()

            async def serve_honest() -> None:
                while not done.is_set():
                    served.append((await honest.get("/router_policy")).status_code)
                    await asyncio.sleep(0.02)

            reader = asyncio.create_task(serve_honest())
            started = time.monotonic()
            # In order first: LIMIT answers of 401, then 429 with Retry-After within the window.
            first = [await attacker.patch("/router_policy", json=body()) for _ in range(LIMIT + 5)]
            assert [r.status_code for r in first] == [401] * LIMIT + [429] * 5
            limited = first[-1]
            assert limited.json()["error"]["code"] == "rate_limited"
            assert 1 <= int(limited.headers["retry-after"]) <= math.ceil(WINDOW_S)
            # Then the rest, ten at a time, spread over about 5 s.
            statuses = [r.status_code for r in first]
            remaining = 1000 - len(first)
            for batch in range(remaining // 10 + 1):
                n = min(10, remaining - batch * 10)
                if n <= 0:
                    break
                rs = await asyncio.gather(*(attacker.patch("/router_policy", json=body()) for _ in range(n)))
                statuses += [r.status_code for r in rs]
                await asyncio.sleep(max(0.0, started + (batch + 1) * 0.05 - time.monotonic()))
            elapsed = time.monotonic() - started
            done.set()
            await reader
            await attacker.aclose()
            await honest.aclose()
        # The control plane has stopped: every window is written.
        assert len(statuses) == 1000
        assert set(statuses) == {401, 429}
        windows = math.ceil(elapsed / WINDOW_S) + 1
        assert statuses.count(401) <= LIMIT * windows
        assert statuses.count(429) >= 1000 - LIMIT * windows
        # A valid token from another address was served throughout.
        assert served and set(served) == {200}
        added = await audit_rows(audit) - before
        # At most two rows per window (its first failure, and one row with the count) ...
        assert 0 < added <= 2 * windows, f"{added} audit rows for {windows} windows"
        rows, _ = await audit.query(decision="rejected", limit=1000)
        mine = [r for r in rows if r.source_ip == "127.0.0.2"]
        assert len(mine) == added
        singles = [r for r in mine if r.reason_code == "unauthenticated"]
        summaries = [r for r in mine if r.reason_code == "auth_failures"]
        # ... and every one of the 1000 attempts is accounted for.
        assert summaries and len(singles) + sum(r.changes["count"] for r in summaries if r.changes) == 1000
        assert (await audit.verify()).ok
    finally:
        await audit.close()


async def test_audited_user_agent_is_capped(nats_url: str, db: str) -> None:
    audit = AuditStore.from_url(db)
    try:
        async with controlplane(nats_url, db, audit_header_max_chars=64) as cp:
            async with from_address(cp.url, "127.0.0.4", "rdr_forged", **{"User-Agent": "u" * 20_000}) as http:
                r = await http.patch("/router_policy", json=body())
                assert r.status_code == 401
        rows, _ = await audit.query(decision="rejected", limit=50)
        row = next(r for r in rows if r.source_ip == "127.0.0.4")
        assert row.user_agent == "u" * 64
    finally:
        await audit.close()


async def test_forwarded_for_is_believed_only_from_a_trusted_proxy(nats_url: str, db: str) -> None:
    audit = AuditStore.from_url(db)
    try:
        async with controlplane(nats_url, db, auth_failure_limit=1) as cp:
            async with from_address(cp.url, "127.0.0.5", "rdr_x", **{"X-Forwarded-For": "198.51.100.7"}) as http:
                assert (await http.patch("/router_policy", json=body())).status_code == 401
                # The header named nobody: 127.0.0.5 itself reached its limit.
                assert (await http.patch("/router_policy", json=body())).status_code == 429
        async with controlplane(nats_url, db, auth_failure_limit=1, trusted_proxies=["127.0.0.6/32"]) as cp:
            async with from_address(cp.url, "127.0.0.6", "rdr_x", **{"X-Forwarded-For": "203.0.113.9"}) as a, \
                    from_address(cp.url, "127.0.0.6", "rdr_x", **{"X-Forwarded-For": "203.0.113.10"}) as b:
                assert (await a.patch("/router_policy", json=body())).status_code == 401
                assert (await a.patch("/router_policy", json=body())).status_code == 429
                # Another client behind the same proxy has its own count.
                assert (await b.patch("/router_policy", json=body())).status_code == 401
        rows, _ = await audit.query(decision="rejected", limit=100)
        sources = {r.source_ip for r in rows}
        assert "127.0.0.5" in sources and "198.51.100.7" not in sources
        assert {"203.0.113.9", "203.0.113.10"} <= sources
    finally:
        await audit.close()


async def test_a_write_offering_an_h2c_upgrade_is_served_with_its_body(nats_url: str, db: str, tokens: Tokens) -> None:
    """The admin listener runs the router's connection protocol: a PATCH whose client offers
    ``Upgrade: h2c`` (Java's and Ktor's clients do) is a write like any other, not a 400 for an
    empty body (router.ingress, the ignored upgrade)."""
    async with controlplane(nats_url, db) as cp:
        host, port = cp.url.removeprefix("http://").split(":")
        sent = body()
        data = json.dumps(sent).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"PATCH /router_policy HTTP/1.1\r\nHost: cp\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + tokens.operator.encode() + b"\r\n"
                     b"Connection: Upgrade, HTTP2-Settings, close\r\nUpgrade: h2c\r\n"
                     b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        head, _, answer = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), raw[:400]
        async with from_address(cp.url, "127.0.0.1", tokens.viewer) as http:
            policy = (await http.get("/router_policy", params={"model": sent["model"]})).json()
        assert json.loads(answer)["revision"] == 1, answer[:300]
        assert [(d["kind"], d["revision"], d["document"]) for d in policy["documents"] if d["kind"] == "selection"] == [
            ("selection", 1, sent["parameters"])], policy
