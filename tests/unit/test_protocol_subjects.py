from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.protocol.errors import InvalidRequest
from controlplane.protocol.subjects import (
    decode_model_key,
    encode_model_key,
    parse_policy_subject,
    policy_subject,
)

TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


@pytest.mark.parametrize("name", [
    "meta-llama/Llama-3.1-8B-Instruct", "qwen2.5:7b", "my model with spaces", "star*model",
    "gt>model", "модель/большая", "模型", "under_score", "_5F", "a.b.c", "x",
])
def test_model_key_round_trips_and_is_one_token(name: str) -> None:
    key = encode_model_key(name)
    assert TOKEN.fullmatch(key), key
    assert decode_model_key(key) == name
    model, kind = parse_policy_subject(policy_subject(name, "selection"))
    assert (model, kind) == (name, "selection")


def test_known_encoding_is_readable() -> None:
    assert encode_model_key("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama_2FLlama-3_2E1-8B-Instruct"


@given(st.text(min_size=1, max_size=60))
def test_any_name_round_trips(name: str) -> None:
    key = encode_model_key(name)
    assert TOKEN.fullmatch(key)
    assert decode_model_key(key) == name


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_encoding_is_injective(a: str, b: str) -> None:
    if a != b:
        assert encode_model_key(a) != encode_model_key(b)


def test_bad_names_and_keys_are_refused() -> None:
    with pytest.raises(InvalidRequest) as exc:
        encode_model_key("")
    assert exc.value.field == "model"
    for bad in ("a.b", "a_ZZ", "a_4", "a b", ""):
        with pytest.raises(InvalidRequest):
            decode_model_key(bad)
