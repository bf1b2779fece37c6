"""Policy documents: parameters, validation, merge. Pure (DESIGN §3).

A document stores *overrides only*: ``{parameter: value}``. A router's effective value is its own
startup value unless the document overrides it. Two kinds per model: ``selection`` and
``busy_threshold``.

Every function here is pure and raises ``InvalidRequest``/``ValidationFailed`` naming the field.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.protocol.errors import InvalidRequest, ValidationFailed

Number = int | float
Document = dict[str, Number]


class PolicyKind(enum.StrEnum):
    SELECTION = "selection"
    BUSY_THRESHOLD = "busy_threshold"


class PolicyOp(enum.StrEnum):
    PATCH = "patch"
    RESET = "reset"
    ROLLBACK = "rollback"


class CacheInput(enum.StrEnum):
    """Cache inputs a scoring weight needs (the storage tier of the overlapping blocks)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    SHARED = "shared"


ALL_CACHE_INPUTS: frozenset[CacheInput] = frozenset(CacheInput)


@dataclass(frozen=True, slots=True)
class ParameterSpec:
    name: str
    default: Number | None
    minimum: float
    maximum: float | None
    integer: bool = False
    cache_input: CacheInput | None = None
    unit: str = ""

    def describe_range(self) -> str:
        upper = "" if self.maximum is None else f"..{self.maximum:g}"
        kind = "an integer" if self.integer else "a finite number"
        return f"{kind} in {self.minimum:g}{upper or '..'}" + ("" if upper else "∞")


SELECTION_PARAMETERS: dict[str, ParameterSpec] = {
    p.name: p
    for p in (
        ParameterSpec("overlap_score_credit", 1.0, 0.0, None, cache_input=CacheInput.DEVICE),
        ParameterSpec("overlap_score_credit_decay", 0.0, 0.0, None),
        ParameterSpec("prefill_load_scale", 1.0, 0.0, None),
        ParameterSpec("host_cache_hit_weight", 0.75, 0.0, 1.0, cache_input=CacheInput.HOST),
        ParameterSpec("disk_cache_hit_weight", 0.25, 0.0, 1.0, cache_input=CacheInput.DISK),
        ParameterSpec("shared_cache_multiplier", 0.0, 0.0, 1.0, cache_input=CacheInput.SHARED),
        ParameterSpec("decode_active_request_weight", 0.0, 0.0, None),
        ParameterSpec("router_temperature", 0.0, 0.0, None),
        # The predicted-time cost (router mode kv) and its per-worker calibration (issue 9).
        ParameterSpec("decode_slowdown_weight", 0.0, 0.0, None),
        ParameterSpec("prefill_interference_weight", 0.1, 0.0, None),
        ParameterSpec("arrival_wait_weight", 1.0, 0.0, None),
        ParameterSpec("calibration_window", 256, 16.0, 4096.0, integer=True, unit="observations"),
        ParameterSpec("calibration_min_samples", 16, 3.0, 1024.0, integer=True, unit="observations"),
        ParameterSpec("ttft_slo_reject", 0, 0.0, 1.0, integer=True, unit="0 best effort, 1 refuse"),
        # Changing it resets every router's calibration of the model (rudder routers
        # reset-calibration): a revisioned, audited reset through the one write path.
        ParameterSpec("calibration_epoch", 0, 0.0, None, integer=True),
    )
}

THRESHOLD_PARAMETERS: dict[str, ParameterSpec] = {
    p.name: p
    for p in (
        ParameterSpec("active_decode_blocks_threshold", None, 0.0, 1.0, unit="fraction of KV blocks"),
        ParameterSpec("active_prefill_tokens_threshold", None, 0.0, None, integer=True, unit="tokens"),
        ParameterSpec(
            "active_prefill_tokens_threshold_frac", None, 0.0, None,
            unit="multiple of max_num_batched_tokens",
        ),
    )
}

PARAMETERS: dict[PolicyKind, dict[str, ParameterSpec]] = {
    PolicyKind.SELECTION: SELECTION_PARAMETERS,
    PolicyKind.BUSY_THRESHOLD: THRESHOLD_PARAMETERS,
}


def parse_kind(value: Any, *, field: str = "kind") -> PolicyKind:
    try:
        return PolicyKind(value)
    except ValueError:
        allowed = ", ".join(k.value for k in PolicyKind)
        raise ValidationFailed(f"{field} must be one of {allowed}; got {value!r}", field=field) from None


