"""The control plane's write path (DESIGN §4): authorize, validate, read the head, check
capabilities, record "received", publish with compare-and-set, record the decision.

Every write's logic is here, none in the HTTP routes. The edge hands over who is asking
(:class:`RequestContext`: the principal, or the authentication error to record) and the body as
read (:class:`Body`: the JSON, or why it could not be read); this module decides, once, whether
the caller may write (answered first, whatever the body), then checks the body against the
write's model (controlplane/protocol/requests.py), and records every refusal.

Fail closed: if the audit store cannot record, nothing is published and the answer is 503.

A head message that is not a valid policy event (written around the control plane), or a valid
signed event that this control plane did not write at that revision (a replay of an old one:
its accepted audit record names another revision, or there is none), is not a head: it does not
jam its document, and nothing is built on it. A write that names it, ``expected_revision`` = that
head's revision, replaces it; its contents are not carried over: ``before`` is the last document
the audit log says the control plane wrote (the newest accepted decision's ``after``), so one
intruder never drops the other overrides. The decision is recorded with ``reason_code``
``replaced_malformed_head`` (``replaced_unaudited_head`` for a replayed or unaudited signed event)
and the head's error as ``reason``, and the publish is compare-and-set against that revision like
any other. A write that does not name
the revision (the compatible threshold API without ``expected_revision``) is refused with 409.
Every rejection of steps 1-4, and a 409 at publish, is itself recorded. A publish whose outcome is
unknown leaves its "received" row without a decision; the reconciler settles it from the stream.
A decision that cannot be recorded after a successful publish answers 503 ``decision_unrecorded``
with the new revision (the change is live), never ``audit_unavailable`` (nothing published).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from controlplane.audit.records import AuditEntry, AuditStage, Decision
from controlplane.audit.store import AuditStore
from controlplane.auth import Action, Principal
from controlplane.eventlog import PolicyLog
from controlplane.failpoints import Failpoints
from controlplane.fleet import FleetView
from controlplane.protocol.errors import (
    AuditUnavailable,
    CapabilityMismatch,
    DecisionUnrecorded,
    Forbidden,
    LogAmbiguous,
    LogUnavailable,
    NotFound,
    RevisionConflict,
    RudderError,
)
from controlplane.protocol.events import PolicyEvent
from controlplane.protocol.policy import (
    THRESHOLD_PARAMETERS,
    Document,
    PolicyKind,
    PolicyOp,
    apply_patch,
    diff_documents,
    merge_thresholds,
)
from controlplane.protocol.requests import (
    CalibrationReset,
    PolicyPatch,
    PolicyRollback,
    ThresholdsUpdate,
    WriteRequest,
    check_model,
    parse,
)
from controlplane.telemetry import traces

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RequestContext:
    """Who is asking, decided at the HTTP edge (the auth outcome is passed in, not raised there,
    so that a refused write is audited here like every other rejection)."""

    request_id: str
    principal: Principal | None = None
    auth_error: RudderError | None = None
    auth_method: str | None = "bearer"
    source_ip: str | None = None
    user_agent: str | None = None

    @property
    def actor(self) -> str | None:
        return self.principal.name if self.principal else None

    @property
    def roles(self) -> list[str]:
        return [self.principal.role.value] if self.principal else []

    def authorize(self, action: Action) -> Principal:
        """The principal, if it may ``action``. Raises the authentication error decided at the edge
        (401), or Forbidden (403)."""
        if self.auth_error is not None:
            raise self.auth_error
        if self.principal is None or not self.principal.can(action):
            role = self.principal.role.value if self.principal else "none"
            raise Forbidden(f"role {role} may not {action.value}", required=action.value)
        return self.principal


@dataclass(frozen=True, kw_only=True)
class Body:
    """A write's body as the edge read it: its decoded JSON, or why it could not be read
    (``error``: 415, 413, not JSON). Nothing in it is checked yet: the write path first decides
    whether the caller may write, then checks the body against the write's model, and records
    every refusal."""

    json: Any = None
    error: RudderError | None = None

    def field(self, name: str) -> Any:
        """The raw value of a top-level field (``None`` if absent, or if the body is no object)."""
        return self.json.get(name) if isinstance(self.json, Mapping) else None


@dataclass(kw_only=True)
class Attempt:
    """What is known of a write attempt so far; filled in as the steps pass."""

    event_id: uuid.UUID = field(default_factory=uuid.uuid4)
    op: PolicyOp | None = None
    model: str | None = None
    kind: PolicyKind | None = None
    expected_revision: int | None = None
    head_revision: int | None = None
    changes: dict[str, Any] | None = None
    before: Document | None = None
    after: Document | None = None
    rollback_to: int | None = None
    dry_run: bool = False
    # Set when the head it replaces is malformed: that head's decode error.
    replaces_malformed: str | None = None

    def note(self, name: str, value: Any) -> None:
        """A request field that passed its check: a refusal after it is recorded with it."""
        if name in _NOTED:
            setattr(self, name, value)


#: The request fields an attempt records as soon as they are checked.
_NOTED = frozenset({"model", "kind", "expected_revision", "dry_run"})


@dataclass(frozen=True, kw_only=True)
class WriteResult:
    model: str
    kind: PolicyKind
    op: PolicyOp
    revision: int
    previous_revision: int
    before: Document
    document: Document
    changes: dict[str, Any]
    event_id: uuid.UUID | None
    dry_run: bool
    changed: bool = True
    recovered: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "kind": self.kind.value, "op": self.op.value,
            "revision": self.revision, "previous_revision": self.previous_revision,
            "document": self.document, "changes": self.changes,
            "diff": diff_documents(self.before, self.document),
            "event_id": str(self.event_id) if self.event_id else None,
            "dry_run": self.dry_run, "changed": self.changed,
        }


# ---------------------------------------------------------------------------------------------
# Steps (pure)


def _require_head(a: Attempt) -> None:
    """Compare-and-set, checked early: a stale ``expected_revision`` is a 409 before anything is
    recorded as received (the publish checks it again, atomically)."""
    assert a.expected_revision is not None and a.head_revision is not None
    if a.expected_revision != a.head_revision:
        raise RevisionConflict(
            f"expected revision {a.expected_revision} but the head is {a.head_revision}",
            expected_revision=a.expected_revision, head_revision=a.head_revision,
        )


def _hint(a: Attempt, body: Any) -> None:
    """Note which document an attempt targets before anything is checked, so that even a refused
    attempt (401, 403, a bad field) is recorded against its model and kind."""
    if not isinstance(body, Mapping):
        return
    if isinstance(body.get("model"), str):
        a.model = body["model"][:512]
    if a.kind is None and body.get("kind", "selection") in (k.value for k in PolicyKind):
        a.kind = PolicyKind(body.get("kind", "selection"))


THRESHOLD_FIELDS = tuple(THRESHOLD_PARAMETERS)


def asks_nothing(body: Body) -> bool:
    """A threshold body that names no threshold and nothing to unset: the compatible API's read.
    One that names a field the write does not have (a threshold's name misspelt) is not: the
    write refuses it naming the field, where a read would answer 200 and change nothing."""
    return (isinstance(body.json, Mapping) and all(body.field(k) is None for k in THRESHOLD_FIELDS)
            and not body.field("unset") and all(key in ThresholdsUpdate.model_fields for key in body.json))


def _threshold_changes(parameters: Mapping[str, Any], unset: list[str]) -> dict[str, Any]:
    """What a threshold write records as its changes: the values it sets, None for each unset."""
    changes = {k: v for k, v in parameters.items() if v is not None}
    changes.update({name: None for name in unset})
    return changes


def _threshold_notes(a: Attempt) -> Callable[[str, Any], None]:
    """Note a threshold body's fields as they pass; once ``create`` has (every field but the
    expected revision), the attempt's changes are known and recorded with a later refusal."""
    seen: dict[str, Any] = {}

    def note(name: str, value: Any) -> None:
        a.note(name, value)
        seen[name] = value
        if name == "create":
            a.changes = _threshold_changes({k: seen[k] for k in THRESHOLD_FIELDS}, seen["unset"])

    return note


