from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.protocol.errors import ValidationFailed
from controlplane.protocol.policy import (
    SELECTION_PARAMETERS,
    THRESHOLD_PARAMETERS,
    CacheInput,
    PolicyKind,
    apply_patch,
    effective_values,
    merge_thresholds,
    missing_cache_inputs,
    startup_values,
    validate_changes,
)

SEL = PolicyKind.SELECTION


def valid_value(name: str) -> st.SearchStrategy[float]:
    spec = SELECTION_PARAMETERS[name]
    hi = spec.maximum if spec.maximum is not None else 100.0
    return st.floats(min_value=spec.minimum, max_value=hi, allow_nan=False, allow_infinity=False)


names = st.sampled_from(sorted(SELECTION_PARAMETERS))


@st.composite
def patches(draw: st.DrawFn) -> dict[str, float | None]:
    keys = draw(st.lists(names, unique=True, max_size=8))
    return {k: draw(st.one_of(st.none(), valid_value(k))) for k in keys}


@st.composite
def documents(draw: st.DrawFn) -> dict[str, float]:
    keys = draw(st.lists(names, unique=True, max_size=8))
    return {k: draw(valid_value(k)) for k in keys}


@given(documents(), patches())
def test_applying_the_same_patch_twice_changes_nothing_the_second_time(doc: dict, patch: dict) -> None:
    once = apply_patch(doc, patch)
    assert apply_patch(once, patch) == once


@given(documents(), names, st.data())
def test_set_then_null_returns_to_the_startup_value(doc: dict, name: str, data: st.DataObject) -> None:
    startup = startup_values(SEL)
    value = data.draw(valid_value(name))
    after_set = apply_patch(doc, {name: value})
    assert effective_values(startup, after_set)[name] == value
    after_null = apply_patch(after_set, {name: None})
    assert name not in after_null
    assert effective_values(startup, after_null)[name] == startup[name]


@given(documents())
def test_reset_empties_every_override(doc: dict) -> None:
    reset = apply_patch(doc, {k: None for k in doc})
    assert reset == {}
    assert effective_values(startup_values(SEL), reset) == startup_values(SEL)


@given(documents(), patches())
def test_omitted_fields_are_unchanged(doc: dict, patch: dict) -> None:
    after = apply_patch(doc, patch)
    for name, value in doc.items():
        if name not in patch:
            assert after[name] == value


@pytest.mark.parametrize(("changes", "field", "fragment"), [
    ({"bogus": 1}, "parameters.bogus", "not a selection parameter"),
    ({"router_temperature": math.nan}, "parameters.router_temperature", "finite"),
    ({"router_temperature": math.inf}, "parameters.router_temperature", "finite"),
    ({"overlap_score_credit": -0.1}, "parameters.overlap_score_credit", "out of range"),
    ({"host_cache_hit_weight": 1.01}, "parameters.host_cache_hit_weight", "out of range"),
    ({"router_temperature": "1"}, "parameters.router_temperature", "must be a number"),
    ({"router_temperature": True}, "parameters.router_temperature", "must be a number"),
    ({"router_temperature": [1]}, "parameters.router_temperature", "must be a number"),
])
def test_validation_names_the_field(changes: dict, field: str, fragment: str) -> None:
    with pytest.raises(ValidationFailed) as exc:
        validate_changes(SEL, changes)
    assert exc.value.field == field
    assert fragment in exc.value.message


def test_threshold_integer_and_fraction_rules() -> None:
    kind = PolicyKind.BUSY_THRESHOLD
    assert validate_changes(kind, {"active_prefill_tokens_threshold": 4096.0}) == {
        "active_prefill_tokens_threshold": 4096}
    with pytest.raises(ValidationFailed):
        validate_changes(kind, {"active_prefill_tokens_threshold": 1.5})
    with pytest.raises(ValidationFailed):
        validate_changes(kind, {"active_decode_blocks_threshold": 1.2})
    assert validate_changes(kind, {"active_decode_blocks_threshold": 0}) == {"active_decode_blocks_threshold": 0.0}
    assert set(THRESHOLD_PARAMETERS) == {"active_decode_blocks_threshold", "active_prefill_tokens_threshold",
                                         "active_prefill_tokens_threshold_frac"}


def test_threshold_merge_keeps_unmentioned_and_unset_removes() -> None:
    doc = {"active_decode_blocks_threshold": 0.8, "active_prefill_tokens_threshold": 100}
    merged = merge_thresholds(doc, {"active_decode_blocks_threshold": None,
                                    "active_prefill_tokens_threshold_frac": 1.5},
                              unset=["active_prefill_tokens_threshold"])
    assert merged == {"active_decode_blocks_threshold": 0.8, "active_prefill_tokens_threshold_frac": 1.5}


def test_startup_zeroes_weights_whose_cache_input_is_missing() -> None:
    approx = startup_values(SEL, cache_inputs=frozenset({CacheInput.DEVICE}))
    assert approx["host_cache_hit_weight"] == 0 and approx["disk_cache_hit_weight"] == 0
    assert approx["overlap_score_credit"] == 1.0
    load_only = startup_values(SEL, cache_inputs=frozenset())
    assert load_only["overlap_score_credit"] == 0
    assert missing_cache_inputs(SEL, {"host_cache_hit_weight": 0.5, "disk_cache_hit_weight": 0.0},
                                frozenset({CacheInput.DEVICE})) == ["host_cache_hit_weight"]
