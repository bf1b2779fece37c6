"""The admin API's write bodies (pure): one strict pydantic model per write, and how a body is
checked against it.

    PolicyPatch        PATCH /router_policy
    PolicyRollback     POST  /router_policy/rollback
    CalibrationReset   POST  /router_policy/calibration/reset
    ThresholdsUpdate   POST  /router_policy/busy_threshold (alias POST /busy_threshold)

The models are the contract (``/openapi.json`` shows them): an unknown field, a wrong type, NaN
or Infinity is refused. Each field carries its :class:`Check`, the pure function that refuses a
bad value with the RudderError naming the field (400 ``invalid_request`` for a missing or mistyped
field, 422 ``validation_failed`` for a value outside its domain); pydantic runs it before the
field's type. :func:`parse` checks a body in the order the write path always has (the body is an
object, it names no unknown field, then field by field in declaration order), so the first error
is the one answered, and tells ``note`` about every field that passed: a refused write is audited
with what was known of it by then.

A patch's ``parameters`` are checked last, by the model as a whole (which names exist depends on
``kind``): first that it gives either ``parameters`` or ``reset: true``, then each parameter against
the kind's table (the policy module's ``validate_changes``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from controlplane.protocol.errors import InvalidRequest, RudderError, ValidationFailed
from controlplane.protocol.policy import (
    PARAMETERS,
    REVISION_MAX,
    THRESHOLD_PARAMETERS,
    PolicyKind,
    parse_kind,
    require_revision,
    validate_changes,
    validate_unset,
    validate_value,
)
from controlplane.protocol.subjects import MAX_MODEL_NAME_BYTES, encode_model_key


@dataclass(frozen=True, slots=True)
class Check:
    """A field's pure check, as ``Annotated`` metadata: ``fn(value, field)`` returns the value
    (normalised) or raises the RudderError that names the field. ``missing`` is the message of a
    required field that is absent (default: what ``fn`` says of ``None``)."""

    fn: Callable[[Any, str], Any]
    missing: str | None = None

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.with_info_before_validator_function(self._validate, handler(source))

    def _validate(self, value: Any, info: core_schema.ValidationInfo) -> Any:
        try:
            return self.fn(value, info.field_name or "")
        except RudderError as exc:
            raise _carried(exc) from None

    def refuse_missing(self, field: str) -> RudderError:
        if self.missing is not None:
            return InvalidRequest(self.missing, field=field)
        try:
            self.fn(None, field)
        except RudderError as exc:
            return exc
        return InvalidRequest(f"{field} is required", field=field)


def _carried(error: RudderError) -> PydanticCustomError:
    """A check's RudderError as pydantic's error, carrying it (``ctx["error"]``) for :func:`parse`."""
    # pydantic renders the message in Rust: a lone surrogate the check quotes (a parameter's name
    # from a "\ud800" escape) would fail it, so the rendered copy escapes what UTF-8 cannot hold.
    shown = error.message.encode("utf-8", "backslashreplace").decode("utf-8")
    return PydanticCustomError("rudder", "{message}", {"message": shown, "error": error})


# ---- the checks (each raises the error the write path has always answered) --------------------


#: Characters no model name holds: C0 controls and DEL (a NUL cannot even be stored), and
#: unpaired surrogates (no UTF-8 encoding).
_NOT_IN_NAMES = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def check_model(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{field} is required and must be a non-empty string", field=field)
    if _NOT_IN_NAMES.search(value):
        raise InvalidRequest(f"{field} holds a control character or an unpaired surrogate", field=field)
    encode_model_key(value)  # raises for an unusable name (too long)
    return value


def check_flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{field} must be true or false", field=field)
    return value


def check_kind(value: Any, field: str) -> PolicyKind:
    return parse_kind(value, field=field)


def check_revision(value: Any, field: str) -> int:
    return require_revision(value, field=field)


def check_optional_revision(value: Any, field: str) -> int | None:
    """The compatible threshold API: ``null`` (or absent) means "merge with the head"."""
    return None if value is None else require_revision(value, field=field)


def check_threshold(value: Any, field: str) -> float | int | None:
    """``null`` leaves the threshold as it is; a value is checked as ``body.<name>``."""
    return None if value is None else validate_value(PolicyKind.BUSY_THRESHOLD, field, value, prefix="body")


def check_unset(value: Any, field: str) -> list[str]:
    return validate_unset(PolicyKind.BUSY_THRESHOLD, value, field=field)


def _any(value: Any, field: str) -> Any:
    return value


# ---- field types ---------------------------------------------------------------------------

ModelName = Annotated[str, Field(min_length=1, description=(
    f"Model name, at most {MAX_MODEL_NAME_BYTES} UTF-8 bytes, e.g. meta-llama/Llama-3.1-8B-Instruct.")),
    Check(check_model)]
Kind = Annotated[PolicyKind, Field(description="Which document of the model."), Check(check_kind)]
ExpectedRevision = Annotated[int, Field(ge=0, le=REVISION_MAX, description=(
    "The head revision the write expects (compare-and-set); 0 for a document that does not exist "
    "yet. A stale one is answered 409.")),
    Check(check_revision, missing="expected_revision is required (use the current revision, or 0 "
                                  "for a new document)")]
DryRun = Annotated[bool, Field(description="Check and show the result; publish nothing."), Check(check_flag)]


def _parameters_described() -> str:
    """Every kind's parameters and their ranges (from the policy module's tables)."""
    kinds = "; ".join(f"{kind.value}: " + ", ".join(f"{name} ({spec.describe_range()})"
                                                      for name, spec in specs.items())
                      for kind, specs in PARAMETERS.items())
    return ("The patch: parameter name → new value, or null to remove the override; the names "
            f"are the kind's. {kinds}.")


Parameters = Annotated[Any, WithJsonSchema({
    "type": "object",
    "description": _parameters_described(),
    "additionalProperties": {"anyOf": [{"type": "number"}, {"type": "null"}]},
}), Check(_any)]


def _limits(name: str) -> Any:
    """The threshold's documented range (its spec in the policy module)."""
    spec = THRESHOLD_PARAMETERS[name]
    return Field(ge=spec.minimum, le=spec.maximum, description=f"{spec.unit}; null leaves it as it is")


