from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from router.sse import FirstTokenDetector, json_bytes

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
TEXT = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'


def test_role_only_chunk_is_not_the_first_token() -> None:
    d = FirstTokenDetector()
    assert d.feed(ROLE) is False
    assert d.feed(TOKEN) is True
    assert d.feed(TOKEN) is False  # once


def test_completions_text_counts() -> None:
    assert FirstTokenDetector().feed(TEXT) is True


def test_event_split_across_chunks() -> None:
    d = FirstTokenDetector()
    assert d.feed(TOKEN[:20]) is False
    assert d.feed(TOKEN[20:]) is True


def test_role_and_token_in_one_chunk() -> None:
    assert FirstTokenDetector().feed(ROLE + TOKEN) is True


def test_error_done_and_finish_end_the_prefill_too() -> None:
    assert FirstTokenDetector().feed(b'data: {"error": {"message": "x"}}\n\n') is True
    assert FirstTokenDetector().feed(b"data: [DONE]\n\n") is True
    assert FirstTokenDetector().feed(b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n') is True


def test_usage_only_and_garbage_are_not_tokens() -> None:
    d = FirstTokenDetector()
    assert d.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n') is False
    assert d.feed(b"data: not json\n\n: comment\n\n") is False
    # nested deeper than the parser goes (a worker's bytes: RecursionError, not ValueError)
    assert d.feed(b"data: " + b"[" * 5_000 + b"]" * 5_000 + b"\n\n") is False
    assert d.found is False
    assert d.feed(TOKEN) is True


def test_non_sse_bytes_count_once_the_buffer_is_large() -> None:
    d = FirstTokenDetector(max_buffer=16)
    assert d.feed(b"x" * 8) is False
    assert d.feed(b"x" * 16) is True


def _outcome(parse: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", parse(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return type(exc).__name__, str(exc)


_TEXTS = st.recursive(st.none() | st.booleans() | st.integers() | st.text(), lambda inner: st.lists(inner)
                      | st.dictionaries(st.text(), inner), max_leaves=8).map(json.dumps)


@given(st.binary(max_size=16) | _TEXTS.flatmap(lambda t: st.sampled_from(
    [t.encode(), t.encode("utf-16"), t.encode("utf-16-le"), t.encode("utf-32-le"), t.encode("utf-8-sig"),
     (" " + t).encode(), f"\t{t} \r\n".encode(), f"{t} x".encode(), f"{t}{t}".encode(), t.encode()[:-1]])))
def test_json_bytes_answers_as_json_loads_does(raw: bytes) -> None:
    """The request path's parse skips json.loads' encoding sniffing for UTF-8 and calls its
    scanner as JSONDecoder.decode does: the same values and the same errors (their messages and
    positions: whitespace around, extra data after, a document cut short), whatever the bytes."""
    assert _outcome(json_bytes, raw) == _outcome(json.loads, raw)
    assert _outcome(json_bytes, bytearray(raw)) == _outcome(json.loads, raw)  # a body read in parts
