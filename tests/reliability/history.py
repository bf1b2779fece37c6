"""The history checker (issue 18, item 3). Pure: records in, problems out.

A fault run records every write attempt and every router apply; after it, the stream, the ACK
table and the audit log are read back. The checks:

- **linearizable CAS** (:func:`check_linearizable`): per document, the attempts form a history of
  a compare-and-set register whose value is the head revision. A Wing-Gong search (as Knossos and
  Porcupine do) looks for one total order that respects real time (an attempt that completed
  before another began comes first) in which every answer is what the register gives: an accepted
  attempt found the head at its ``expected`` revision and moved it to its ``new_revision`` (newer
  than any before); a conflict found another head. An attempt without a definite answer (a lost
  answer, ``log_ambiguous``) may have taken effect at any point after it began, or never; when
  the stream knows its event, its revision is used.
- **applies** (:func:`check_applies`): every router applies the revisions of a document in
  increasing order, never one twice, and only revisions the stream holds (or held).
- **convergence** (:func:`check_convergence`): after the last fault every live router applies
  the head of every document within the bound.
- **acknowledged writes** (:func:`check_acknowledged`): every attempt answered "accepted" is on
  the stream (or retired by its history limit) and accepted in the audit log.
- **audit truth** (:func:`check_audit_truth`): no event that is on the stream, or that a router
  ACKed, is recorded as rejected (a false ``not_published``), and every accepted decision names
  the revision the stream gave the event.
- **chats** (:func:`check_chats`): no chat that had not started streaming fails for a reason
  other than overload while at least one worker and one router were healthy (a client fails over
  to another router when one does not answer; it fails only when none does).
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


class Answer(enum.Enum):
    ACCEPTED = "accepted"  # 200 with a new revision (or 503 decision_unrecorded: it is live)
    CONFLICT = "conflict"  # 409: the head was not the expected revision
    REFUSED = "refused"  # a definite "nothing happened" (4xx, 503 audit/log_unavailable)
    UNKNOWN = "unknown"  # no definite answer (timeout, connection lost, 503 log_ambiguous)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One write attempt as a client saw it (times on one monotonic clock, seconds)."""

    client: str
    document: str
    expected: int
    answer: Answer
    invoked: float
    completed: float | None = None  # None: no answer arrived
    new_revision: int | None = None  # for ACCEPTED
    head_revision: int | None = None  # for CONFLICT, as the answer said
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class Apply:
    """A router applied (ACKed) one revision of a document."""

    router: str
    document: str
    revision: int
    at: float


@dataclass(frozen=True, slots=True)
class Decision:
    """An audit decision row."""

    event_id: str
    decision: str  # accepted | rejected
    reason_code: str | None = None
    new_revision: int | None = None


@dataclass(frozen=True, slots=True)
class Chat:
    """One chat as a client saw it: ``tried`` routers in turn until one answered."""

    invoked: float
    completed: float
    ok: bool
    reason: str = ""  # why it failed: "<status> <code>" or the transport error's name
    streamed: bool = False  # the failure came after the answer had started streaming
    tried: tuple[str, ...] = ()


#: Refusals a client must expect under load (429 rate_limited, 529 overloaded / queue_full).
OVERLOAD_STATUSES = frozenset({429, 529})


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str
    detail: str


@dataclass
class Verdict:
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def __str__(self) -> str:
        return "ok" if self.ok else "; ".join(f"{p.kind}: {p.detail}" for p in self.problems)


# -- linearizability ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Op:
    attempt: Attempt
    invoked: float
    completed: float  # inf when there was no answer
    required: bool  # must be linearized (an UNKNOWN attempt may never take effect)
    new_revision: int | None  # what it sets the head to if it takes effect (None: unknown)


