"""Streams and buckets: created and updated by the bus admin only, checked by every service.

``rudder bus init`` (and ``rudder up``, which runs it first) calls :func:`ensure_all` with the
admin identity: it creates what is missing and brings an existing stream to the configured
settings (replicas, history depth). Long-running services never create anything: they call
:func:`wait_ready` for the streams they rely on, which waits for them to appear and then fails
with a message naming the setting that differs (say, 1 replica where ``RUDDER_STREAM_REPLICAS``
says 3).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError

from controlplane.protocol import streams as specs
from controlplane.protocol.errors import ConfigurationError
from controlplane.protocol.subjects import (
    BUCKET_ROUTERS,
    STREAM_ACKS,
    STREAM_AUDIT_CHECKPOINTS,
    STREAM_MANIFESTS,
    STREAM_MEMBERSHIP,
    STREAM_POLICY,
)

log = logging.getLogger(__name__)

JS_ERR_STREAM_NAME_IN_USE = 10058
KV_ROUTERS = f"KV_{BUCKET_ROUTERS}"


@dataclass(frozen=True, slots=True)
class BusLayout:
    """The settings every stream is made with (one place; the bus admin and the services agree)."""

    replicas: int = 1
    history_depth: int = 64
    worker_ttl_s: float = 10.0
    router_heartbeat_s: float = 1.0

    def streams(self) -> list[dict[str, Any]]:
        return [
            specs.policy_stream(history_depth=self.history_depth, replicas=self.replicas),
            specs.membership_stream(worker_ttl_s=self.worker_ttl_s, replicas=self.replicas),
            *specs.extra_streams(replicas=self.replicas),
        ]

    def buckets(self) -> list[dict[str, Any]]:
        return [specs.routers_bucket(heartbeat_s=self.router_heartbeat_s, replicas=self.replicas)]


# Settings a service relies on, per stream: (config key, the setting that names it).
_CHECKED: dict[str, tuple[tuple[str, str], ...]] = {
    STREAM_POLICY: (("num_replicas", "RUDDER_STREAM_REPLICAS"), ("allow_direct", "allow_direct"),
                    ("max_msgs_per_subject", "RUDDER_HISTORY_DEPTH")),
    STREAM_MEMBERSHIP: (("num_replicas", "RUDDER_STREAM_REPLICAS"),
                        ("max_msgs_per_subject", "max_msgs_per_subject")),
    KV_ROUTERS: (("num_replicas", "RUDDER_STREAM_REPLICAS"),),
}
_UPDATABLE = ("num_replicas", "max_msgs_per_subject", "max_age", "allow_direct", "deny_delete",
              "deny_purge", "duplicate_window")


def _differs(want: dict[str, Any], have: StreamConfig) -> list[str]:
    out = []
    for key in _UPDATABLE:
        if key in want and getattr(have, key, None) != want[key]:
            out.append(key)
    return out


async def ensure_all(js: JetStreamContext, layout: BusLayout) -> list[str]:
    """Create or update every stream and bucket (admin identity). Returns what changed."""
    changed: list[str] = []
    for config in layout.streams():
        name = config["name"]
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            try:
                await js.add_stream(StreamConfig(**config))
                changed.append(f"created stream {name}")
            except BadRequestError as exc:
                if exc.err_code != JS_ERR_STREAM_NAME_IN_USE:
                    raise
            continue
        keys = _differs(config, info.config)
        if keys:
            merged = StreamConfig.from_response({**info.config.as_dict(), **config})
            await js.update_stream(merged)
            changed.append(f"updated stream {name} ({', '.join(keys)})")
    for config in layout.buckets():
        stream = f"KV_{config['bucket']}"
        try:
            info = await js.stream_info(stream)
        except NotFoundError:
            await js.create_key_value(KeyValueConfig(**config))
            changed.append(f"created bucket {config['bucket']}")
            continue
        if info.config.num_replicas != config["replicas"]:
            merged = StreamConfig.from_response({**info.config.as_dict(), "num_replicas": config["replicas"]})
            await js.update_stream(merged)
            changed.append(f"updated bucket {config['bucket']} (num_replicas)")
    for line in changed:
        log.info("bus init: %s", line)
    return changed


#: How long one request waits for an answer while :func:`ensure_all_retrying` waits for the API.
PROBE_TIMEOUT_S = 0.5


async def ensure_all_retrying(contexts: Callable[[float], JetStreamContext], layout: BusLayout, *,
                              timeout_s: float, request_timeout_s: float = 5.0) -> list[str]:
    """:func:`ensure_all`, retried while a cluster is still forming (no meta leader yet).

    A forming cluster leaves JetStream API requests unanswered until it has a meta leader, so each
    such request costs its whole timeout (``request_timeout_s``; the leader is there well within
    1 s). The API is first asked with :data:`PROBE_TIMEOUT_S` until it answers; then the work runs
    with twice that, doubled after each attempt left unanswered up to ``request_timeout_s`` (a
    leader that changes just after answering costs a second, not the whole timeout, and a slow
    server still gets the full timeout in the end). ``contexts(timeout)`` gives a JetStream
    context with that request timeout (``nc.jetstream``)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    await _until_answering(contexts, layout, deadline)
    wait = PROBE_TIMEOUT_S
    while True:
        wait = min(2 * wait, request_timeout_s)
        try:
            return await ensure_all(contexts(wait), layout)
        except (APIError, nats.errors.Error, TimeoutError) as exc:
            _raise_unless_forming(exc, deadline)
            log.info("JetStream not ready yet (%s, after waiting up to %.1f s); retrying", exc, wait)
            await asyncio.sleep(0.25)