def validate_value(kind: PolicyKind, name: str, value: Any, *, prefix: str = "parameters") -> Number:
    """Check one parameter value; return it normalised (int for integer parameters)."""
    field = f"{prefix}.{name}"
    spec = PARAMETERS[kind].get(name)
    if spec is None:
        known = ", ".join(PARAMETERS[kind])
        raise ValidationFailed(f"{field} is not a {kind.value} parameter (known: {known})", field=field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationFailed(
            f"{field} must be a number, got {type(value).__name__} {value!r}", field=field
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValidationFailed(f"{field} must be finite, got {value!r}", field=field)
    if spec.integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise ValidationFailed(f"{field} must be an integer, got {value!r}", field=field)
            value = int(value)
    else:
        value = float(value)
    checked: Number = value
    if checked < spec.minimum or (spec.maximum is not None and checked > spec.maximum):
        raise ValidationFailed(
            f"{field}={checked!r} is out of range: must be {spec.describe_range()}", field=field
        )
    return checked


def validate_changes(
    kind: PolicyKind, changes: Any, *, prefix: str = "parameters", allow_null: bool = True
) -> dict[str, Number | None]:
    """Validate a patch (``{name: value | null}``). Returns the normalised patch."""
    if not isinstance(changes, Mapping):
        raise ValidationFailed(f"{prefix} must be an object", field=prefix)
    out: dict[str, Number | None] = {}
    for name, value in changes.items():
        if not isinstance(name, str):
            raise ValidationFailed(f"{prefix} keys must be strings", field=prefix)
        if value is None:
            if name not in PARAMETERS[kind]:
                validate_value(kind, name, 0, prefix=prefix)  # raises: unknown parameter
            if not allow_null:
                raise ValidationFailed(f"{prefix}.{name} must not be null", field=f"{prefix}.{name}")
            out[name] = None
        else:
            out[name] = validate_value(kind, name, value, prefix=prefix)
    return out


def validate_document(kind: PolicyKind, document: Any, *, prefix: str = "document") -> Document:
    """Validate a whole override document (no nulls allowed)."""
    checked = validate_changes(kind, document, prefix=prefix, allow_null=False)
    return {k: v for k, v in checked.items() if v is not None}


def apply_patch(document: Mapping[str, Number], changes: Mapping[str, Number | None]) -> Document:
    """PATCH semantics: omitted = unchanged, ``None`` = remove the override, value = set."""
    result: Document = dict(document)
    for name, value in changes.items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = value
    return dict(sorted(result.items()))


def merge_thresholds(
    document: Mapping[str, Number],
    changes: Mapping[str, Number | None],
    unset: Sequence[str] = (),
) -> Document:
    """Compatible busy-threshold merge: ``None``/omitted = unchanged, ``unset`` removes."""
    result: Document = dict(document)
    for name, value in changes.items():
        if value is not None:
            result[name] = value
    for name in unset:
        result.pop(name, None)
    return dict(sorted(result.items()))


def validate_unset(kind: PolicyKind, unset: Any, *, field: str = "unset") -> list[str]:
    if unset is None:
        return []
    if not isinstance(unset, list) or not all(isinstance(n, str) for n in unset):
        raise ValidationFailed(f"{field} must be a list of parameter names", field=field)
    for i, name in enumerate(unset):
        if name not in PARAMETERS[kind]:
            raise ValidationFailed(
                f"{field}[{i}]={name!r} is not a {kind.value} parameter", field=f"{field}[{i}]"
            )
    return list(unset)


def startup_values(
    kind: PolicyKind,
    *,
    overrides: Mapping[str, Number] | None = None,
    cache_inputs: frozenset[CacheInput] = ALL_CACHE_INPUTS,
) -> dict[str, Number | None]:
    """A router's startup values: defaults, its own flags, and 0 for weights it cannot feed."""
    values: dict[str, Number | None] = {n: s.default for n, s in PARAMETERS[kind].items()}
    for name, value in (overrides or {}).items():
        values[name] = validate_value(kind, name, value, prefix="startup")
    for name, spec in PARAMETERS[kind].items():
        if spec.cache_input is not None and spec.cache_input not in cache_inputs:
            values[name] = 0.0
    return values


def effective_values(
    startup: Mapping[str, Number | None], document: Mapping[str, Number]
) -> dict[str, Number | None]:
    out = dict(startup)
    out.update(document)
    return out


def missing_cache_inputs(
    kind: PolicyKind, document: Mapping[str, Number], cache_inputs: frozenset[CacheInput]
) -> list[str]:
    """Names of nonzero weights in ``document`` whose cache input is not in ``cache_inputs``."""
    if kind is not PolicyKind.SELECTION:
        return []
    return sorted(
        name
        for name, value in document.items()
        if (spec := SELECTION_PARAMETERS.get(name)) is not None
        and spec.cache_input is not None
        and spec.cache_input not in cache_inputs
        and value != 0
    )


def diff_documents(before: Mapping[str, Number], after: Mapping[str, Number]) -> dict[str, Any]:
    """``{name: {"before": x, "after": y}}`` for every parameter that differs (None = no override)."""
    out: dict[str, Any] = {}
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a != b:
            out[name] = {"before": a, "after": b}
    return out


#: The largest revision a write may name: the audit log stores revisions as PostgreSQL BIGINT
#: (JetStream's sequences are u64 but never get near it). A larger one could not even be
#: recorded with its refusal (the admin API fuzzer: 503 instead of 422).
REVISION_MAX = 2**63 - 1


def require_revision(value: Any, *, field: str = "expected_revision") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{field} must be a non-negative integer", field=field)
    if not 0 <= value <= REVISION_MAX:
        raise ValidationFailed(f"{field} must be in 0..{REVISION_MAX}, got {value}", field=field)
    return value
