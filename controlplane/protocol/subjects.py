"""Every stream, bucket, subject and header name on the bus, defined once.

``model_key`` is a reversible, NATS-token-safe encoding of a model name: ASCII letters, digits
and ``-`` stand for themselves; every other byte of the UTF-8 name (``/``, ``.``, ``:``, ``_``,
space, ``*``, ``>``, non-ASCII ...) becomes ``_XX`` (upper-case hex). ``_`` is the escape, so it is
itself escaped and decoding is unambiguous.
"""

from __future__ import annotations

import functools
import re

from controlplane.protocol.errors import InvalidRequest

STREAM_POLICY = "RUDDER_POLICY"
STREAM_MEMBERSHIP = "RUDDER_MEMBERSHIP"
BUCKET_ROUTERS = "RUDDER_ROUTERS"
STREAM_ACKS = "RUDDER_ACKS"
STREAM_AUDIT_CHECKPOINTS = "RUDDER_AUDIT_CHECKPOINTS"
#: Operator-issued worker manifests (issue 17): what each worker may claim, signed by the control
#: plane; the control plane alone publishes there, routers read.
STREAM_MANIFESTS = "RUDDER_MANIFESTS"
#: Storage probes (B2): a process that must know whether the bus can store writes here.
STREAM_PROBE = "RUDDER_PROBE"

POLICY_PREFIX = "rudder.policy"
MEMBERSHIP_PREFIX = "rudder.workers"
KV_PREFIX = "rudder.kv"
KVDUMP_PREFIX = "rudder.kvdump"
# Request/reply: the control plane asks one router for its sampled decision records
# (``GET /decisions/{request_id}``); the router answers on the request's reply inbox.
DECISIONS_PREFIX = "rudder.decisions"
ACKS_PREFIX = "rudder.acks"
AUDIT_PREFIX = "rudder.audit"
#: ``rudder.restore.<router_id>``: a router without a valid signed head asks the control plane
#: for the last document it wrote (request/reply; the answer is signed with the policy key).
RESTORE_PREFIX = "rudder.restore"
#: ``rudder.manifests.<instance_id>``: the signed manifest of one worker (last one wins).
MANIFESTS_PREFIX = "rudder.manifests"
MANIFESTS_SUBJECTS = f"{MANIFESTS_PREFIX}.>"

POLICY_SUBJECTS = f"{POLICY_PREFIX}.>"
MEMBERSHIP_SUBJECTS = f"{MEMBERSHIP_PREFIX}.>"
ACKS_SUBJECTS = f"{ACKS_PREFIX}.>"
#: One subject: every checkpoint of the audit and ACK chains, in order (CAS on its sequence).
AUDIT_CHECKPOINTS_SUBJECT = "rudder.audit.checkpoints"
#: The control plane's storage probe (readiness) and ``rudder up``'s (supervision). Under the audit
#: prefix, which the control plane may already publish to (a subject of its own would lengthen its
#: credentials past NATS's control-line limit).
PROBE_PREFIX = f"{AUDIT_PREFIX}.probe"
PROBE_SUBJECTS = f"{PROBE_PREFIX}.>"
PROBE_CONTROLPLANE = f"{PROBE_PREFIX}.controlplane"
#: Durable pull consumer on ``RUDDER_ACKS`` shared by every control-plane replica of a fleet.
ACKS_CONSUMER_DEFAULT = "rudder-controlplane"

HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_MSG_ID = "Nats-Msg-Id"
# Policy event signature (DESIGN §9): key id and base64 Ed25519 signature over subject + payload.
HDR_KEY_ID = "Rudder-Key-Id"
HDR_SIGNATURE = "Rudder-Signature"
# W3C trace context (controlplane.telemetry.traces): on HTTP requests, and on a policy message so
# that a router's apply span links to the PATCH that published it. Not signed, not stored in the
# event: a trace is a diagnostic, never a fact of the policy.
HDR_TRACEPARENT = "traceparent"
HDR_TRACESTATE = "tracestate"