def _ops(attempts: Sequence[Attempt], stream_events: Mapping[str, int], retained_from: int | None) -> list[_Op]:
    ops: list[_Op] = []
    for a in attempts:
        if a.answer is Answer.REFUSED:
            continue  # a definite "nothing happened": no effect on the register
        if a.answer is Answer.UNKNOWN:
            found = stream_events.get(a.event_id) if a.event_id else None
            if found is not None:  # the stream says it took effect, at this revision
                ops.append(_Op(a, a.invoked, math.inf, True, found))
            elif a.event_id and retained_from is not None and retained_from <= a.expected + 1:
                continue  # every revision after its expected one is retained, and none is it: never
            else:  # not (or no longer) on the stream: it may have taken effect, or never
                ops.append(_Op(a, a.invoked, math.inf, False, None))
            continue
        completed = a.completed if a.completed is not None else math.inf
        ops.append(_Op(a, a.invoked, completed, True, a.new_revision))
    return ops


def _step(op: _Op, head: int | None) -> tuple[bool, int | None]:
    """Whether ``op`` can take effect on a register whose head is ``head`` (None: unknown, after
    an attempt whose revision nobody knows), and the head after it."""
    a = op.attempt
    if a.answer is Answer.CONFLICT:
        return (head is None or head != a.expected), head
    # Accepted (or an unknown attempt taking effect): the head was the expected revision.
    if head is not None and head != a.expected:
        return False, head
    new = op.new_revision
    if new is not None and new <= a.expected:
        return False, head
    return True, new


def linearize(attempts: Sequence[Attempt], *, initial: int = 0,
              stream_events: Mapping[str, int] | None = None, retained_from: int | None = None,
              budget: int = 200_000) -> bool | None:
    """Whether one document's attempts are linearizable; None when the search ran out of
    ``budget`` states (then nothing is claimed). ``stream_events``: event id -> revision of the
    events the stream holds for this document, and ``retained_from``: every revision of it from
    this one on is still held (to settle attempts without an answer: an event id the stream does
    not hold, where it holds every revision after the attempt's expected one, never took effect)."""
    ops = sorted(_ops(attempts, stream_events or {}, retained_from), key=lambda op: op.invoked)
    n = len(ops)
    required = sum(1 << i for i, op in enumerate(ops) if op.required)
    seen: set[tuple[int, int | None]] = set()
    stack: list[tuple[int, int | None]] = [(0, initial)]
    while stack:
        done, head = stack.pop()
        if done & required == required:
            return True
        if (done, head) in seen:
            continue
        seen.add((done, head))
        if len(seen) > budget:
            return None
        first = (~done & (done + 1)).bit_length() - 1  # the earliest-invoked op not linearized
        # Candidates: not yet linearized, and begun before every pending required op completed
        # (an op begun after the horizon cannot complete before it: the scan stops there).
        horizon = math.inf
        for i in range(first, n):
            if ops[i].invoked > horizon:
                break
            if not done >> i & 1 and ops[i].required:
                horizon = min(horizon, ops[i].completed)
        for i in range(first, n):
            if ops[i].invoked > horizon:
                break
            if done >> i & 1:
                continue
            fits, after = _step(ops[i], head)
            if fits:
                stack.append((done | 1 << i, after))
            if not ops[i].required:
                # An attempt that may never take effect: also go on as if it never did.
                stack.append((done | 1 << i, head))
    return False


def check_linearizable(attempts: Iterable[Attempt], *, stream: Mapping[str, Mapping[int, str]] | None = None,
                       retired_below: Mapping[str, int] | None = None, budget: int = 200_000) -> list[Problem]:
    by_doc: dict[str, list[Attempt]] = defaultdict(list)
    for a in attempts:
        by_doc[a.document].append(a)
    problems = []
    for doc, history in sorted(by_doc.items()):
        events = {eid: rev for rev, eid in (stream or {}).get(doc, {}).items()}
        retained = (retired_below or {}).get(doc)
        result = linearize(history, stream_events=events, retained_from=retained, budget=budget)
        if result is False:
            problems.append(Problem("not_linearizable",
                                    f"{doc}: no order of its {len(history)} attempts is a compare-and-set "
                                    "register's history"))
        elif result is None:
            problems.append(Problem("linearizability_unknown", f"{doc}: search budget exhausted"))
    return problems


