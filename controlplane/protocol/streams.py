"""Stream and bucket settings of DESIGN §2, as plain data (no nats import).

Only the bus admin (``rudder bus init``, :mod:`bus.streams`) creates and updates streams, with these
settings; every service checks the ones it relies on at start.
"""

from __future__ import annotations

from typing import Any

from controlplane.protocol.subjects import (
    BUCKET_ROUTERS,
    MEMBERSHIP_SUBJECTS,
    POLICY_SUBJECTS,
    STREAM_MEMBERSHIP,
    STREAM_POLICY,
)

DUPLICATE_WINDOW_S = 120.0


def policy_stream(*, history_depth: int = 64, replicas: int = 1) -> dict[str, Any]:
    return {
        "name": STREAM_POLICY,
        "subjects": [POLICY_SUBJECTS],
        "storage": "file",
        "retention": "limits",
        "max_msgs_per_subject": history_depth,
        "allow_direct": True,
        "deny_delete": True,
        "deny_purge": True,
        "duplicate_window": DUPLICATE_WINDOW_S,
        "num_replicas": replicas,
    }


def membership_stream(*, worker_ttl_s: float = 10.0, replicas: int = 1) -> dict[str, Any]:
    return {
        "name": STREAM_MEMBERSHIP,
        "subjects": [MEMBERSHIP_SUBJECTS],
        "storage": "file",
        "retention": "limits",
        "max_msgs_per_subject": 1,
        "max_age": max(10.0 * worker_ttl_s, 60.0),
        "allow_direct": True,
        "num_replicas": replicas,
    }


def routers_bucket(*, heartbeat_s: float = 1.0, replicas: int = 1) -> dict[str, Any]:
    return {"bucket": BUCKET_ROUTERS, "ttl": 3.0 * heartbeat_s, "history": 1, "replicas": replicas}


def extra_streams(*, replicas: int = 1) -> list[dict[str, Any]]:
    """Streams beyond the policy and membership ones (ACKs, audit checkpoints), as they land."""
    return []
