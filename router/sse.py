"""Spotting the first token in an OpenAI server-sent-event stream (pure).

A stream's first bytes are not always its first token: a chat stream may open with a role-only
chunk (``"delta": {"role": "assistant"}``) sent before the prompt is even prefilled. The router
releases a request's prefill booking and measures TTFT at the first chunk that carries generated
content, so it parses events only until that point and not after.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_CONTENT_KEYS = ("content", "reasoning_content", "text", "tool_calls")


# json.loads's own parts, for json_bytes: a default decoder's C scanner, and the whitespace
# pattern JSONDecoder.decode skips around the document with (json.decoder.WHITESPACE's; it
# matches anywhere, so its match is never None).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_space = re.compile(r"[ \t\n\r]*", re.VERBOSE | re.MULTILINE | re.DOTALL).match


def json_bytes(raw: bytes | bytearray) -> Any:
    """``json.loads(raw)``, without its encoding sniffing when ``raw`` opens with an ASCII byte
    other than NUL followed by no NUL (UTF-8, which is all RFC 8259 allows between systems), and
    with the C scanner called as ``JSONDecoder.decode`` calls it: the same answer and errors,
    three Python calls fewer on every request body and stream's first event. Anything else
    (UTF-16 or 32, a BOM) goes through ``json.loads`` as it is."""
    if raw and 0 < raw[0] < 128 and raw[1:2] != b"\x00":
        s = raw.decode("utf-8", "surrogatepass")
        try:
            obj, end = _scan(s, _space(s, 0).end())  # type: ignore[union-attr]
        except StopIteration as err:
            raise json.JSONDecodeError("Expecting value", s, err.value) from None
        end = _space(s, end).end()  # type: ignore[union-attr]
        if end != len(s):
            raise json.JSONDecodeError("Extra data", s, end)
        return obj
    return json.loads(raw)


def _carries_token(event: Any) -> bool:
    if not isinstance(event, dict):
        return False
    if "error" in event:
        return True  # an error ends the prefill phase as surely as a token
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):  # /v1/completions
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(k) for k in _CONTENT_KEYS):
            return True
        if choice.get("finish_reason"):  # finished without content: prefill is over too
            return True
    return False


class FirstTokenDetector:
    """Feed raw stream chunks; ``feed`` returns True once, at the chunk that completes the first
    event carrying a token (or an error, or a finish). Events split across chunks are buffered."""

    def __init__(self, *, max_buffer: int = 1 << 20) -> None:
        self._buffer = b""
        self._found = False
        self._max = max_buffer

    @property
    def found(self) -> bool:
        return self._found

    def feed(self, chunk: bytes) -> bool:
        if self._found:
            return False
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self._found = True
                return True
            try:
                event = json_bytes(data)
            except (ValueError, RecursionError):
                continue
            if _carries_token(event):
                self._found = True
                self._buffer = b""
                return True
        if len(self._buffer) > self._max:  # not SSE after all: count the bytes as the token
            self._found = True
            self._buffer = b""
            return True
        return False
