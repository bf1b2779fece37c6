"""Stream ↔ audit reconciliation (DESIGN §4 step 8).

``resolve_pending`` settles every "received" record that has no decision (a crash or an
ambiguous publish between steps 5 and 7) by looking its ``event_id`` up on the stream.
``check`` verifies the invariant in both directions: every event in ``RUDDER_POLICY`` has exactly
one accepted decision, and every accepted decision has its event. Decisions whose event was
dropped by the stream's per-document history limit are counted as ``retired``, not missing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.audit.records import AuditEntry, AuditStage, Decision
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Reconciler:
    def __init__(self, log_: PolicyLog, audit: AuditStore, *, grace_s: float = 5.0) -> None:
        self.log = log_
        self.audit = audit
        self.grace = timedelta(seconds=grace_s)

    async def resolve_pending(self, *, now: datetime | None = None, grace: timedelta | None = None) -> int:
        """Record the decision of every received-without-decision row older than the grace."""
        now = now or datetime.now(UTC)
        pending = await self.audit.pending_received(older_than=now - (self.grace if grace is None else grace))
        resolved = 0
        for row in pending:
            if row.event_id is None or row.model is None or row.kind is None:
                continue
            found = await self.log.find(row.model, PolicyKind(row.kind), row.event_id)
            if found is not None:
                decision, code, reason, rev = (Decision.ACCEPTED, "reconciled",
                                               "event found on the stream by the reconciler", found.revision)
            else:
                decision, code, reason, rev = (Decision.REJECTED, "not_published",
                                               "event not on the stream; settled by the reconciler", None)
            await self.audit.append(AuditEntry(
                event_id=row.event_id, stage=AuditStage.DECISION, decision=decision,
                reason_code=code, reason=reason, actor=row.actor, roles=list(row.roles),
                auth_method=row.auth_method, source_ip=row.source_ip, user_agent=row.user_agent,
                request_id=row.request_id, model=row.model, kind=row.kind, op=row.op,
                expected_revision=row.expected_revision, head_revision=row.head_revision,
                new_revision=rev, changes=row.changes, before=row.before, after=row.after,
                dry_run=row.dry_run, at=datetime.now(UTC),
            ))
            log.info("reconciled event_id=%s decision=%s revision=%s", row.event_id, decision.value, rev)
            resolved += 1
        return resolved

    async def check(self, *, resolve: bool = True) -> ReconcileReport:
        report = ReconcileReport()
        if resolve:
            report.resolved = await self.resolve_pending()
        events: dict[str, tuple[int, str]] = {}
        first_retained: dict[str, int] = {}
        async for stored in self.log.all_events():
            report.checked_events += 1
            first_retained.setdefault(stored.subject, stored.revision)
            if stored.msg_id is None:
                report.events_without_decision.append(
                    {"revision": stored.revision, "subject": stored.subject, "event_id": None})
                continue
            events[stored.msg_id] = (stored.revision, stored.subject)
        accepted: dict[str, list[Any]] = defaultdict(list)
        for row in await self.audit.accepted_decisions():
            report.checked_decisions += 1
            accepted[str(row.event_id)].append(row)
        for msg_id, (revision, subject) in sorted(events.items(), key=lambda kv: kv[1][0]):
            rows = accepted.get(msg_id, [])
            if not rows:
                report.events_without_decision.append(
                    {"revision": revision, "subject": subject, "event_id": msg_id})
            elif len(rows) > 1:
                report.duplicate_decisions.append(
                    {"event_id": msg_id, "audit_ids": [r.id for r in rows]})
        for event_id, rows in accepted.items():
            if event_id in events:
                continue
            row = rows[0]
            subject = policy_subject(row.model, row.kind)
            if row.new_revision is not None and row.new_revision < first_retained.get(subject, 0):
                report.retired += 1
                continue
            report.decisions_without_event.append(
                {"event_id": event_id, "audit_id": row.id, "revision": row.new_revision,
                 "model": row.model, "kind": row.kind})
        report.ok = not (report.events_without_decision or report.decisions_without_event
                         or report.duplicate_decisions)
        return report

    async def run_periodically(self, interval_s: float) -> None:
        """Background loop owned by the server's lifespan."""
        while True:
            try:
                await self.resolve_pending()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # audit or NATS down: try again next round
                log.warning("reconciler round failed: %s", exc)
            await asyncio.sleep(interval_s)


