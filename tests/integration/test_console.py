"""The web console (/ui) in headless Chromium against a real control plane and a real router.

Debian's ``chromium`` (installed by .ci/run), driven by Playwright through ``executable_path`` (no
browser download). Shown here: signing in with a token (kept in sessionStorage, never in the URL),
a PATCH made by the CLI appearing with its diff within 2 s, a router's NACK with its reason, a
stopped router turning "behind" when the head moves past it, a worker's load and cache usage, and
a viewer's token kept out of the audit page. Without chromium the test
skips, unless CI=true, where it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from bus.identities import Identity, IdentityKind
from controlplane.protocol.events import PolicyEvent, RankLoad
from controlplane.protocol.policy import PolicyKind, PolicyOp
from tests import buskit
from tests.integration.cp_support import Tokens, controlplane
from tests.policy_keys import session_keys
from tests.support_router.workers import InProcessRouter, TestWorker, router_settings, wait_for

pytestmark = pytest.mark.timeout(120)

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync"]
#: How soon a change must show (the page polls every second).
SHOWN_WITHIN_MS = 2000
CELLS = "rows => rows.map(r => [...r.cells].map(c => c.textContent))"


def require_chromium() -> None:
    reason = None
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing (Debian: apt-get install chromium; .ci/run installs it)"
    else:
        try:
            import playwright.async_api  # noqa: F401
        except ImportError:
            reason = "playwright is not installed (pip install -e '.[test]')"
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the browser test: {reason}")
    pytest.skip(reason)


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    require_chromium()
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            yield chromium
        finally:
            await chromium.close()


async def rudder(server: str, token: str, *args: str) -> dict[str, Any]:
    """The real CLI, in its own process, as an operator's shell runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RUDDER_TOKEN", "RUDDER_SERVER")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from cli.main import main; main()",
        "--server", server, "--token", token, "--json", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"rudder {' '.join(args)} did not finish in 60 s") from None
    assert proc.returncode == 0, (out, err)
    result: dict[str, Any] = json.loads(out)
    return result


async def publish_around_the_control_plane(nats_url: str, model: str, *, expected: int) -> None:
    nc = await buskit.connect_as(nats_url, Identity(IdentityKind.CONTROLPLANE))
    try:
        await session_keys().policy_log(nc).publish(PolicyEvent(
            event_id=uuid.uuid4(), model=model, kind=PolicyKind.SELECTION, op=PolicyOp.PATCH,
            expected_revision=expected, changes={"host_cache_hit_weight": 0.5},
            document={"prefill_load_scale": 2, "host_cache_hit_weight": 0.5},
            actor="around-the-control-plane", request_id="test", at=datetime.now(UTC)))
    finally:
        await nc.close()


async def sign_in(browser: Any, url: str, token: str) -> Any:
    context = await browser.new_context()
    context.set_default_timeout(10_000)  # no step waits playwright's default 30 s
    page = await context.new_page()
    await page.goto(f"{url}/ui")
    await page.fill("#token", token)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("#nav", state="visible", timeout=5000)
    assert token not in page.url
    assert await page.evaluate("sessionStorage.getItem('rudder.token')") == token
    return page


