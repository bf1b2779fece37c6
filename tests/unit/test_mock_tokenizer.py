"""The mock engine's tokenizer setting (RUDDER_MOCK__TOKENIZER)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engines.mock.tokenizer import BYTES, load_tokenizer


def test_default_is_bytes() -> None:
    assert load_tokenizer("") is BYTES and load_tokenizer("rudder-bytes") is BYTES
    assert BYTES.encode("hé") == list("hé".encode())
    assert BYTES.output_token(0) == ord("a")


def test_a_missing_folder_stops_start_up_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RUDDER_MOCK__TOKENIZER"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"RUDDER_MOCK__TOKENIZER.*failed to load"):
        load_tokenizer(str(tmp_path))  # a folder without a tokenizer