# -- router applies and convergence ---------------------------------------------------------


def check_applies(applies: Iterable[Apply], *,
                  stream: Mapping[str, Mapping[int, str]] | None = None,
                  retired_below: Mapping[str, int] | None = None) -> list[Problem]:
    """Per router and document: strictly increasing revisions, and (with ``stream``) only
    revisions the stream holds, or held before its history limit retired them."""
    problems = []
    last: dict[tuple[str, str], int] = {}
    applied: dict[tuple[str, str], set[int]] = defaultdict(set)
    for ap in sorted(applies, key=lambda a: a.at):
        key = (ap.router, ap.document)
        if ap.revision in applied[key]:
            problems.append(Problem("duplicate_apply", f"{ap.router} applied {ap.document}@{ap.revision} twice"))
        elif key in last and ap.revision < last[key]:
            problems.append(Problem("out_of_order_apply", f"{ap.router} applied {ap.document}@{ap.revision} "
                                                          f"after @{last[key]}"))
        applied[key].add(ap.revision)
        last[key] = max(last.get(key, 0), ap.revision)
        if stream is not None:
            held = stream.get(ap.document, {})
            floor = (retired_below or {}).get(ap.document, 0)
            if ap.revision not in held and ap.revision >= floor:
                problems.append(Problem("phantom_apply", f"{ap.router} applied {ap.document}@{ap.revision}, "
                                                         "which the stream never held"))
    return problems


def check_convergence(applies: Iterable[Apply], *, heads: Mapping[str, int], routers: Iterable[str],
                      last_fault_at: float, within_s: float = 2.0,
                      written_at: Mapping[str, float] | None = None) -> list[Problem]:
    """Every live router applied the head of every document no later than ``within_s`` after
    the last fault, or after the head was written (``written_at``, per document) if later."""
    first_at: dict[tuple[str, str, int], float] = {}
    newest: dict[tuple[str, str], int] = {}
    for ap in applies:
        key = (ap.router, ap.document, ap.revision)
        first_at[key] = min(first_at.get(key, math.inf), ap.at)
        newest[(ap.router, ap.document)] = max(newest.get((ap.router, ap.document), 0), ap.revision)
    problems = []
    for router in sorted(routers):
        for doc, head in sorted(heads.items()):
            at = first_at.get((router, doc, head))
            if at is None:
                problems.append(Problem("not_converged", f"{router} never applied {doc}@{head} "
                                                         f"(newest applied @{newest.get((router, doc), 0)})"))
            elif at > max(last_fault_at, (written_at or {}).get(doc, -math.inf)) + within_s:
                problems.append(Problem("slow_convergence", f"{router} applied {doc}@{head} "
                                                            f"{at - last_fault_at:.2f}s after the last fault"))
    return problems


# -- acknowledged writes and the audit's truth ------------------------------------------------


def check_acknowledged(attempts: Iterable[Attempt], *, stream: Mapping[str, Mapping[int, str]],
                       audit: Iterable[Decision], retired_below: Mapping[str, int] | None = None) -> list[Problem]:
    accepted_in_audit = {d.event_id: d for d in audit if d.decision == "accepted"}
    problems = []
    for a in attempts:
        if a.answer is not Answer.ACCEPTED or a.new_revision is None:
            continue
        held = stream.get(a.document, {})
        retired = a.new_revision < (retired_below or {}).get(a.document, 0)
        if not retired and a.new_revision not in held:
            problems.append(Problem("lost_write", f"{a.client}'s accepted {a.document}@{a.new_revision} "
                                                  "is not on the stream"))
        elif not retired and a.event_id is not None and held[a.new_revision] != a.event_id:
            problems.append(Problem("lost_write", f"{a.client}'s accepted {a.document}@{a.new_revision} "
                                                  "is another event on the stream"))
        if a.event_id is not None and a.event_id not in accepted_in_audit:
            problems.append(Problem("unaudited_write", f"{a.client}'s accepted {a.document}@{a.new_revision} "
                                                       f"(event {a.event_id}) has no accepted decision"))
    return problems


