"""The tokenizer seam: prompt → token ids, chosen by the workers' membership ``tokenizer``.

``rudder-bytes`` (the mock engine's) is built in. Any other name (a Hugging Face tokenizer folder,
to be loaded in a later issue) falls back to :class:`EstimatingTokenizer`: no token ids, so no
prefix hashes and no predicted overlap, and a prompt length estimated at 4 bytes a token, which
keeps load-based selection meaningful.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from controlplane.protocol import tokenizer as byte_tokenizer
from controlplane.protocol.errors import InvalidRequest


class Tokenizer(Protocol):
    name: str

    def chat(self, messages: Any) -> tuple[list[int], int]:
        """(token ids, prompt token count). Raises InvalidRequest."""

    def prompt(self, prompt: Any) -> tuple[list[int], int]: ...


def _check_messages(messages: Any) -> Sequence[Mapping[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", field="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object", field=f"messages[{i}]")
    return messages


def _prompt_parts(prompt: Any) -> list[str] | list[int]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    raise InvalidRequest("prompt must be a string, an array of strings or of token ids", field="prompt")


class ByteTokenizer:
    name = byte_tokenizer.NAME

    def chat(self, messages: Any) -> tuple[list[int], int]:
        tokens = byte_tokenizer.encode_chat(_check_messages(messages))
        return tokens, len(tokens)

    def prompt(self, prompt: Any) -> tuple[list[int], int]:
        parts = _prompt_parts(prompt)
        if parts and isinstance(parts[0], int):
            return [int(t) for t in parts], len(parts)
        tokens = byte_tokenizer.encode("".join(str(p) for p in parts))
        return tokens, len(tokens)


class EstimatingTokenizer:
    name = "estimate"

    def chat(self, messages: Any) -> tuple[list[int], int]:
        text = byte_tokenizer.render_chat(_check_messages(messages))
        return [], max(1, len(text.encode()) // 4)

    def prompt(self, prompt: Any) -> tuple[list[int], int]:
        parts = _prompt_parts(prompt)
        if parts and isinstance(parts[0], int):
            return [], len(parts)
        return [], max(1, sum(len(str(p).encode()) for p in parts) // 4)


BYTES = ByteTokenizer()
ESTIMATE = EstimatingTokenizer()


def tokenizer_for(names: frozenset[str]) -> Tokenizer:
    """The byte tokenizer when every worker of the model uses it, else the estimate."""
    if names == frozenset({byte_tokenizer.NAME}):
        return BYTES
    return ESTIMATE
