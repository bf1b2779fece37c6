"""Found by the fault run (bench/reliability.py, nats_restart): a router re-synced its policy,
reporting "the stream went backwards", although it had not, and re-applied (ACKed again) the
revision it was on. ``check_stream`` read the stream's last sequence, then the highest revision
applied: a revision stored and applied between the two reads looked like one the stream no
longer had. With writes landing while the check runs, no re-sync may happen."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests import buskit
from tests.support_router.policy import publish_policy
from tests.support_router.workers import InProcessRouter, router_settings

pytestmark = [pytest.mark.timeout(120)]


async def test_no_false_resync_while_revisions_land(nats_url: str) -> None:
    model = f"race/model-{uuid.uuid4().hex[:8]}"
    router = await InProcessRouter(router_settings(nats_url, model)).start()
    admin = await buskit.admin_connect(nats_url)
    try:
        js = admin.jetstream(timeout=5)
        policy = router.runtime.policy
        assert policy is not None
        stop = asyncio.Event()

        async def write() -> int:
            head, n = 0, 0
            while not stop.is_set():
                head = await publish_policy(js, model, {"router_temperature": (n % 90) / 100},
                                            expected_revision=head)
                n += 1
            return n

        async def check() -> int:
            checks = 0
            while not stop.is_set():
                assert not await policy.check_stream(), "re-synced although the stream did not go back"
                checks += 1
                await asyncio.sleep(0)
            return checks

        writer, checker = asyncio.create_task(write()), asyncio.create_task(check())
        await asyncio.sleep(3.0)
        stop.set()
        written, checks = await writer, await checker
        assert written > 50 and checks > 50, (written, checks)
        assert policy.resyncs == 0
    finally:
        await admin.close()
        await router.stop()
