"""Policy as code: the policy file, its JSON Schema, and the plan that brings the live state to
it. Pure (no I/O): the CLI reads the files and the heads, this module decides.

A policy file (YAML or JSON; a folder of them is one set)::

    apiVersion: rudder/v1
    kind: PolicySet
    models:
      meta-llama/Llama-3.1-8B-Instruct:
        selection: {overlap_score_credit: 0.5, router_temperature: 0.1}
        busy_threshold: {active_decode_blocks_threshold: 0.8}

Every (model, kind) the file names is a document it *manages*: after an apply, the document's
overrides are exactly the ones listed (``{}``: none). A document the file does not name is left
alone (a file is not a claim over the whole fleet, so two teams can keep two files).

The plan compares each managed document with its head: ``create`` (no document yet), ``update``
(overrides differ; the patch sets what is new and removes, with ``null``, what the file dropped),
or ``no_change``. Each step carries the head revision it was computed against; the apply writes
with compare-and-set on it, after checking that no head moved (:func:`moved`).

Raises ``ValidationFailed`` (the file's shape, a parameter, a document named twice), with
``field`` naming the place (``models.<model>.<kind>.<parameter>``) and ``source`` the file.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.protocol.errors import RudderError, ValidationFailed
from controlplane.protocol.policy import PARAMETERS, Document, Number, PolicyKind, diff_documents, validate_document

API_VERSION = "rudder/v1"
FILE_KIND = "PolicySet"
REVISIONS_KIND = "PolicyRevisions"


@dataclass(frozen=True, order=True, slots=True)
class DocumentKey:
    model: str
    kind: PolicyKind

    def __str__(self) -> str:
        return f"{self.model} {self.kind.value}"


@dataclass(frozen=True, slots=True)
class Desired:
    """A managed document: its overrides as the file states them, and which file said so."""

    key: DocumentKey
    document: Document
    source: str


PolicySet = dict[DocumentKey, Desired]


def _fail(message: str, *, source: str, where: str) -> ValidationFailed:
    return ValidationFailed(f"{source}: {message}", field=where, source=source)


def parse_policy_set(data: Any, *, source: str) -> PolicySet:
    """One file's documents, validated (parameter names, types and ranges of each kind)."""
    if not isinstance(data, Mapping):
        raise _fail(f"a policy file is a mapping with apiVersion: {API_VERSION}, kind: {FILE_KIND}"
                    " and models", source=source, where="$")
    unknown = sorted(set(data) - {"apiVersion", "kind", "models"})
    if unknown:
        raise _fail(f"unknown top-level field {unknown[0]!r}", source=source, where=str(unknown[0]))
    if data.get("apiVersion") != API_VERSION:
        raise _fail(f"apiVersion must be {API_VERSION!r}, got {data.get('apiVersion')!r}",
                    source=source, where="apiVersion")
    if data.get("kind") != FILE_KIND:
        raise _fail(f"kind must be {FILE_KIND!r}, got {data.get('kind')!r}", source=source, where="kind")
    models = data.get("models")
    if models is None:
        models = {}
    if not isinstance(models, Mapping):
        raise _fail("models must be a mapping of model name to documents", source=source, where="models")
    out: PolicySet = {}
    for model, docs in models.items():
        where = f"models.{model}"
        if not isinstance(model, str) or not model.strip():
            raise _fail("a model name must be a non-empty string", source=source, where="models")
        if not isinstance(docs, Mapping):
            raise _fail(f"{where} must map a kind (selection, busy_threshold) to overrides",
                        source=source, where=where)
        for kind_name, document in docs.items():
            try:
                kind = PolicyKind(kind_name)
            except ValueError:
                allowed = ", ".join(k.value for k in PolicyKind)
                raise _fail(f"{where}: unknown kind {kind_name!r} (one of {allowed})",
                            source=source, where=f"{where}.{kind_name}") from None
            prefix = f"{where}.{kind.value}"
            try:
                checked = validate_document(kind, {} if document is None else document, prefix=prefix)
            except RudderError as exc:
                raise _fail(exc.message, source=source, where=exc.field or prefix) from None
            key = DocumentKey(model, kind)
            out[key] = Desired(key, dict(sorted(checked.items())), source)
    return out


def merge_sets(parts: Iterable[PolicySet]) -> PolicySet:
    """The files of a folder as one set; a document named by two files is an error naming both."""
    out: PolicySet = {}
    for part in parts:
        for key, desired in part.items():
            if key in out:
                raise ValidationFailed(
                    f"{key} is in both {out[key].source} and {desired.source}",
                    field=f"models.{key.model}.{key.kind.value}", source=desired.source)
            out[key] = desired
    return dict(sorted(out.items()))


class StepAction(enum.StrEnum):
    CREATE = "create"
    UPDATE = "update"
    NO_CHANGE = "no_change"


