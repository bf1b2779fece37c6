"""The scheduler actor's vocabulary: what a selection asks and answers, and the commands other
tasks send it (imperative names; each carries the future its sender awaits, if any). Pure data.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NamedTuple, TypeVar

from controlplane.protocol.events import (
    AppliedDocument,
    KvDumpReply,
    KvEvent,
    MembershipEvent,
    WorkerRole,
)
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.signing import Keyring
from router.discovery import Change
from router.peers import Figures, Finished, Snapshot, WorkerKey
from router.policy_state import ApplyResult
from router.targets import Pin, Targets
from router.timing_fit import FitResult, FitWindow

if TYPE_CHECKING:
    from router.scheduler import Scheduler

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Requests and answers

PREFILL_BOOKING = ":prefill"  # suffix of the booking id of a disaggregated request's prefill phase


class Phase(enum.Enum):
    """What a selection is for. ``AUTO``: the whole request on a router of a prefill or decode
    role or on an aggregated deployment, or its prefill phase when the model's snapshot holds
    prefill and decode workers (the answer says so); ``DECODE``: the decode phase that follows."""

    AUTO = "auto"
    DECODE = "decode"


class RoutingRequest(NamedTuple):
    """What a selection is asked (a tuple: made for every request, where a frozen dataclass's
    constructor sets each field through ``object.__setattr__``)."""

    request_id: str
    model: str
    prompt_tokens: int
    hashes: Mapping[int, Sequence[int]]  # block size → chain hashes of the prompt's full blocks
    pin: Pin | None = None  # used when ``targets`` is None
    exclude: frozenset[int] = frozenset()  # workers that already failed this request
    targets: Targets | None = None  # both phases' explicit targets (parse_targets)
    phase: Phase = Phase.AUTO
    # The request's TTFT objective (x-rudder-ttft-slo-ms / nvext.ttft_slo_ms), if any.
    ttft_slo_ms: float | None = None


class Revisions(dict[str, int]):
    """The revision of each document kind a model's selections run with (one shared mapping until
    a policy event or a re-sync changes one), with its text (``kind=revision,...``, sorted) made
    once: the request's log context, its trace and a debug header name it on every request."""

    __slots__ = ("text",)

    def __init__(self, revisions: Mapping[str, int]) -> None:
        super().__init__(revisions)
        self.text = ",".join(f"{k}={v}" for k, v in sorted(self.items()))


NO_REVISIONS = Revisions({})


class Selection(NamedTuple):
    """The scheduler's answer to a :class:`SelectWorker` (a named tuple: built on every request)."""

    request_id: str
    model: str
    instance_id: int
    dp_rank: int
    url: str
    revisions: Revisions  # kind → revision of the document it was scored with (shared)
    seq: int  # position of the command in the queue
    cost: float | None
    overlap_blocks: int
    cached_tokens: int
    prompt_tokens: int
    candidates: int
    pinned: bool = False
    pool: WorkerRole = WorkerRole.AGGREGATED
    # Id its booking is kept under (send RequestFirstToken / RequestDone with it).
    booking_id: str = ""
    # True for the prefill phase of a disaggregated request: a decode phase must follow.
    disaggregated: bool = False
    # The chosen worker's predicted engine time to first token (router.cost.time), in ms.
    predicted_ttft_ms: float | None = None
    # With a TTFT objective: whether the chosen worker was predicted to meet it.
    slo_predicted_met: bool | None = None

    @property
    def predicted_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PolicyApplied:
    result: ApplyResult
    seq: int


@dataclass(frozen=True, slots=True)
class RouterView:
    """What the HTTP side may read without asking the actor (replaced, never mutated)."""

    ready: bool = False
    block_sizes: dict[str, frozenset[int]] = field(default_factory=dict)
    tokenizers: dict[str, frozenset[str]] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)
    applied: dict[str, AppliedDocument] = field(default_factory=dict)
    # Workers per model whose heartbeat is fresh (live: candidates for selection).
    live_workers: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Commands (imperative names; each carries the future its sender awaits, if any)


@dataclass(slots=True)
class Command(Generic[T]):
    future: asyncio.Future[T] | None = field(default=None, kw_only=True)
    seq: int = field(default=0, kw_only=True)
    # Whether workers are alive and reachable: handled ahead of every request's command queued
    # before it (the actor's liveness lane), so that how far behind a loaded router is never
    # reads as a worker's silence (router.scheduler; docs/decisions.md 107). Policy commands
    # keep their place in the queue: a revision lands between the selections queued before and
    # after it (their ``seq`` tells which ran under it).
    liveness: ClassVar[bool] = False


@dataclass(slots=True)
class SelectWorker(Command[Selection]):
    request: RoutingRequest


