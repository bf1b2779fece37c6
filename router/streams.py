"""Create the streams and the bucket a router needs, if missing (DESIGN §2).

The settings are those of :mod:`controlplane.protocol.streams` (RUDDER_POLICY: file storage,
max_msgs_per_subject = history depth, allow_direct, deny_delete, deny_purge, duplicate window
120 s; RUDDER_MEMBERSHIP: max_msgs_per_subject 1, max_age >= 10 x worker TTL; RUDDER_ROUTERS KV:
TTL 3 x heartbeat). The control plane and the workers create them too: whoever comes first wins,
and an existing stream is left as it is (an operator may run it with 3 replicas).
"""

from __future__ import annotations

import logging
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from controlplane.protocol import streams as specs

log = logging.getLogger(__name__)

JS_ERR_STREAM_NAME_IN_USE = 10058


async def ensure_stream(js: JetStreamContext, config: dict[str, Any]) -> None:
    try:
        await js.stream_info(config["name"])
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(StreamConfig(**config))
        log.info("created stream %s", config["name"])
    except BadRequestError as exc:
        if exc.err_code != JS_ERR_STREAM_NAME_IN_USE:
            raise
        log.info("stream %s was created concurrently", config["name"])


async def ensure_bucket(js: JetStreamContext, config: dict[str, Any]) -> KeyValue:
    try:
        return await js.key_value(config["bucket"])
    except (NotFoundError, BucketNotFoundError):
        pass
    try:
        return await js.create_key_value(KeyValueConfig(**config))
    except BadRequestError as exc:
        if exc.err_code != JS_ERR_STREAM_NAME_IN_USE:
            raise
        return await js.key_value(config["bucket"])


async def ensure_all(
    js: JetStreamContext, *, history_depth: int, replicas: int, worker_ttl_s: float,
    heartbeat_s: float,
) -> KeyValue:
    """The streams a router uses (policy, membership, ACKs) and the status bucket; returns the
    bucket. The ACK stream exists before our first ACK, so none is lost while no control plane
    runs."""
    await ensure_stream(js, specs.policy_stream(history_depth=history_depth, replicas=replicas))
    await ensure_stream(js, specs.membership_stream(worker_ttl_s=worker_ttl_s, replicas=replicas))
    await ensure_stream(js, specs.acks_stream(replicas=replicas))
    return await ensure_bucket(js, specs.routers_bucket(heartbeat_s=heartbeat_s, replicas=replicas))