def check_audit_truth(audit: Iterable[Decision], *, stream: Mapping[str, Mapping[int, str]],
                      acked_events: Iterable[str] = ()) -> list[Problem]:
    on_stream = {eid: rev for held in stream.values() for rev, eid in held.items()}
    seen = set(acked_events) | set(on_stream)
    problems = []
    for d in audit:
        if d.decision == "rejected" and d.event_id in seen:
            where = f"on the stream at @{on_stream[d.event_id]}" if d.event_id in on_stream else "ACKed by a router"
            problems.append(Problem("false_rejection", f"event {d.event_id} is recorded rejected "
                                                       f"({d.reason_code}) but is {where}"))
        if (d.decision == "accepted" and d.event_id in on_stream and d.new_revision is not None
                and d.new_revision != on_stream[d.event_id]):
            problems.append(Problem("wrong_revision", f"event {d.event_id} is recorded at @{d.new_revision} "
                                                      f"but is @{on_stream[d.event_id]} on the stream"))
    return problems


# -- chats ------------------------------------------------------------------------------------


def check_chats(chats: Iterable[Chat], *,
                unserved: Sequence[tuple[float, float]] = ()) -> list[Problem]:
    """Every chat that failed before streaming failed for overload, or while no worker or no
    router was healthy (``unserved``: those windows, as the fault schedule made them)."""
    problems = []
    for c in chats:
        if c.ok or c.streamed:
            continue
        status = c.reason.split(" ", 1)[0]
        if status.isdigit() and int(status) in OVERLOAD_STATUSES:
            continue
        if any(begin <= c.completed and c.invoked <= end for begin, end in unserved):
            continue
        problems.append(Problem("chat_failed", f"a chat through {'/'.join(c.tried) or '-'} failed with "
                                               f"{c.reason} ({c.completed - c.invoked:.2f}s)"))
    return problems


@dataclass
class History:
    """Everything one run recorded, and what was read back after it."""

    attempts: list[Attempt] = field(default_factory=list)
    applies: list[Apply] = field(default_factory=list)
    stream: dict[str, dict[int, str]] = field(default_factory=dict)  # document -> revision -> event id
    retired_below: dict[str, int] = field(default_factory=dict)  # document -> oldest retained revision
    audit: list[Decision] = field(default_factory=list)
    acked_events: set[str] = field(default_factory=set)
    live_routers: set[str] = field(default_factory=set)
    chats: list[Chat] = field(default_factory=list)
    unserved: list[tuple[float, float]] = field(default_factory=list)
    last_fault_at: float | None = None
    converge_within_s: float = 2.0


def check(h: History) -> Verdict:
    verdict = Verdict()
    verdict.problems += check_linearizable(h.attempts, stream=h.stream, retired_below=h.retired_below)
    verdict.problems += check_applies(h.applies, stream=h.stream, retired_below=h.retired_below)
    if h.last_fault_at is not None and h.stream:
        heads = {doc: max(held) for doc, held in h.stream.items() if held}
        written = {a.document: a.completed for a in h.attempts
                   if a.completed is not None and a.new_revision == heads.get(a.document)}
        verdict.problems += check_convergence(h.applies, heads=heads, routers=h.live_routers,
                                              last_fault_at=h.last_fault_at, within_s=h.converge_within_s,
                                              written_at=written)
    verdict.problems += check_acknowledged(h.attempts, stream=h.stream, audit=h.audit,
                                           retired_below=h.retired_below)
    verdict.problems += check_audit_truth(h.audit, stream=h.stream, acked_events=h.acked_events)
    verdict.problems += check_chats(h.chats, unserved=h.unserved)
    return verdict
