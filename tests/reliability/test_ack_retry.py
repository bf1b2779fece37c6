"""A router's ACKs reach the bus soon after it can store again (found by the fleet harness: a
router cut off from NATS for a few seconds was back on the head at once, but its ACKs, retried
with a backoff that grew to 2 s, reached the control plane seconds later, so the fleet looked out
of sync well past the 2 s convergence bound)."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from cli.embedded import EmbeddedNats
from controlplane.protocol.subjects import STREAM_ACKS
from tests import buskit
from tests.support_router.policy import publish_policy
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

pytestmark = pytest.mark.timeout(60)


async def test_an_ack_is_stored_within_a_second_of_the_bus_storing_again(own_nats: EmbeddedNats) -> None:
    model = f"acks/{uuid.uuid4().hex[:6]}"
    nc = await buskit.admin_connect(own_nats.url)
    router = await InProcessRouter(router_settings(own_nats.url, model)).start()
    try:
        js = nc.jetstream()
        await js.delete_stream(STREAM_ACKS)  # every ACK store fails (no stream) until it is back
        revision = await publish_policy(js, model, {"router_temperature": 0.3}, expected_revision=0)
        async with httpx.AsyncClient(base_url=router.url, timeout=2) as http:
            async def applied() -> bool:
                body = (await http.get("/health")).json()
                return int(body["applied"].get(f"{model}|selection", 0)) >= revision
            await wait_for(applied, within=10)
        applied_at = time.monotonic()
        # 3.5 s of failed retries: a doubling backoff is past 1 s by then.
        await asyncio.sleep(3.5)
        await asyncio.to_thread(buskit.init_streams, own_nats.url)
        back_at = time.monotonic()
        while (await js.stream_info(STREAM_ACKS)).state.messages < 1:
            assert time.monotonic() - back_at < 5, "the ACK was never stored"
            await asyncio.sleep(0.02)
        took = time.monotonic() - back_at
        assert took < 1.0, f"ACK stored {took:.2f}s after the stream was back ({back_at - applied_at:.1f}s of failures)"
    finally:
        await router.stop()
        await nc.close()
