"""Stream ↔ audit reconciliation (DESIGN §4 step 8).

``resolve_pending`` settles every "received" record that has no decision (a crash or an
ambiguous publish between steps 5 and 7, or a decision the audit store could not write) by
looking its ``event_id`` up on the stream. It decides ``not_published`` only when the stream can
rule the event out: every revision after the record's ``expected_revision`` is still retained
and none is the event. When the document's oldest retained revision is above it (the per-document
history limit may have dropped the event), the event id is looked up in the router ACK table: a
router that ACKed or NACKed it saw it on the stream, so it was published (``reconciled_from_acks``);
another event accepted on the same expected revision of the document means this one's
compare-and-set failed (only one write succeeds on a revision), so it was not published.
Otherwise the record stays without a decision and is reported as ``undeterminable`` (a finding:
never recorded as rejected).
``check`` verifies the invariant in both directions: every event in ``RUDDER_POLICY`` has exactly
one accepted decision, and every accepted decision has its event. Decisions whose event was
dropped by the stream's per-document history limit are counted as ``retired``, not missing.

It also checks what the stream itself says (DESIGN §9): every event's signature verifies against
the control plane's valid keys (``bad_signatures``: unsigned, unknown key, or not verifying),
each event's ``document`` equals its accepted audit record's ``after`` (``document_mismatches``),
and no ``Nats-Msg-Id`` appears on more than one event (``reused_msg_ids``). A policy event written
around the control plane therefore shows up at least twice: as a bad signature and as an event
without a decision. A signed event published again (a replay: its payload's event was accepted
at another revision) is a ``replayed`` finding, from the stream while it holds it and, for good,
from the routers' ``replayed`` NACKs in the ACK chain.

The server runs :meth:`Reconciler.check` every ``reconcile_interval_s`` and exports the counts of
the last report as ``rudder_reconcile_problems{kind=...}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.audit.records import AuditEntry, AuditRow, AuditStage, Decision
from controlplane.audit.store import AuditStore
from controlplane.eventlog import PolicyLog
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import policy_subject

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    ok: bool = True
    resolved: int = 0
    checked_events: int = 0
    checked_decisions: int = 0
    retired: int = 0
    events_without_decision: list[dict[str, Any]] = field(default_factory=list)
    decisions_without_event: list[dict[str, Any]] = field(default_factory=list)
    duplicate_decisions: list[dict[str, Any]] = field(default_factory=list)
    bad_signatures: list[dict[str, Any]] = field(default_factory=list)
    document_mismatches: list[dict[str, Any]] = field(default_factory=list)
    reused_msg_ids: list[dict[str, Any]] = field(default_factory=list)
    replayed: list[dict[str, Any]] = field(default_factory=list)
    undeterminable: list[dict[str, Any]] = field(default_factory=list)

    PROBLEM_KINDS = ("events_without_decision", "decisions_without_event", "duplicate_decisions",
                     "bad_signatures", "document_mismatches", "reused_msg_ids", "replayed",
                     "undeterminable")

    def problems(self) -> dict[str, int]:
        """Number of findings of each kind (the ``rudder_reconcile_problems`` metric)."""
        return {kind: len(getattr(self, kind)) for kind in self.PROBLEM_KINDS}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Pass:
    """What one ``resolve_pending`` pass reads once and every pending row consults: each
    document's retained history (its oldest revision, and revision by event id) and the accepted
    decisions (with the ones this pass records appended). Read per row, a pass over N pending rows
    of one document walked its history N times (79 s for ~600 ambiguous writes in the reliability
    bench). Pending rows are older than the grace, so their publish attempts are over: the stream
    gains none of their events while the pass runs."""

    histories: dict[tuple[str, PolicyKind], tuple[int | None, dict[str, int]]] = field(default_factory=dict)
    accepted: list[AuditRow] | None = None


class Reconciler:
    def __init__(self, log_: PolicyLog, audit: AuditStore, *, grace_s: float = 5.0) -> None:
        self.log = log_
        self.audit = audit
        self.grace = timedelta(seconds=grace_s)
        self.last_report: ReconcileReport | None = None
        self.last_run_at: datetime | None = None

    async def resolve_pending(self, *, now: datetime | None = None, grace: timedelta | None = None,
                              undeterminable: list[dict[str, Any]] | None = None) -> int:
        """Record the decision of every received-without-decision row older than the grace.

        Rows whose fate the stream and the ACKs cannot tell are left undecided and appended to
        ``undeterminable`` (when given)."""
        now = now or datetime.now(UTC)
        pending = await self.audit.pending_received(older_than=now - (self.grace if grace is None else grace))
        resolved = 0
        seen = _Pass()
        for row in pending:
            if row.event_id is None or row.model is None or row.kind is None:
                continue
            outcome = await self._settle(row, row.model, PolicyKind(row.kind), seen)
            if outcome is None:
                log.error("event_id=%s (%s/%s, expected revision %s): cannot tell whether it was "
                          "published; left undecided", row.event_id, row.model, row.kind,
                          row.expected_revision)
                if undeterminable is not None:
                    undeterminable.append(
                        {"event_id": str(row.event_id), "audit_id": row.id, "model": row.model,
                         "kind": row.kind, "expected_revision": row.expected_revision})
                continue
            decision, code, reason, rev = outcome
            # Once per event: another replica's reconciler (or a manual reconcile) may be settling
            # the same row right now.
            recorded = await self.audit.append_decision_once(AuditEntry(
                event_id=row.event_id, stage=AuditStage.DECISION, decision=decision,
                reason_code=code, reason=reason, actor=row.actor, roles=list(row.roles),
                auth_method=row.auth_method, source_ip=row.source_ip, user_agent=row.user_agent,
                request_id=row.request_id, model=row.model, kind=row.kind, op=row.op,
                expected_revision=row.expected_revision, head_revision=row.head_revision,
                new_revision=rev, changes=row.changes, before=row.before, after=row.after,
                dry_run=row.dry_run, at=datetime.now(UTC),
            ))
            if recorded is None:
                log.info("event_id=%s: decided meanwhile by another reconciler", row.event_id)
                continue
            if seen.accepted is not None and Decision(recorded.decision) is Decision.ACCEPTED \
                    and recorded.new_revision is not None:
                seen.accepted.append(recorded)
            log.info("reconciled event_id=%s decision=%s revision=%s", row.event_id, decision.value, rev)
            resolved += 1
        return resolved

    async def _history(self, seen: _Pass, model: str, kind: PolicyKind) -> tuple[int | None, dict[str, int]]:
        """A document's oldest retained revision and its events' revisions by id, read once per pass."""
        key = (model, kind)
        if key not in seen.histories:
            oldest: int | None = None
            revisions: dict[str, int] = {}
            async for stored in self.log.history(model, kind):
                oldest = stored.revision if oldest is None else oldest
                if stored.msg_id is not None:
                    revisions.setdefault(stored.msg_id, stored.revision)
            seen.histories[key] = (oldest, revisions)
        return seen.histories[key]

    async def _settle(self, row: AuditRow, model: str, kind: PolicyKind,
                      seen: _Pass) -> tuple[Decision, str, str, int | None] | None:
        """The decision for a pending row, or None when it cannot be determined."""
        oldest, revisions = await self._history(seen, model, kind)
        found = revisions.get(str(row.event_id))
        if found is not None:
            return (Decision.ACCEPTED, "reconciled", "event found on the stream by the reconciler", found)
        expected = row.expected_revision
        if (oldest is None and expected == 0) or (oldest is not None and expected is not None
                                                  and oldest <= expected):
            # Every revision after the expected one is retained and none is the event.
            return (Decision.REJECTED, "not_published", "event not on the stream; settled by the reconciler",
                    None)
        acks = await self.audit.acks(event_id=row.event_id, limit=1)
        if acks:
            return (Decision.ACCEPTED, "reconciled_from_acks",
                    f"event no longer retained on the stream; router {acks[0]['router_id']} reported "
                    f"revision {acks[0]['revision']} of it", int(acks[0]["revision"]))
        # Only one write can succeed on a revision: another event accepted on this expected
        # revision of the document means this one's compare-and-set failed.
        if seen.accepted is None:
            seen.accepted = await self.audit.accepted_decisions()
        for other in seen.accepted:
            if (other.model == model and other.kind == kind.value and other.event_id != row.event_id
                    and expected is not None and other.expected_revision == expected):
                return (Decision.REJECTED, "not_published",
                        f"event {other.event_id} was published on expected revision {expected} "
                        f"(as revision {other.new_revision}); settled by the reconciler", None)
        return None

    async def check(self, *, resolve: bool = True) -> ReconcileReport:
        report = ReconcileReport()
        if resolve:
            report.resolved = await self.resolve_pending(undeterminable=report.undeterminable)
        events: dict[str, tuple[int, str]] = {}
        documents: dict[str, dict[str, Any]] = {}
        first_retained: dict[str, int] = {}
        scanned_upto = 0  # the newest revision the scan saw: later writes are checked next time
        payload_ids: dict[int, tuple[str, str]] = {}  # revision -> (payload event id, subject)
        async for stored in self.log.all_events():
            report.checked_events += 1
            if stored.event is not None:
                payload_ids[stored.revision] = (str(stored.event.event_id), stored.subject)
            scanned_upto = max(scanned_upto, stored.revision)
            first_retained.setdefault(stored.subject, stored.revision)
            if stored.signature_error is not None:
                report.bad_signatures.append(
                    {"revision": stored.revision, "subject": stored.subject, "event_id": stored.msg_id,
                     "reason_code": stored.signature_error, "reason": stored.error})
            if stored.msg_id is None:
                report.events_without_decision.append(
                    {"revision": stored.revision, "subject": stored.subject, "event_id": None})
                continue
            if stored.msg_id in events:
                report.reused_msg_ids.append(
                    {"event_id": stored.msg_id, "revisions": [events[stored.msg_id][0], stored.revision],
                     "subject": stored.subject})
                continue
            events[stored.msg_id] = (stored.revision, stored.subject)
            if stored.event is not None:
                documents[stored.msg_id] = dict(stored.event.document)
        accepted: dict[str, list[Any]] = defaultdict(list)
        for row in await self.audit.accepted_decisions():
            report.checked_decisions += 1
            accepted[str(row.event_id)].append(row)
        for msg_id, (revision, subject) in sorted(events.items(), key=lambda kv: kv[1][0]):
            rows = accepted.get(msg_id, [])
            if not rows:
                report.events_without_decision.append(
                    {"revision": revision, "subject": subject, "event_id": msg_id})
                continue
            if len(rows) > 1:
                report.duplicate_decisions.append(
                    {"event_id": msg_id, "audit_ids": [r.id for r in rows]})
            document = documents.get(msg_id)
            after = rows[0].after
            if document is not None and not _same_document(document, after):
                report.document_mismatches.append(
                    {"event_id": msg_id, "revision": revision, "subject": subject, "audit_id": rows[0].id,
                     "document": document, "after": after})
        report.replayed = await self._replays(payload_ids, accepted)
        for event_id, rows in accepted.items():
            if event_id in events:
                continue
            row = rows[0]
            subject = policy_subject(row.model, row.kind)
            if row.new_revision is not None and row.new_revision > scanned_upto:
                continue  # accepted while the stream was being read: not a missing event
            if row.new_revision is not None and row.new_revision < first_retained.get(subject, 0):
                report.retired += 1
                continue
            report.decisions_without_event.append(
                {"event_id": event_id, "audit_id": row.id, "revision": row.new_revision,
                 "model": row.model, "kind": row.kind})
        report.ok = not any(report.problems().values())
        self.last_report, self.last_run_at = report, datetime.now(UTC)
        return report

    async def _replays(self, payload_ids: dict[int, tuple[str, str]],
                       accepted: dict[str, list[Any]]) -> list[dict[str, Any]]:
        """Signed events stored at a revision other than the one they were accepted as (on the
        stream now), and every revision routers NACKed as ``replayed`` (in the ACK chain for good)."""
        found: dict[tuple[str, int], dict[str, Any]] = {}
        for revision, (event_id, subject) in sorted(payload_ids.items()):
            written = [r.new_revision for r in accepted.get(event_id, [])]
            if written and revision not in written:
                found[(subject, revision)] = {"revision": revision, "subject": subject,
                                              "event_id": event_id, "written_as": written[0]}
        for nack in await self.audit.replay_nacks():
            subject = policy_subject(nack["model"], nack["kind"])
            entry = found.setdefault((subject, nack["revision"]),
                                     {"revision": nack["revision"], "subject": subject})
            entry["routers"] = nack["routers"]
            entry["detail"] = nack["detail"]
        return [found[k] for k in sorted(found, key=lambda k: (k[1], k[0]))]

    async def run_periodically(self, interval_s: float) -> None:
        """Background loop owned by the server's lifespan: settle pending records, then check
        the invariants; findings are logged and kept for the metric."""
        while True:
            try:
                report = await self.check()
                if not report.ok:
                    log.error("reconcile found problems: %s",
                              ", ".join(f"{k}={n}" for k, n in report.problems().items() if n))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # audit or NATS down: try again next round
                log.warning("reconciler round failed: %s", exc)
            await asyncio.sleep(interval_s)


def _same_document(document: dict[str, Any], after: Any) -> bool:
    """Equal as numbers (JSONB may render 1.0 as 1)."""
    if not isinstance(after, dict) or set(after) != set(document):
        return False
    return all(isinstance(after[k], int | float) and float(after[k]) == float(v) for k, v in document.items())


