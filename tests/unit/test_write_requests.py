"""The admin API's write bodies (controlplane/protocol/requests.py): strict models, checked in the
write path's order, each refusal the RudderError that names the field (pure; no servers)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from controlplane.protocol.errors import InvalidRequest, RudderError, ValidationFailed
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.requests import (
    WRITE_REQUESTS,
    CalibrationReset,
    PolicyPatch,
    PolicyRollback,
    ThresholdsUpdate,
    WriteRequest,
    parse,
)

PATCH: dict[str, Any] = {"model": "m", "expected_revision": 0, "parameters": {"router_temperature": 0.5}}


def refusal(request: type[WriteRequest], body: Any) -> RudderError:
    with pytest.raises(RudderError) as info:
        parse(request, body)
    return info.value


@pytest.mark.parametrize(("request_type", "body", "error", "field"), [
    (PolicyPatch, [], InvalidRequest, "body"),
    (PolicyPatch, None, InvalidRequest, "body"),
    # unknown fields first, whatever else is wrong
    (PolicyPatch, {"model": 5, "pad": 1}, ValidationFailed, "pad"),
    (CalibrationReset, {"model": "m", "kind": "selection"}, ValidationFailed, "kind"),
    (PolicyPatch, {"expected_revision": 0}, InvalidRequest, "model"),
    (PolicyPatch, {"model": "  ", "expected_revision": 0}, InvalidRequest, "model"),
    (PolicyPatch, {"model": "x" * 300, "expected_revision": 0}, InvalidRequest, "model"),
    # a control character or an unpaired surrogate in a model name (the admin API fuzzer: a NUL
    # could not even be audited, a \x0f was published)
    (PolicyPatch, {"model": "a\x00b", "expected_revision": 0}, InvalidRequest, "model"),
    (CalibrationReset, {"model": "G\x0fx"}, InvalidRequest, "model"),
    (ThresholdsUpdate, {"model": "m\x7f"}, InvalidRequest, "model"),
    (PolicyRollback, {"model": "\ud800", "expected_revision": 0, "to_revision": 1}, InvalidRequest, "model"),
    (PolicyPatch, {"model": "m", "kind": "bogus", "expected_revision": "x"}, ValidationFailed, "kind"),
    (PolicyPatch, {"model": "m"}, InvalidRequest, "expected_revision"),
    (PolicyPatch, {"model": "m", "expected_revision": True}, InvalidRequest, "expected_revision"),
    (PolicyPatch, {"model": "m", "expected_revision": 1.0}, InvalidRequest, "expected_revision"),
    (PolicyPatch, {"model": "m", "expected_revision": -1}, ValidationFailed, "expected_revision"),
    (PolicyPatch, {"model": "m", "expected_revision": 2**63}, ValidationFailed, "expected_revision"),
    (PolicyRollback, {"model": "m", "expected_revision": 0, "to_revision": 2**64}, ValidationFailed, "to_revision"),
    (PolicyPatch, {**PATCH, "dry_run": None}, InvalidRequest, "dry_run"),
    (PolicyPatch, {**PATCH, "reset": 1}, InvalidRequest, "reset"),
    # parameters or reset, checked before the parameters themselves
    (PolicyPatch, {**PATCH, "reset": True, "parameters": {"x": math.nan}}, InvalidRequest, "parameters"),
    (PolicyPatch, {"model": "m", "expected_revision": 0}, InvalidRequest, "parameters"),
    (PolicyPatch, {**PATCH, "parameters": None}, ValidationFailed, "parameters"),
    (PolicyPatch, {**PATCH, "parameters": {"bogus": "x", "router_temperature": "hot"}}, ValidationFailed,
     "parameters.bogus"),
    (PolicyPatch, {**PATCH, "parameters": {"router_temperature": True}}, ValidationFailed,
     "parameters.router_temperature"),
    (PolicyPatch, {**PATCH, "kind": "busy_threshold"}, ValidationFailed, "parameters.router_temperature"),
    (PolicyRollback, {"model": "m", "expected_revision": 0}, InvalidRequest, "to_revision"),
    (PolicyRollback, {"model": "m", "expected_revision": 0, "to_revision": "1"}, InvalidRequest, "to_revision"),
    (ThresholdsUpdate, {"model": "m", "active_decode_blocks_threshold": 1.5}, ValidationFailed,
     "body.active_decode_blocks_threshold"),
    (ThresholdsUpdate, {"model": "m", "active_prefill_tokens_threshold": 0.5}, ValidationFailed,
     "body.active_prefill_tokens_threshold"),
    (ThresholdsUpdate, {"model": "m", "unset": ["bogus"]}, ValidationFailed, "unset[0]"),
    (ThresholdsUpdate, {"model": "m", "unset": "active_decode_blocks_threshold"}, ValidationFailed, "unset"),
    (ThresholdsUpdate, {"model": "m", "create": "yes"}, InvalidRequest, "create"),
    (ThresholdsUpdate, {"model": "m", "expected_revision": -1}, ValidationFailed, "expected_revision"),
])
def test_a_bad_body_is_refused_naming_its_first_bad_field(request_type: type[WriteRequest], body: Any,
                                                          error: type[RudderError], field: str) -> None:
    refused = refusal(request_type, body)
    assert type(refused) is error and refused.field == field, refused
    assert field.split(".")[-1].split("[")[0] in refused.message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_by_name(literal: str) -> None:
    body = json.loads(f'{{"model": "m", "expected_revision": 0, "parameters": {{"prefill_load_scale": {literal}}}}}')
    refused = refusal(PolicyPatch, body)
    assert refused.code == "validation_failed" and refused.field == "parameters.prefill_load_scale"
    assert "finite" in refused.message
    body = json.loads(f'{{"model": "m", "active_prefill_tokens_threshold_frac": {literal}}}')
    refused = refusal(ThresholdsUpdate, body)
    assert refused.field == "body.active_prefill_tokens_threshold_frac" and "finite" in refused.message


def test_the_messages_are_the_write_paths() -> None:
    assert refusal(PolicyPatch, {"model": "m", "x": 1}).message == (
        "unknown field 'x'; allowed: dry_run, expected_revision, kind, model, parameters, reset")
    assert refusal(PolicyPatch, {"model": "m"}).message == (
        "expected_revision is required (use the current revision, or 0 for a new document)")
    assert refusal(PolicyPatch, {**PATCH, "reset": True}).message == "give either parameters or reset: true"
    assert refusal(PolicyPatch, {"model": 5}).message == "model is required and must be a non-empty string"


def test_a_good_body_is_typed_and_normalised() -> None:
    patch = parse(PolicyPatch, {"model": "m", "kind": "selection", "expected_revision": 3, "parameters": {
        "calibration_window": 32.0, "router_temperature": 1, "host_cache_hit_weight": None}})
    assert patch.kind is PolicyKind.SELECTION and patch.expected_revision == 3 and not patch.dry_run
    assert patch.parameters == {"calibration_window": 32, "router_temperature": 1.0, "host_cache_hit_weight": None}
    assert type(patch.parameters["calibration_window"]) is int
    reset = parse(PolicyPatch, {"model": "m", "expected_revision": 0, "reset": True})
    assert reset.reset and reset.parameters is None and "parameters" not in reset.model_fields_set
    thresholds = parse(ThresholdsUpdate, {"model": "m", "active_prefill_tokens_threshold": 512.0,
                                          "active_decode_blocks_threshold": None})
    assert thresholds.active_prefill_tokens_threshold == 512 and thresholds.unset == []
    assert thresholds.model_fields_set == {"model", "active_prefill_tokens_threshold", "active_decode_blocks_threshold"}
    assert parse(CalibrationReset, {"model": "org/m:v1"}).model == "org/m:v1"


def test_note_hears_every_field_that_passed_in_order() -> None:
    heard: list[tuple[str, Any]] = []
    with pytest.raises(InvalidRequest):
        parse(PolicyRollback, {"model": "m", "expected_revision": 2, "to_revision": "x"},
              note=lambda name, value: heard.append((name, value)))
    assert heard == [("model", "m"), ("kind", PolicyKind.SELECTION), ("expected_revision", 2), ("dry_run", False)]


@pytest.mark.parametrize("request_type", WRITE_REQUESTS)
def test_the_models_themselves_are_strict(request_type: type[WriteRequest]) -> None:
    """Without parse: pydantic refuses what parse refuses (unknown fields, coercion, NaN)."""
    fields = request_type.model_fields
    with pytest.raises(ValidationError):
        request_type.model_validate({"model": "m", "unknown": 1})
    with pytest.raises(ValidationError):
        request_type.model_validate({"model": 5})
    if "expected_revision" in fields and fields["expected_revision"].is_required():
        with pytest.raises(ValidationError):
            request_type.model_validate({"model": "m", "expected_revision": "1", "reset": True, "to_revision": 0})
    assert request_type.model_config.get("extra") == "forbid" and request_type.model_config.get("strict")
    assert request_type.model_config.get("allow_inf_nan") is False
    if request_type is ThresholdsUpdate:
        with pytest.raises(ValidationError):
            request_type.model_validate({"model": "m", "active_decode_blocks_threshold": math.inf})
    if request_type is PolicyPatch:
        with pytest.raises(ValidationError):
            request_type.model_validate({**PATCH, "parameters": {"router_temperature": math.nan}})
