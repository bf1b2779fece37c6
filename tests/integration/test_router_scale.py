"""A router serving 1000 models starts (its consumers do not grow with its models: JetStream caps
consumers per stream) and applies a change to any of them."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS

from controlplane.protocol.events import doc_key
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import STREAM_MEMBERSHIP, STREAM_POLICY
from router.settings import RouterSettings
from tests import buskit
from tests.policy_keys import session_keys
from tests.support_router.policy import publish_policy
from tests.support_router.workers import InProcessRouter, free_port, wait_for

pytestmark = pytest.mark.timeout(120)
MODELS = [f"fleet/model-{i:04d}" for i in range(1000)]


async def test_a_router_serving_1000_models_starts_and_applies_a_change(nats_url: str, nc: NATS) -> None:
    settings = RouterSettings(
        nats_url=nats_url, models=MODELS, port=free_port(), router_id="r-wide", mode="round_robin",
        nats_creds=buskit.router_creds("r-wide"), policy_verify_keys=session_keys().verify_path,
    )
    router = await InProcessRouter(settings).start()
    try:
        js = nc.jetstream()
        for stream in (STREAM_POLICY, STREAM_MEMBERSHIP):
            assert (await js.stream_info(stream)).state.consumer_count <= 1
        for model in (MODELS[0], MODELS[737], MODELS[-1]):
            revision = await publish_policy(js, model, {"router_temperature": 0.5}, expected_revision=0)
            key = doc_key(model, PolicyKind.SELECTION)
            await wait_for(lambda key=key, revision=revision: router.runtime.scheduler.view.applied[key].revision
                           == revision, within=20)
            assert router.runtime.scheduler.view.applied[key].effective["router_temperature"] == 0.5
        # Its status (what the control plane shows) still fits one message.
        kv = await js.key_value("RUDDER_ROUTERS")
        entry = await kv.get("r-wide")
        assert entry.value is not None and len(entry.value) < 1024 * 1024
    finally:
        await router.stop()