R = TypeVar("R", bound=WriteRequest)
T = TypeVar("T")


class WritePath:
    def __init__(
        self, log_: PolicyLog, audit: AuditStore, fleet: FleetView, *,
        busy_threshold_retries: int = 20, failpoints: Failpoints | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.log = log_
        self.audit = audit
        self.fleet = fleet
        self.retries = busy_threshold_retries
        self.failpoints = failpoints or Failpoints()
        self.clock = clock
        # Per document, the last head known audited: (revision, event id) of an event whose
        # accepted decision names that revision (written here, or looked up once). An audit
        # record is never changed, so what was verified stays true: a write on an unchanged head
        # needs no audit query (a head another replica wrote is looked up once).
        self._audited: dict[tuple[str, PolicyKind], tuple[int, uuid.UUID]] = {}

    # ---- audit records -------------------------------------------------------------------

    def _entry(self, ctx: RequestContext, a: Attempt, *, stage: AuditStage, decision: Decision,
               reason_code: str | None = None, reason: str | None = None,
               new_revision: int | None = None) -> AuditEntry:
        return AuditEntry(
            event_id=a.event_id, stage=stage, decision=decision, reason_code=reason_code,
            reason=reason, actor=ctx.actor, roles=ctx.roles, auth_method=ctx.auth_method,
            source_ip=ctx.source_ip, user_agent=ctx.user_agent, request_id=ctx.request_id,
            model=a.model, kind=a.kind.value if a.kind else None, op=a.op.value if a.op else None,
            expected_revision=a.expected_revision, head_revision=a.head_revision,
            new_revision=new_revision, changes=a.changes, before=a.before, after=a.after,
            dry_run=a.dry_run, at=self.clock(),
        )

    async def record_rejection(self, ctx: RequestContext, a: Attempt, error: RudderError) -> None:
        """Record a refused attempt. If that fails, the caller gets 503 instead of ``error``."""
        with traces.step("decision", **{"rudder.decision": "rejected", "rudder.reason_code": error.code}):
            await self.audit.append(self._entry(
                ctx, a, stage=AuditStage.DECISION, decision=Decision.REJECTED,
                reason_code=error.code, reason=error.message,
            ))
        log.info("rejected request_id=%s model=%s kind=%s code=%s: %s", ctx.request_id, a.model,
                 a.kind, error.code, error.message)

    async def refusal(self, ctx: RequestContext, a: Attempt, error: RudderError) -> RudderError:
        """Record ``error`` as a refusal; return what to raise (503 if it could not be recorded)."""
        try:
            await self.record_rejection(ctx, a, error)
        except AuditUnavailable as exc:
            return exc
        return error

    async def _refused(self, ctx: RequestContext, a: Attempt, step: Callable[[], Awaitable[T]]) -> T:
        """Run steps 1-4: a refusal is recorded, and raised (503 instead if it could not be)."""
        try:
            return await step()
        except AuditUnavailable:
            raise
        except RudderError as exc:
            raise await self.refusal(ctx, a, exc) from exc

    @staticmethod
    def _admit(ctx: RequestContext, a: Attempt, body: Body, request: type[R],
               note: Callable[[str, Any], None] | None = None) -> R:
        """Steps 1-2: whether the caller may write (answered first, whatever the body), then the
        body, checked against the write's model; every field that passes is noted in ``a``
        (by ``note``, if given)."""
        with traces.step("validate"):
            _hint(a, body.json)
            ctx.authorize(Action.WRITE_POLICY)
            if body.error is not None:
                raise body.error
            return parse(request, body.json, note=note or a.note)

    # ---- the commit (steps 5-7) ----------------------------------------------------------

    async def _commit(self, ctx: RequestContext, a: Attempt, event: PolicyEvent) -> tuple[int, bool]:
        with traces.step("audit received", **{"rudder.event_id": str(a.event_id)}):
            await self.audit.append(self._entry(ctx, a, stage=AuditStage.RECEIVED, decision=Decision.PENDING))
        self.failpoints.hit("after_received")
        try:
            with traces.step("publish", **{"rudder.expected_revision": a.expected_revision}) as span:
                result = await self.log.publish(event)  # the bus message carries this span's traceparent
                if span is not None:
                    span.set_attribute("rudder.revision", result.revision)
        except RevisionConflict as exc:
            a.head_revision = exc.head_revision
            await self.record_rejection(ctx, a, exc)
            raise
        except LogAmbiguous as exc:
            log.warning("publish outcome unknown event_id=%s; left to the reconciler", a.event_id)
            exc.facts.setdefault("event_id", str(a.event_id))  # the client may look it up later
            raise
        except LogUnavailable as exc:
            await self.record_rejection(ctx, a, exc)
            raise
        self.failpoints.hit("after_publish")
        self.failpoints.hit("before_decision")
        code = "recovered" if result.recovered else None
        reason = None
        if a.replaces_malformed is not None:
            replay = a.replaces_malformed.startswith(("replayed", "not_audited"))
            code = code or ("replaced_unaudited_head" if replay else "replaced_malformed_head")
            reason = (f"replaced malformed head revision {a.head_revision}: "
                      f"{a.replaces_malformed}")[:2000]
        try:
            with traces.step("decision", **{"rudder.decision": "accepted", "rudder.revision": result.revision}):
                await self.audit.append(self._entry(
                    ctx, a, stage=AuditStage.DECISION, decision=Decision.ACCEPTED,
                    reason_code=code, reason=reason, new_revision=result.revision,
                ))
        except AuditUnavailable as exc:
            log.error("published event_id=%s as revision %d of %s/%s but its decision could not be "
                      "recorded; left to the reconciler", a.event_id, result.revision, a.model, a.kind)
            raise DecisionUnrecorded(
                f"published as revision {result.revision}, but its decision could not be recorded "
                "(the change is live; the reconciler will record it)", retry_after=exc.retry_after,
                new_revision=result.revision, event_id=str(a.event_id)) from exc
        assert a.model is not None and a.kind is not None
        self._audited[(a.model, a.kind)] = (result.revision, a.event_id)
        log.info("accepted request_id=%s event_id=%s model=%s kind=%s revision=%d actor=%s",
                 ctx.request_id, a.event_id, a.model, a.kind, result.revision, ctx.actor,
                 extra={"revision": result.revision, "model": a.model})
        return result.revision, result.recovered

    def _event(self, ctx: RequestContext, a: Attempt) -> PolicyEvent:
        assert a.model is not None and a.kind is not None and a.op is not None
        assert a.expected_revision is not None and a.after is not None
        return PolicyEvent(
            event_id=a.event_id, model=a.model, kind=a.kind, op=a.op,
            expected_revision=a.expected_revision, changes=a.changes or {}, document=a.after,
            actor=ctx.actor or "unknown", request_id=ctx.request_id, at=self.clock(),
            rollback_to=a.rollback_to,
        )

    async def _head(self, a: Attempt) -> Document:
        """The document a write builds on: the head's, when the head is an event this control
        plane wrote (its accepted audit record names that revision). A head that is not (a
        malformed or unsigned message, or a replay of an old signed event) is an intruder: a write
        must name its revision to replace it, and then builds on the last audited document."""
        assert a.model is not None and a.kind is not None
        with traces.step("head", **{"rudder.model": a.model, "rudder.kind": a.kind.value}) as span:
            head = await self.log.head(a.model, a.kind, at_least=a.expected_revision or 0)
            if span is not None:
                span.set_attribute("rudder.head_revision", head.revision if head else 0)
        a.head_revision = head.revision if head else 0
        if head is None:
            return {}
        key = (a.model, a.kind)
        if head.event is None:
            intruder: str | None = head.error or "not a valid policy event"
        elif self._audited.get(key) == (head.revision, head.event.event_id):
            intruder = None
        else:
            intruder = await self._unaudited(key, head.revision, head.event)
        if intruder is None:
            assert head.event is not None
            return dict(head.event.document)
        # Never build on it; a write naming its revision replaces it (CAS-checked and audited).
        if a.expected_revision == head.revision:
            a.replaces_malformed = intruder
            log.warning("model=%s kind=%s: replacing head revision %d (%s)",
                        a.model, a.kind.value, head.revision, intruder)
            last = await self.audit.last_accepted(a.model, a.kind.value)
            return dict(last.after or {}) if last is not None else {}
        raise RevisionConflict(
            f"head revision {head.revision} of {a.model}/{a.kind.value} is not a valid policy "
            f"event ({intruder}); replace it with a write whose expected_revision is "
            f"{head.revision}", expected_revision=a.expected_revision, head_revision=head.revision,
            malformed_head=True,
        )

    async def _unaudited(self, key: tuple[str, PolicyKind], revision: int, event: PolicyEvent) -> str | None:
        """Why a signed head at ``revision`` is not one this control plane wrote there, or None.

        Its event is ours at that revision when its accepted decision names the revision, or when
        its publish is not decided yet (a "received" row and no decision: an ambiguous publish
        the reconciler settles, or another replica's write in flight). An event accepted at
        another revision is a replay of it; one without any record was never written by us."""
        rows = await self.audit.rows_for_event(event.event_id)
        accepted = [r.new_revision for r in rows
                    if r.stage is AuditStage.DECISION and r.decision is Decision.ACCEPTED
                    and r.new_revision is not None]
        if revision in accepted:
            self._audited[key] = (revision, event.event_id)
            return None
        if accepted:
            return (f"replayed: event {event.event_id} was written as revision "
                    f"{accepted[0]}, not {revision}")
        if any(r.stage is AuditStage.RECEIVED for r in rows) and not any(
                r.stage is AuditStage.DECISION for r in rows):
            return None
        return f"not_audited: event {event.event_id} has no accepted audit record"

    def _check_capabilities(self, a: Attempt) -> None:
        assert a.model is not None and a.kind is not None and a.after is not None
        violations = self.fleet.capability_violations(a.model, a.kind, a.after)
        if violations:
            weights = sorted({w for ws in violations.values() for w in ws})
            routers = sorted(violations)
            raise CapabilityMismatch(
                f"{', '.join(weights)} cannot be nonzero: live router(s) {', '.join(routers)} serving "
                f"{a.model} lack the cache input", field=f"parameters.{weights[0]}",
                weights=weights, routers=routers,
            )

    async def _run(self, ctx: RequestContext, a: Attempt, prepare: Callable[[], Awaitable[None]]) -> WriteResult:
        """Steps 1-4 in ``prepare`` (audited on rejection), then dry-run or commit."""
        await self._refused(ctx, a, prepare)
        assert a.model is not None and a.kind is not None and a.op is not None and a.after is not None
        assert a.before is not None and a.head_revision is not None
        result = WriteResult(
            model=a.model, kind=a.kind, op=a.op, revision=a.head_revision,
            previous_revision=a.head_revision, before=a.before, document=a.after,
            changes=a.changes or {}, event_id=a.event_id, dry_run=a.dry_run,
        )
        if a.dry_run:
            await self.audit.append(self._entry(ctx, a, stage=AuditStage.DECISION, decision=Decision.ACCEPTED,
                                                reason_code="dry_run"))
            return result
        revision, recovered = await self._commit(ctx, a, self._event(ctx, a))
        return replace(result, revision=revision, recovered=recovered)

    # ---- operations ----------------------------------------------------------------------

    @staticmethod
    def _target(a: Attempt, request: PolicyPatch | PolicyRollback) -> None:
        """Which document, at which revision (set from the checked request)."""
        a.model, a.kind = request.model, request.kind
        a.expected_revision, a.dry_run = request.expected_revision, request.dry_run

    async def _patch(self, a: Attempt, request: PolicyPatch) -> None:
        """Steps 3-4 of a patch: the head, compare-and-set, the new document, capabilities."""
        self._target(a, request)
        if request.reset:
            a.op = PolicyOp.RESET
        a.changes = dict(request.parameters or {})
        a.before = await self._head(a)
        _require_head(a)
        if request.reset:
            a.changes = {name: None for name in a.before}
        a.after = {} if request.reset else apply_patch(a.before, a.changes)
        self._check_capabilities(a)

    async def patch(self, ctx: RequestContext, body: Body) -> WriteResult:
        """PATCH /router_policy: set or remove overrides, or reset the document."""
        a = Attempt(op=PolicyOp.PATCH)

        async def prepare() -> None:
            await self._patch(a, self._admit(ctx, a, body, PolicyPatch))

        return await self._run(ctx, a, prepare)

    async def reset_calibration(self, ctx: RequestContext, body: Body, *, attempts: int = 3) -> WriteResult:
        """Reset every router's timing fit of a model: a patch of the selection document's
        ``calibration_epoch`` to the head's + 1, checked, revisioned and recorded like any other
        patch; read again and retried (``attempts`` in all) when another write gets in between."""
        for attempt in range(1, attempts + 1):
            a = Attempt(op=PolicyOp.PATCH, kind=PolicyKind.SELECTION)

            async def prepare(a: Attempt = a) -> None:
                model = self._admit(ctx, a, body, CalibrationReset).model
                head = await self.log.head(model, PolicyKind.SELECTION)
                document = dict(head.event.document) if head and head.event else {}
                epoch = int(document.get("calibration_epoch", 0)) + 1
                await self._patch(a, parse(PolicyPatch, {
                    "model": model, "kind": PolicyKind.SELECTION.value,
                    "expected_revision": head.revision if head else 0,
                    "parameters": {"calibration_epoch": epoch},
                }))

            try:
                return await self._run(ctx, a, prepare)
            except RevisionConflict:
                if attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    async def rollback(self, ctx: RequestContext, body: Body) -> WriteResult:
        """POST /router_policy/rollback: an older revision's document as a new forward revision."""
        a = Attempt(op=PolicyOp.ROLLBACK)

        async def prepare() -> None:
            request = self._admit(ctx, a, body, PolicyRollback)
            self._target(a, request)
            model, kind, target_rev = request.model, request.kind, request.to_revision
            if target_rev == 0:
                target_doc: Document = {}
            else:
                target_doc = await self._revision_document(model, kind, target_rev)
            a.before = await self._head(a)
            _require_head(a)
            a.after = dict(sorted(target_doc.items()))
            a.changes = {k: v["after"] for k, v in diff_documents(a.before, a.after).items()}
            a.rollback_to = target_rev
            self._check_capabilities(a)

        return await self._run(ctx, a, prepare)

    async def _revision_document(self, model: str, kind: PolicyKind, revision: int) -> Document:
        """The document of an older revision: from the audit log (the accepted decision that wrote
        it), so any revision the control plane ever wrote can be rolled back to, not only the
        stream's retained history; else from the stream. Raises NotFound."""
        row = await self.audit.accepted_at(model, kind.value, revision)
        if row is not None and isinstance(row.after, Mapping):
            return dict(row.after)
        target = await self.log.get(model, kind, revision)
        if target is None or target.event is None:
            raise NotFound(
                f"revision {revision} is neither in the audit log nor in the retained history of "
                f"{model}/{kind.value}", field="to_revision",
            )
        return dict(target.event.document)

    async def set_thresholds(self, ctx: RequestContext, body: Body) -> WriteResult | None:
        """Compatible busy-threshold write. Returns None when the body asks for nothing (a read).

        Without ``expected_revision`` it reads the head, merges, and publishes with CAS, retrying
        on conflict, so concurrent partial updates never lose each other.
        """
        if asks_nothing(body) and ctx.auth_error is None:
            # All null: the compatible API treats it as a read; one that names no usable model is
            # refused, and recorded like a write's refusal (it came to a write route).
            try:
                check_model(body.field("model"), "model")
            except RudderError as exc:
                a = Attempt(op=PolicyOp.PATCH, kind=PolicyKind.BUSY_THRESHOLD)
                _hint(a, body.json)
                raise await self.refusal(ctx, a, exc) from exc
            return None
        # (An unauthenticated caller is refused here as a write, so its refusal is recorded: the
        # edge counted it as audited. Found by the admin API fuzzer.)
        explicit = body.field("expected_revision") is not None
        conflicts = 0
        while True:
            a = Attempt(op=PolicyOp.PATCH, kind=PolicyKind.BUSY_THRESHOLD)

            async def prepare(a: Attempt = a) -> None:
                request = self._admit(ctx, a, body, ThresholdsUpdate, note=_threshold_notes(a))
                model = request.model
                parameters = {k: getattr(request, k) for k in THRESHOLD_FIELDS if k in request.model_fields_set}
                a.changes = _threshold_changes(parameters, request.unset)
                a.before = await self._head(a)
                if a.head_revision == 0 and not request.create and not self.fleet.serves(model):
                    raise NotFound(f"model {model!r} is not served by any live worker or router and "
                                   "has no policy; pass create: true to create it", field="model")
                if request.expected_revision is None:
                    a.expected_revision = a.head_revision
                _require_head(a)
                a.after = merge_thresholds(a.before, parameters, request.unset)

            try:
                return await self._run_thresholds(ctx, a, prepare)
            except RevisionConflict as exc:
                conflicts += 1
                if explicit or conflicts >= self.retries or exc.facts.get("malformed_head"):
                    raise
                await asyncio.sleep(random.uniform(0, 0.005 * min(conflicts, 10)))

    async def _run_thresholds(self, ctx: RequestContext, a: Attempt,
                              prepare: Callable[[], Awaitable[None]]) -> WriteResult:
        """Like ``_run``, but a merge that changes nothing publishes nothing (recorded as
        accepted with reason ``unchanged`` and no revision, so reconcile expects no event)."""
        await self._refused(ctx, a, prepare)
        unchanged = a.after == a.before
        assert a.model is not None and a.kind is not None and a.op is not None
        assert a.after is not None and a.before is not None and a.head_revision is not None
        if unchanged and not a.dry_run:
            await self.audit.append(self._entry(ctx, a, stage=AuditStage.DECISION,
                                                decision=Decision.ACCEPTED, reason_code="unchanged"))
            return WriteResult(model=a.model, kind=a.kind, op=a.op, revision=a.head_revision,
                               previous_revision=a.head_revision, before=a.before, document=a.after,
                               changes=a.changes or {}, event_id=None, dry_run=False, changed=False)

        async def already_prepared() -> None:
            return None

        return await self._run(ctx, a, already_prepared)