# JetStream API error codes we branch on.
JS_ERR_WRONG_LAST_SEQUENCE = 10071
# Every code a "wrong last sequence" (a stale compare-and-set) comes with: 10071 from a single
# server, 10164 (no sequence in the text) from a clustered nats-server 2.15.
JS_ERRS_WRONG_LAST_SEQUENCE = frozenset({JS_ERR_WRONG_LAST_SEQUENCE, 10164})
JS_ERR_STREAM_NOT_FOUND = 10059

_SAFE = re.compile(r"[A-Za-z0-9-]")
_TOKEN = re.compile(r"^(?:[A-Za-z0-9-]|_[0-9A-F]{2})+$")
MAX_MODEL_NAME_BYTES = 256


@functools.lru_cache(maxsize=4096)  # on every bus message's subject check; names are few
def encode_model_key(model: str) -> str:
    """Encode a model name as one NATS subject token. Raises InvalidRequest for '' or too long."""
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string", field="model")
    raw = model.encode("utf-8")
    if len(raw) > MAX_MODEL_NAME_BYTES:
        raise InvalidRequest(
            f"model name is longer than {MAX_MODEL_NAME_BYTES} bytes", field="model"
        )
    out: list[str] = []
    for byte in raw:
        ch = chr(byte)
        out.append(ch if byte < 128 and _SAFE.fullmatch(ch) else f"_{byte:02X}")
    return "".join(out)


def decode_model_key(key: str) -> str:
    """Inverse of :func:`encode_model_key`. Raises InvalidRequest if ``key`` is not an encoding."""
    if not _TOKEN.fullmatch(key):
        raise InvalidRequest(f"{key!r} is not a model key", field="model_key")
    buf = bytearray()
    i = 0
    while i < len(key):
        if key[i] == "_":
            buf.append(int(key[i + 1 : i + 3], 16))
            i += 3
        else:
            buf.append(ord(key[i]))
            i += 1
    try:
        return buf.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{key!r} is not a model key", field="model_key") from exc


def policy_subject(model: str, kind: str) -> str:
    return f"{POLICY_PREFIX}.{encode_model_key(model)}.{kind}"


def policy_filter(model: str) -> str:
    """Both documents (every kind) of one model."""
    return f"{POLICY_PREFIX}.{encode_model_key(model)}.*"


def parse_policy_subject(subject: str) -> tuple[str, str]:
    """Return (model, kind) of a policy subject. Raises InvalidRequest."""
    parts = subject.split(".")
    if len(parts) != 4 or ".".join(parts[:2]) != POLICY_PREFIX:
        raise InvalidRequest(f"{subject!r} is not a policy subject", field="subject")
    return decode_model_key(parts[2]), parts[3]


def membership_subject(model: str, instance_id: int) -> str:
    return f"{MEMBERSHIP_PREFIX}.{encode_model_key(model)}.{instance_id}"


def membership_filter(model: str) -> str:
    return f"{MEMBERSHIP_PREFIX}.{encode_model_key(model)}.*"


def kv_subject(model: str, instance_id: int) -> str:
    return f"{KV_PREFIX}.{encode_model_key(model)}.{instance_id}"


def kv_filter(model: str) -> str:
    return f"{KV_PREFIX}.{encode_model_key(model)}.*"


def kvdump_subject(instance_id: int) -> str:
    return f"{KVDUMP_PREFIX}.{instance_id}"


def manifest_subject(instance_id: int) -> str:
    return f"{MANIFESTS_PREFIX}.{instance_id}"


def restore_subject(router_id: str) -> str:
    return f"{RESTORE_PREFIX}.{router_id}"


def decisions_subject(router_id: str) -> str:
    return f"{DECISIONS_PREFIX}.{router_id}"


def acks_subject(router_id: str) -> str:
    return f"{ACKS_PREFIX}.{router_id}"


def router_status_key(router_id: str) -> str:
    """KV key of a router's status (router ids are [A-Za-z0-9-_])."""
    return router_id