async def test_the_console_shows_changes_the_fleet_and_keeps_viewers_out_of_the_audit(
        browser: Any, nats_url: str, db: str, tokens: Tokens) -> None:
    model = f"ui/{uuid.uuid4().hex[:6]}"
    router = await InProcessRouter(router_settings(nats_url, model, mode="round_robin")).start()
    rid = router.settings.router_id
    worker = TestWorker(nats_url, model, kv_total_blocks=1000)
    worker.load = [RankLoad(dp_rank=0, kv_used_blocks=250, running=3, waiting=1, active_prefill_tokens=512)]
    await worker.start()
    stopped = False
    try:
        async with controlplane(nats_url, db) as cp:
            await wait_for(lambda: bool(cp.controlplane.fleet.live_routers(model)), within=10)
            async with httpx.AsyncClient(base_url=cp.url) as anonymous:
                shell = await anonymous.get("/ui")
                assert shell.status_code == 200 and "script-src 'self'" in shell.headers["content-security-policy"]
                assert (await anonymous.get("/ui/app.js")).headers["content-type"].startswith("text/javascript")
                assert (await anonymous.get("/ui/nothing.js")).status_code == 404
                assert (await anonymous.get("/router_policy")).status_code == 401  # the data needs a token

            admin = await sign_in(browser, cp.url, tokens.admin)

            # The audit page: a PATCH made by the CLI appears with its diff within 2 s.
            await admin.goto(f"{cp.url}/ui#audit")
            await admin.wait_for_selector("#audit tbody tr", timeout=5000)
            first = await rudder(cp.url, tokens.operator, "policy", "set", model, "router_temperature=0.25",
                                 "--revision", "0")
            started = time.monotonic()
            accepted = f'#audit tr[data-model="{model}"].decision-accepted td.diff'
            await admin.wait_for_selector(accepted, timeout=SHOWN_WITHIN_MS)
            assert time.monotonic() - started < SHOWN_WITHIN_MS / 1000
            assert " ".join((await admin.text_content(accepted) or "").split()) == "router_temperature: - → 0.25"
            await admin.wait_for_function(
                "document.getElementById('verify-status').textContent.startsWith('intact')", timeout=5000)
            await admin.wait_for_function(
                "document.getElementById('reconcile-status').textContent.startsWith('clean')", timeout=5000)

            # The document, its history and a diff between two revisions.
            second = await rudder(cp.url, tokens.operator, "policy", "set", model, "prefill_load_scale=2",
                                  "router_temperature=null", "--latest")
            await admin.goto(f"{cp.url}/ui#documents")
            await admin.click(f'#documents tr[data-model="{model}"][data-kind="selection"]', timeout=5000)
            await admin.wait_for_selector(f'#history tr[data-revision="{second["revision"]}"]', timeout=5000)
            await admin.select_option("#diff-from", str(first["revision"]))
            await admin.select_option("#diff-to", str(second["revision"]))
            diff = await admin.eval_on_selector_all("#revision-diff tbody tr", CELLS)
            assert diff == [["prefill_load_scale", "-", "2"], ["router_temperature", "0.25", "-"]]

            # The fleet: the router is in sync; stopped, it turns "behind" when the head moves on.
            await admin.goto(f"{cp.url}/ui#fleet")
            cell = f'#routers tr[data-router="{rid}"][data-document="{model}|selection"] td.status'
            await admin.wait_for_selector(f'{cell}[data-status="in-sync"]', timeout=5000)
            await admin.wait_for_selector(f'#workers tr[data-worker="{worker.instance_id}"]', timeout=5000)
            load = await admin.eval_on_selector_all(f'#workers tr[data-worker="{worker.instance_id}"]', CELLS)
            # The 64-bit worker id exactly (not rounded to a JavaScript number), its load and cache.
            assert [cells[:9] for cells in load] == [[str(worker.instance_id), model, "aggregated", "mock", "0",
                                                      "3", "1", "512", "25.0% (250/1000 blocks)"]]
            # A document that reaches the router around the control plane (a weight this cache-free
            # router cannot feed) is NACKed: the page shows the router's reason.
            head = await cp.controlplane.queries.documents(model)
            await publish_around_the_control_plane(
                nats_url, model, expected=next(d["revision"] for d in head if d["kind"] == "selection"))
            await admin.wait_for_selector(f'{cell}[data-status="nack"]', timeout=SHOWN_WITHIN_MS)
            assert "host_cache_hit_weight" in (await admin.text_content(cell) or "")
            await rudder(cp.url, tokens.operator, "policy", "unset", model, "host_cache_hit_weight", "--latest")
            await admin.wait_for_selector(f'{cell}[data-status="in-sync"]', timeout=5000)

            await router.stop()
            stopped = True
            await rudder(cp.url, tokens.operator, "policy", "set", model, "prefill_load_scale=3", "--latest")
            await admin.wait_for_selector(f'{cell}[data-status="behind"]', timeout=SHOWN_WITHIN_MS)
            assert await admin.text_content(cell) == "behind"

            # A viewer signs in and sees documents, but not the audit log.
            viewer = await sign_in(browser, cp.url, tokens.viewer)
            await viewer.wait_for_selector(f'#documents tr[data-model="{model}"]', timeout=5000)
            await viewer.goto(f"{cp.url}/ui#audit")
            await viewer.wait_for_selector("#audit-denied", state="visible", timeout=5000)
            assert "may not read_audit" in (await viewer.text_content("#audit-denied") or "")
            assert await viewer.is_hidden("#audit-body")
            assert await viewer.eval_on_selector_all("#audit tbody tr[data-audit-id]", "rows => rows.length") == 0

            # Signing out forgets the token.
            await viewer.click("#logout")
            assert await viewer.evaluate("sessionStorage.getItem('rudder.token')") is None
            assert await viewer.is_visible("#login")
    finally:
        await worker.stop()
        if not stopped:
            await router.stop()