@dataclass(frozen=True, slots=True)
class Live:
    """A document's head as read from the admin API (revision 0: no document yet)."""

    revision: int
    document: Document = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlanStep:
    key: DocumentKey
    revision: int
    before: Document
    after: Document
    diff: dict[str, Any]
    source: str

    @property
    def action(self) -> StepAction:
        if not self.diff:
            return StepAction.NO_CHANGE
        return StepAction.CREATE if self.revision == 0 else StepAction.UPDATE

    @property
    def changes(self) -> dict[str, Number | None]:
        """The patch's parameters: what the file sets, and ``None`` for what it dropped."""
        return {name: change["after"] for name, change in self.diff.items()}

    def patch_body(self) -> dict[str, Any] | None:
        """The PATCH /router_policy body of this step (compare-and-set on the planned head), or
        None when there is nothing to write. A document emptied by the file is a reset."""
        if self.action is StepAction.NO_CHANGE:
            return None
        body: dict[str, Any] = {"model": self.key.model, "kind": self.key.kind.value,
                                "expected_revision": self.revision}
        if self.after:
            body["parameters"] = self.changes
        else:
            body["reset"] = True
        return body

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.key.model, "kind": self.key.kind.value, "action": self.action.value,
                "revision": self.revision, "before": self.before, "after": self.after,
                "diff": self.diff, "source": self.source}


def plan(desired: PolicySet, live: Mapping[DocumentKey, Live]) -> list[PlanStep]:
    """One step per managed document, in (model, kind) order."""
    steps = []
    for key, want in sorted(desired.items()):
        head = live.get(key, Live(0))
        steps.append(PlanStep(key, head.revision, dict(head.document), dict(want.document),
                              diff_documents(head.document, want.document), want.source))
    return steps


def drifted(steps: Iterable[PlanStep]) -> list[PlanStep]:
    """The steps whose live document differs from the file (what ``policy diff`` reports)."""
    return [s for s in steps if s.action is not StepAction.NO_CHANGE]


def moved(expected: Mapping[DocumentKey, int], heads: Mapping[DocumentKey, int]) -> list[dict[str, Any]]:
    """The documents whose head is no longer the revision the plan was shown against."""
    return [{"model": k.model, "kind": k.kind.value, "expected_revision": rev,
             "head_revision": heads.get(k, 0)}
            for k, rev in sorted(expected.items()) if heads.get(k, 0) != rev]


def export(live: Mapping[DocumentKey, Live]) -> dict[str, Any]:
    """The live state as a policy file: every document that exists (revision > 0)."""
    models: dict[str, dict[str, Document]] = {}
    for key, head in sorted(live.items()):
        if head.revision > 0:
            models.setdefault(key.model, {})[key.kind.value] = dict(sorted(head.document.items()))
    return {"apiVersion": API_VERSION, "kind": FILE_KIND, "models": models}


# ---- the revision file: the heads a plan was shown against -----------------------------------


def desired_digest(steps: Iterable[PlanStep]) -> str:
    """What the file asks for (every managed document's overrides), as a SHA-256: a revision
    file records it, so an apply of a file edited since its dry run is refused too."""
    canonical = [[s.key.model, s.key.kind.value, s.after] for s in sorted(steps, key=lambda s: s.key)]
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class RevisionFile:
    """The heads a dry run's plan was computed against, and the digest of what the file asked."""

    revisions: dict[DocumentKey, int]
    digest: str


def revision_file(steps: Iterable[PlanStep]) -> dict[str, Any]:
    steps = list(steps)
    return {"apiVersion": API_VERSION, "kind": REVISIONS_KIND, "digest": desired_digest(steps), "documents": [
        {"model": s.key.model, "kind": s.key.kind.value, "revision": s.revision} for s in steps]}


def parse_revision_file(data: Any, *, source: str) -> RevisionFile:
    if not (isinstance(data, Mapping) and data.get("apiVersion") == API_VERSION
            and data.get("kind") == REVISIONS_KIND and isinstance(data.get("documents"), list)
            and isinstance(data.get("digest"), str)):
        raise _fail(f"not a revision file (apiVersion: {API_VERSION}, kind: {REVISIONS_KIND}, digest, "
                    "documents)", source=source, where="$")
    out: dict[DocumentKey, int] = {}
    for i, item in enumerate(data["documents"]):
        try:
            key = DocumentKey(str(item["model"]), PolicyKind(item["kind"]))
            revision = item["revision"]
            if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
                raise ValueError(revision)
        except (KeyError, TypeError, ValueError):
            raise _fail(f"documents[{i}] needs model, kind and a revision ≥ 0", source=source,
                        where=f"documents[{i}]") from None
        out[key] = revision
    return RevisionFile(out, data["digest"])


# ---- the JSON Schema ---------------------------------------------------------------------------


def _parameter_schema(kind: PolicyKind) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for name, spec in PARAMETERS[kind].items():
        prop: dict[str, Any] = {"type": "integer" if spec.integer else "number", "minimum": spec.minimum}
        if spec.maximum is not None:
            prop["maximum"] = spec.maximum
        description = spec.unit or ""
        if spec.default is not None:
            description = f"default {spec.default:g}" + (f"; {description}" if description else "")
        if description:
            prop["description"] = description
        props[name] = prop
    return {"type": ["object", "null"], "additionalProperties": False, "properties": props,
            "description": f"The {kind.value} document's overrides; {{}} or null: none."}


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy file (``rudder policy schema``)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:rudder:schema:policy-set:v1",
        "title": "Rudder policy file",
        "description": "Desired policy documents per model; each listed document is managed "
                       "(its overrides become exactly these), unlisted ones are left alone.",
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "models"],
        "properties": {
            "apiVersion": {"const": API_VERSION},
            "kind": {"const": FILE_KIND},
            "models": {
                "type": ["object", "null"],
                "propertyNames": {"minLength": 1},
                "additionalProperties": {
                    "type": "object", "additionalProperties": False,
                    "properties": {k.value: _parameter_schema(k) for k in PolicyKind},
                },
            },
        },
    }