@dataclass(slots=True)
class ApplyPolicy(Command[PolicyApplied]):
    model: str
    kind: PolicyKind
    revision: int
    payload: bytes
    headers: dict[str, str] | None  # the message's headers: the signature is among them
    previous: int | None = None  # what precedes ``revision`` on its subject (the chain check)


@dataclass(slots=True)
class RestorePolicy(Command[PolicyApplied]):
    """The control plane's signed answer to a restore request (``PolicyState.restore``)."""

    model: str
    kind: PolicyKind
    answer: bytes
    nonce: str


@dataclass(slots=True)
class UseVerifyKeys(Command[None]):
    """The verify-keys file changed: check policy signatures against this keyring from now on."""

    keyring: Keyring


@dataclass(slots=True)
class ResyncPolicy(Command[dict[str, int]]):
    """The policy stream went backwards: forget applied revisions (answers them)."""

    reason: str


@dataclass(slots=True)
class ApplyMembership(Command[Change]):
    liveness = True
    event: MembershipEvent
    received_at: datetime | None = None  # when the bus stored it (liveness uses it, not event.at)
    live: bool = False  # delivered as stored (not the replay): its received_at is the bus's now


@dataclass(slots=True)
class ApplyKvEvents(Command[list[int]]):
    """Answers the worker ids whose full state must be fetched (gap or new worker)."""

    events: list[KvEvent]


@dataclass(slots=True)
class LoadKvDump(Command[bool]):
    """Answers True when another dump is to be asked for, the worker's events buffered until it
    comes (the reply is of another process than the known one, or ``stale``, or events are still
    missing after it): ``Scheduler._load_dump``."""

    instance_id: int
    reply: KvDumpReply | None  # None: the dump failed; replay what was buffered
    stale: bool = False  # another dump was asked for while this one was on its way
    final: bool = False  # no other dump will be asked for: take what can be taken, answer False


@dataclass(slots=True)
class DiscoveryComplete(Command[None]):
    liveness = True


@dataclass(slots=True)
class RequestFirstToken(Command[None]):
    request_id: str
    # Measured from sending the request to its worker to its first token (feeds the fit).
    ttft_ms: float | None = None


@dataclass(slots=True)
class RequestDone(Command[None]):
    request_id: str
    # A streamed request that completed: its mean inter-token time and its decode tokens.
    itl_ms: float | None = None
    decode_tokens: int | None = None
    # The answer reported ``reported_cached`` cached tokens (usage) where the router predicted
    # ``predicted_cached`` for ``instance_id``: the check of the worker's cache claims
    # (router.claims), in the request's one end command rather than a command of its own.
    instance_id: int = 0
    predicted_cached: int = 0
    reported_cached: int | None = None
    # The request's first token came with its end (a non-streamed answer, or a stream whose
    # first token was in its last read): its RequestFirstToken (``ttft_ms`` as there), then its
    # end, in this one command.
    first_token: bool = False
    ttft_ms: float | None = None


@dataclass(slots=True)
class TakeFitWindows(Command[list[FitWindow]]):
    """Copy the calibration windows with a refit due (router.fitting fits them off the actor)."""


@dataclass(slots=True)
class ApplyFits(Command[None]):
    """Finished calibration fits: the workers' slots score with the new timing models."""

    results: list[FitResult]


@dataclass(slots=True)
class TakeBookings(Command[Snapshot | None]):
    """This router's bookings per rank for its peers (router.peersync), with their version, and the
    expected-returns events since the last snapshot (taken: they are sent once); None when nothing
    changed since ``since`` (the version last taken)."""

    since: int = -1


@dataclass(slots=True)
class ApplyPeerLoad(Command[None]):
    """A peer router's snapshot of its bookings (router.peers)."""

    router_id: str
    boot: str
    number: int  # the snapshot's seq (RouterLoad.seq; Command.seq is the queue position)
    ranks: dict[WorkerKey, Figures]
    finished: list[Finished] = field(default_factory=list)  # requests finished at the peer
    returned: list[int] = field(default_factory=list)  # entries closed by returns the peer saw


@dataclass(slots=True)
class MarkUnavailable(Command[None]):
    liveness = True
    instance_id: int


@dataclass(slots=True)
class BusHealth(Command[None]):
    """Whether the bus can store (the router's own status write succeeded): while it cannot,
    discovery holds worker ages (their heartbeats cannot arrive either)."""

    liveness = True

    can_store: bool


@dataclass(slots=True)
class Tick(Command[list[int]]):
    """Expire workers and approximate-index entries; answers the ids of workers gone."""

    liveness = True


@dataclass(slots=True)
class Inspect(Command[Any]):
    """Run a read-only function on the actor's state (status, tests)."""

    fn: Callable[[Scheduler], Any]