DecodeBlocksThreshold = Annotated[float | None, _limits("active_decode_blocks_threshold"),
                                  Check(check_threshold)]
PrefillTokensThreshold = Annotated[int | None, _limits("active_prefill_tokens_threshold"),
                                   Check(check_threshold)]
PrefillTokensFraction = Annotated[float | None, _limits("active_prefill_tokens_threshold_frac"),
                                  Check(check_threshold)]


class WriteRequest(BaseModel):
    """Strict: unknown fields, wrong types (no coercion) and NaN/Infinity are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class PolicyPatch(WriteRequest):
    """Change a document: ``parameters`` (set or remove overrides) or ``reset`` (remove all)."""

    model: ModelName
    kind: Kind = PolicyKind.SELECTION
    expected_revision: ExpectedRevision
    dry_run: DryRun = False
    reset: Annotated[bool, Field(description="Remove every override (instead of parameters)."),
                     Check(check_flag)] = False
    #: Checked with the whole model (below): ``{name: number | None}``, or None for a reset.
    parameters: Parameters = None

    @model_validator(mode="after")
    def _parameters_or_reset(self) -> Self:
        """Exactly one of ``parameters`` and ``reset: true``; the parameters are the kind's
        (checked last, once the kind is known; normalised: integers where the parameter is one)."""
        try:
            if self.reset == ("parameters" in self.model_fields_set):
                raise InvalidRequest("give either parameters or reset: true", field="parameters")
            if self.reset:
                return self
            checked = validate_changes(self.kind, self.parameters)
        except RudderError as exc:
            raise _carried(exc) from None
        return self.model_copy(update={"parameters": checked})


class PolicyRollback(WriteRequest):
    """Restore an older revision's document as a new forward revision."""

    model: ModelName
    kind: Kind = PolicyKind.SELECTION
    expected_revision: ExpectedRevision
    dry_run: DryRun = False
    to_revision: Annotated[int, Field(ge=0, le=REVISION_MAX, description=(
        "The revision whose document to restore (0: the empty document)")), Check(check_revision)]


class CalibrationReset(WriteRequest):
    """Reset every router's timing fit of a model: the selection document's
    ``calibration_epoch`` becomes the head's + 1 (a patch, revisioned and audited)."""

    model: ModelName


class ThresholdsUpdate(WriteRequest):
    """The compatible busy-threshold write: thresholds not named (or null) keep their value.
    Without ``expected_revision`` the control plane merges with the head and retries its own
    compare-and-set. Every threshold null and nothing to ``unset`` is a read."""

    model: ModelName
    active_decode_blocks_threshold: DecodeBlocksThreshold = None
    active_prefill_tokens_threshold: PrefillTokensThreshold = None
    active_prefill_tokens_threshold_frac: PrefillTokensFraction = None
    unset: Annotated[list[str], Field(default_factory=list, description=(
        "Thresholds to remove (back to the routers' startup values)")), Check(check_unset)]
    dry_run: DryRun = False
    create: Annotated[bool, Field(description=(
        "Create the document of a model no live worker or router serves (else 404).")),
        Check(check_flag)] = False
    expected_revision: Annotated[int | None, Field(ge=0, le=REVISION_MAX, description=(
        "Write only if this is the head revision (409 otherwise); null: merge with the head.")),
        Check(check_optional_revision)] = None


#: Every write body, for /openapi.json.
WRITE_REQUESTS: tuple[type[WriteRequest], ...] = (PolicyPatch, PolicyRollback, CalibrationReset,
                                                  ThresholdsUpdate)

R = TypeVar("R", bound=WriteRequest)


def _ignore(field: str, value: Any) -> None:
    return None


def _check_of(request: type[WriteRequest], field: str) -> Check:
    for meta in request.model_fields[field].metadata:
        if isinstance(meta, Check):
            return meta
    raise AssertionError(f"{request.__name__}.{field} has no Check")


def parse(request: type[R], body: Any, *, note: Callable[[str, Any], None] = _ignore) -> R:
    """``body`` (decoded JSON) as a ``request``; raises the RudderError naming the first bad field
    (see the module docstring for the order). ``note(field, value)`` hears each field that passed,
    in order (an absent optional field passes with its default)."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("request body must be a JSON object", field="body")
    fields = request.model_fields
    for key in body:
        if key not in fields:
            raise ValidationFailed(f"unknown field {key!r}; allowed: {', '.join(sorted(fields))}",
                                   field=key)
    for name, info in fields.items():
        check = _check_of(request, name)
        if name in body:
            note(name, check.fn(body[name], name))
        elif info.is_required():
            raise check.refuse_missing(name)
        else:
            note(name, info.get_default(call_default_factory=True))
    try:
        return request.model_validate(body)
    except ValidationError as exc:  # the model's own checks, or a type a field's check let through
        first = exc.errors()[0]
        error = first.get("ctx", {}).get("error")
        if isinstance(error, RudderError):
            raise error from None
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise ValidationFailed(f"{field}: {first['msg']}", field=field) from None


__all__ = [
    "WRITE_REQUESTS",
    "CalibrationReset",
    "Check",
    "PolicyPatch",
    "PolicyRollback",
    "ThresholdsUpdate",
    "WriteRequest",
    "parse",
]
