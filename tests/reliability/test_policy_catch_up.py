"""A router whose policy consumer cannot be created again still converges (issue 18).

An ordered consumer lives on one JetStream server; when that server dies nats-py creates it again,
which needs the cluster's meta leader: if the server killed held that role, a router missed every
policy write for seconds (test_up_ha's routers sat behind the head past its 2 s bound). The
router now reads each document's head directly (any replica answers) when the stream moved on and
its subscription delivered nothing for a second. Here the consumer cannot be created again at all:
the stream's consumer limit is reached once the router's consumer is deleted."""

from __future__ import annotations

import dataclasses
import time

from nats.js.api import ConsumerConfig

from controlplane.protocol.subjects import STREAM_POLICY
from tests import buskit
from tests.integration.test_eventlog import event
from tests.policy_keys import session_keys
from tests.support_router.workers import InProcessRouter, router_settings, wait_for

MODEL = "catchup/model"


async def test_a_router_whose_consumer_cannot_come_back_applies_the_head(nats_url: str) -> None:
    nc = await buskit.admin_connect(nats_url)
    js = nc.jetstream()
    log = session_keys().policy_log(nc)
    router = await InProcessRouter(router_settings(nats_url, MODEL)).start()
    revisions = router.runtime.scheduler.revisions
    config = (await js.stream_info(STREAM_POLICY)).config
    revision = 0
    try:
        revision = (await log.publish(event(MODEL, revision, 0.1))).revision
        await wait_for(lambda: revisions(MODEL).get("selection") == revision, within=10)
        # A consumer of our own keeps the count above zero; the router's ordered ones go, and the
        # limit is the count left: nats-py's attempts to create them again are refused.
        await js.add_consumer(STREAM_POLICY, ConsumerConfig(durable_name="catchup-holder"))
        for info in await js.consumers_info(STREAM_POLICY):
            if info.config.durable_name is None:
                await js.delete_consumer(STREAM_POLICY, info.name)
        left = (await js.stream_info(STREAM_POLICY)).state.consumer_count
        await js.update_stream(dataclasses.replace(config, max_consumers=left))
        for i in range(3):
            revision = (await log.publish(event(MODEL, revision, 0.2 + i / 10))).revision
        began = time.monotonic()
        await wait_for(lambda: revisions(MODEL).get("selection") == revision, within=5)
        print(f"applied the head {time.monotonic() - began:.2f}s after it was written")
        assert not [i for i in await js.consumers_info(STREAM_POLICY) if i.config.durable_name is None], \
            "the router's consumer came back: the case was not exercised"
    finally:
        await js.update_stream(config)
        await js.delete_consumer(STREAM_POLICY, "catchup-holder")
        await router.stop()
        await nc.close()
