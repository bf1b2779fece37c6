"""Booleans (``stream``) read as vLLM's request models read them (controlplane/protocol/inference.py)."""

from __future__ import annotations

import pytest

from controlplane.protocol.inference import lax_bool


@pytest.mark.parametrize(("value", "streamed"), [
    (True, True), ("true", True), ("True", True), ("yes", True), ("on", True), ("1", True), (1, True),
    (1.0, True), (False, False), (None, False), ("false", False), ("no", False), ("off", False),
    ("0", False), (0, False),
])
def test_what_vllm_takes_for_a_boolean(value: object, streamed: bool) -> None:
    assert lax_bool(value, "stream") is streamed


@pytest.mark.parametrize("value", ["x", "", "truthy", 2, -1, 1.5, [], [True], {}, {"a": 1}])
def test_what_vllm_refuses_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"^stream must be a boolean"):
        lax_bool(value, "stream")
