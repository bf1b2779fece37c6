"""Stream and bucket settings of DESIGN §2, as plain data (no nats import).

Only the bus admin (``rudder bus init``, :mod:`bus.streams`) creates and updates streams, with these
settings; every service checks the ones it relies on at start.
"""

from __future__ import annotations

from typing import Any

from controlplane.protocol.subjects import (
    ACKS_SUBJECTS,
    AUDIT_CHECKPOINTS_SUBJECT,
    BUCKET_ROUTERS,
    MANIFESTS_SUBJECTS,
    MEMBERSHIP_SUBJECTS,
    POLICY_SUBJECTS,
    PROBE_SUBJECTS,
    STREAM_ACKS,
    STREAM_AUDIT_CHECKPOINTS,
    STREAM_MANIFESTS,
    STREAM_MEMBERSHIP,
    STREAM_POLICY,
    STREAM_PROBE,
)

DUPLICATE_WINDOW_S = 120.0
#: ACK/NACKs are kept at least this long (DESIGN §2): a control plane away for days loses none.
ACKS_MIN_AGE_S = 7 * 24 * 3600.0


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


def acks_stream(*, max_age_s: float = ACKS_MIN_AGE_S, replicas: int = 1) -> dict[str, Any]:
    """Router ACK/NACKs, consumed by the control plane's durable consumer (limits by age)."""
    return {
        "name": STREAM_ACKS,
        "subjects": [ACKS_SUBJECTS],
        "storage": "file",
        "retention": "limits",
        "max_age": max(max_age_s, ACKS_MIN_AGE_S),
        "duplicate_window": DUPLICATE_WINDOW_S,
        "num_replicas": replicas,
    }


def audit_checkpoints_stream(*, replicas: int = 1) -> dict[str, Any]:
    """Signed checkpoints of the audit and ACK chains: kept forever, never deleted or purged."""
    return {
        "name": STREAM_AUDIT_CHECKPOINTS,
        "subjects": [AUDIT_CHECKPOINTS_SUBJECT],
        "storage": "file",
        "retention": "limits",
        "allow_direct": True,
        "deny_delete": True,
        "deny_purge": True,
        "duplicate_window": DUPLICATE_WINDOW_S,
        "num_replicas": replicas,
    }


def manifests_stream(*, replicas: int = 1) -> dict[str, Any]:
    """Worker manifests (what each worker may claim), signed by the control plane: the last few
    per worker, never deleted or purged (a manifest is replaced by issuing another)."""
    return {
        "name": STREAM_MANIFESTS,
        "subjects": [MANIFESTS_SUBJECTS],
        "storage": "file",
        "retention": "limits",
        "max_msgs_per_subject": 4,
        "allow_direct": True,
        "deny_delete": True,
        "deny_purge": True,
        "num_replicas": replicas,
    }


def routers_bucket(*, heartbeat_s: float = 1.0, replicas: int = 1) -> dict[str, Any]:
    return {"bucket": BUCKET_ROUTERS, "ttl": 3.0 * heartbeat_s, "history": 1, "replicas": replicas}


def probe_stream(*, replicas: int = 1) -> dict[str, Any]:
    """Storage probes: a write that succeeds only if the bus can store (file storage, the same
    replicas as the data); one message per subject, kept a minute."""
    return {
        "name": STREAM_PROBE,
        "subjects": [PROBE_SUBJECTS],
        "storage": "file",
        "retention": "limits",
        "max_msgs_per_subject": 1,
        "max_age": 60.0,
        "num_replicas": replicas,
    }


def extra_streams(*, replicas: int = 1) -> list[dict[str, Any]]:
    """Streams beyond the policy and membership ones: router ACKs, audit checkpoints, probes,
    worker manifests."""
    return [acks_stream(replicas=replicas), audit_checkpoints_stream(replicas=replicas),
            probe_stream(replicas=replicas), manifests_stream(replicas=replicas)]
