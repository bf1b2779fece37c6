"""Who may say what on the bus (DESIGN §9): the NATS permissions of each Rudder identity.

Every process connects as a user whose JWT carries exactly these allow-lists; the server drops
anything else (and reports it to the connection's error callback). Pure: subjects in, permissions
out.

- **admin** (one-shot jobs: ``rudder bus init``, tests that stand in for an attacker with full
  rights): everything, including stream create/update/delete. No long-running service holds it.
- **controlplane**: publishes policy (CAS), audit checkpoints and worker manifests; reads every stream (info, direct
  get, its own consumers, the ACK stream's durable consumer); asks routers for their decision
  records (``rudder.decisions.*``); never creates, updates, purges or deletes a stream.
- **router ``<router_id>``**: publishes only its own ACKs and its own status key, kvdump requests;
  creates consumers on the policy, membership and manifest streams; subscribes to KV events; answers
  requests on its own decisions subject (``rudder.decisions.<router_id>``); publishes its
  bookings on ``rudder.routerload.<router_id>`` and reads its peers' (``rudder.routerload.*``).
- **worker ``<model>/<instance_id>``**: publishes only its own membership and KV subjects, and
  answers requests on its own kvdump subject.

Each identity has its own inbox prefix (``_INBOX.<identity>``), so one identity cannot read the
replies meant for another.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from bus.jwt import Permissions
from controlplane.protocol.subjects import (
    ACKS_PREFIX,
    AUDIT_PREFIX,
    BUCKET_ROUTERS,
    DECISIONS_PREFIX,
    KV_PREFIX,
    KVDUMP_PREFIX,
    MANIFESTS_PREFIX,
    POLICY_PREFIX,
    RESTORE_PREFIX,
    ROUTERLOAD_PREFIX,
    STREAM_ACKS,
    STREAM_AUDIT_CHECKPOINTS,
    STREAM_MANIFESTS,
    STREAM_MEMBERSHIP,
    STREAM_POLICY,
    decisions_subject,
    kv_subject,
    kvdump_subject,
    membership_subject,
    restore_subject,
    router_load_subject,
)

_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
KV_STREAM_ROUTERS = f"KV_{BUCKET_ROUTERS}"


class IdentityKind(enum.StrEnum):
    ADMIN = "admin"
    CONTROLPLANE = "controlplane"
    ROUTER = "router"
    WORKER = "worker"


@dataclass(frozen=True, slots=True)
class Identity:
    """One bus identity. ``name`` is what the server logs and what the inbox prefix is made of."""

    kind: IdentityKind
    router_id: str | None = None
    model: str | None = None
    instance_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind is IdentityKind.ROUTER and not (self.router_id and _ID.fullmatch(self.router_id)):
            raise ValueError("a router identity needs a router_id of [A-Za-z0-9_-]{1,64}")
        if self.kind is IdentityKind.WORKER and (not self.model or not self.instance_id):
            raise ValueError("a worker identity needs a model and a nonzero instance_id")

    @property
    def name(self) -> str:
        if self.kind is IdentityKind.ROUTER:
            return f"router-{self.router_id}"
        if self.kind is IdentityKind.WORKER:
            return f"worker-{self.instance_id}"
        return self.kind.value

    @property
    def inbox_prefix(self) -> str:
        return f"_INBOX.{self.name}"


def _js_read(stream: str, *, consumers: bool) -> list[str]:
    """Stream info and reads of one stream; with ``consumers``, creating and using consumers."""
    subjects = [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
    ]
    if consumers:
        subjects += [
            f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.*", f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.FC.{stream}.>", f"$JS.ACK.{stream}.>",
        ]
    return subjects


def permissions(identity: Identity) -> Permissions:
    inbox = f"{identity.inbox_prefix}.>"
    kind = identity.kind
    if kind is IdentityKind.ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    if kind is IdentityKind.CONTROLPLANE:
        pub = [f"{POLICY_PREFIX}.>", f"{AUDIT_PREFIX}.>", f"{DECISIONS_PREFIX}.*", "$JS.API.INFO",
               "$JS.API.STREAM.NAMES"]
        # Consumers only where it consumes (ACKs, membership, router status); the policy and
        # checkpoint streams it reads by direct get. The JWT must fit NATS's control line (4 KB).
        for stream in (STREAM_MEMBERSHIP, STREAM_ACKS, KV_STREAM_ROUTERS):
            pub += _js_read(stream, consumers=True)
        for stream in (STREAM_POLICY, STREAM_AUDIT_CHECKPOINTS):
            pub += _js_read(stream, consumers=False)
        pub += [f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM_ACKS}.*"]
        # Worker manifests: it alone publishes them (signed); it lists them by direct get, and
        # confirms the end of the list with the stream's leader (bus.client: a replica behind the
        # stream misses its newest messages).
        pub += [f"{MANIFESTS_PREFIX}.>", f"$JS.API.STREAM.INFO.{STREAM_MANIFESTS}",
                f"$JS.API.DIRECT.GET.{STREAM_MANIFESTS}", f"$JS.API.STREAM.MSG.GET.{STREAM_MANIFESTS}"]
        # Answers to routers' restore questions go to their inboxes (NATS allow_responses).
        return Permissions(publish=tuple(pub), subscribe=(inbox, f"{ACKS_PREFIX}.>", f"{RESTORE_PREFIX}.*"),
                           responses=True)
    if kind is IdentityKind.ROUTER:
        assert identity.router_id is not None
        pub = [
            f"{ACKS_PREFIX}.{identity.router_id}",
            restore_subject(identity.router_id),
            router_load_subject(identity.router_id),
            f"$KV.{BUCKET_ROUTERS}.{identity.router_id}",
            f"{KVDUMP_PREFIX}.*",
            "$JS.API.INFO", "$JS.API.STREAM.NAMES",
            f"$JS.API.STREAM.INFO.{STREAM_ACKS}",
            *_js_read(STREAM_POLICY, consumers=True),
            *_js_read(STREAM_MEMBERSHIP, consumers=True),
            *_js_read(STREAM_MANIFESTS, consumers=True),
            f"$JS.API.STREAM.INFO.{KV_STREAM_ROUTERS}",
            f"$JS.API.DIRECT.GET.{KV_STREAM_ROUTERS}.$KV.{BUCKET_ROUTERS}.{identity.router_id}",
        ]
        return Permissions(publish=tuple(pub),
                           subscribe=(inbox, f"{KV_PREFIX}.>", decisions_subject(identity.router_id),
                                      f"{ROUTERLOAD_PREFIX}.*"),
                           responses=True)
    assert identity.model is not None and identity.instance_id is not None
    pub = [
        membership_subject(identity.model, identity.instance_id),
        kv_subject(identity.model, identity.instance_id),
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{STREAM_MEMBERSHIP}",
    ]
    return Permissions(publish=tuple(pub), subscribe=(inbox, kvdump_subject(identity.instance_id)),
                       responses=True)