# What a JetStream cluster still forming answers besides nothing and 503: "no meta leader", and
# "no suitable peers for placement, peer offline" (the leader is elected but has not yet heard
# from every peer an R3 stream needs: seen once in CI creating the streams of compose's cluster).
_FORMING = frozenset({10008, 10005})


def _raise_unless_forming(exc: Exception, deadline: float) -> None:
    """Re-raise ``exc`` unless it is what a cluster still forming answers (nothing, 503, or
    :data:`_FORMING`) and ``deadline`` has not passed (a placement that never succeeds, say R3 on
    one server, is raised at the deadline)."""
    if isinstance(exc, APIError) and exc.code not in (None, 503) and exc.err_code not in _FORMING:
        raise exc
    if asyncio.get_running_loop().time() > deadline:
        raise exc


async def _until_answering(contexts: Callable[[float], JetStreamContext], layout: BusLayout,
                           deadline: float) -> None:
    """Until the JetStream API answers a stream lookup (found or not found, either is an answer),
    each asked with :data:`PROBE_TIMEOUT_S`; raises the last error at ``deadline``."""
    js = contexts(PROBE_TIMEOUT_S)
    name = layout.streams()[0]["name"]
    while True:
        try:
            await js.stream_info(name)
            return
        except NotFoundError:
            return
        except (APIError, nats.errors.Error, TimeoutError) as exc:
            _raise_unless_forming(exc, deadline)
            log.info("JetStream not answering yet (%s, after waiting up to %.1f s); asking again", exc,
                     PROBE_TIMEOUT_S)
            await asyncio.sleep(0.05)


def _expected(layout: BusLayout, stream: str) -> dict[str, Any]:
    for config in layout.streams():
        if config["name"] == stream:
            return config
    for config in layout.buckets():
        if f"KV_{config['bucket']}" == stream:
            return {"num_replicas": config["replicas"]}
    raise KeyError(stream)


async def check(js: JetStreamContext, layout: BusLayout, stream: str) -> None:
    """Raise :class:`ConfigurationError` when ``stream`` is missing or differs from ``layout``."""
    try:
        info = await js.stream_info(stream)
    except NotFoundError as exc:
        raise ConfigurationError(
            f"stream {stream} does not exist: run `rudder bus init` (the bus admin creates streams)",
            field="stream", stream=stream) from exc
    want = _expected(layout, stream)
    for key, setting in _CHECKED.get(stream, (("num_replicas", "RUDDER_STREAM_REPLICAS"),)):
        if key in want and getattr(info.config, key, None) != want[key]:
            raise ConfigurationError(
                f"stream {stream} has {key}={getattr(info.config, key, None)!r} where this process is "
                f"configured for {want[key]!r} ({setting}); run `rudder bus init` with the same settings",
                field=setting, stream=stream)


async def wait_ready(js: JetStreamContext, layout: BusLayout, streams: list[str], *,
                     timeout_s: float) -> None:
    """Wait until every stream exists, then check its settings. A missing stream is waited for
    (the bus init job may still run); a stream that differs fails at once."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    logged = False
    for stream in streams:
        while True:
            try:
                await check(js, layout, stream)
                break
            except ConfigurationError as exc:
                if exc.facts.get("stream") != stream or "does not exist" not in exc.message:
                    raise
                if asyncio.get_running_loop().time() > deadline:
                    raise
                if not logged:
                    log.warning("waiting for stream %s (run `rudder bus init`)", stream)
                    logged = True
            except (nats.errors.Error, TimeoutError, APIError) as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise ConfigurationError(f"JetStream did not answer for {stream}: {exc}",
                                             field="nats_url") from exc
            await asyncio.sleep(0.2)


ROUTER_STREAMS = [STREAM_POLICY, STREAM_MEMBERSHIP, KV_ROUTERS, STREAM_ACKS, STREAM_MANIFESTS]
WORKER_STREAMS = [STREAM_MEMBERSHIP]
CONTROLPLANE_STREAMS = [STREAM_POLICY, STREAM_MEMBERSHIP, KV_ROUTERS, STREAM_ACKS, STREAM_AUDIT_CHECKPOINTS,
                        STREAM_MANIFESTS]
