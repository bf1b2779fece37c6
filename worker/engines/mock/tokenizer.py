"""The mock engine's tokenizer: ``rudder-bytes`` (UTF-8 bytes, the default) or the Hugging Face
tokenizer of a local model folder (``RUDDER_MOCK__TOKENIZER=/path/to/model``, issue 9).

With a folder, the mock counts, caches and reports (``usage``, ``cached_tokens``) real token ids,
rendered by the same rules as the router's (``controlplane.protocol.tokenizer.hf_*``, vLLM's), and
advertises the folder as its membership ``tokenizer``: the router loads the same folder, so its
predicted overlap still equals the engine's ``cached_tokens``. Generated tokens cycle through the
ids of ``" a b c … z"``, so answers decode to text that replays as the same tokens in most
tokenizers.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from controlplane.protocol import tokenizer as protocol_tokenizer


class MockTokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Raises ValueError when the messages cannot be rendered."""

    def decode(self, tokens: Sequence[int]) -> str: ...

    def output_token(self, index: int) -> int: ...


class ByteTokenizer:
    name = protocol_tokenizer.NAME

    def encode(self, text: str) -> list[int]:
        return protocol_tokenizer.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return protocol_tokenizer.encode_chat(messages)

    def decode(self, tokens: Sequence[int]) -> str:
        return protocol_tokenizer.decode(tokens)

    def output_token(self, index: int) -> int:
        return ord("a") + index % 26  # worker.engines.mock.scheduler.output_token


BYTES = ByteTokenizer()


class HfTokenizer:
    def __init__(self, path: str, tok: Any) -> None:
        self.name = path
        self._tok = tok
        out = [int(t) for t in tok.encode(" " + " ".join("abcdefghijklmnopqrstuvwxyz"), add_special_tokens=False)]
        self._cycle = out or [0]

    def encode(self, text: str) -> list[int]:
        return protocol_tokenizer.hf_prompt_ids(self._tok, text)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        try:
            return protocol_tokenizer.hf_chat_ids(self._tok, messages)
        except Exception as exc:
            raise ValueError(f"the chat template of {self.name} cannot render these messages: {exc}") from exc

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self._tok.decode(list(tokens), skip_special_tokens=True))

    def output_token(self, index: int) -> int:
        return self._cycle[index % len(self._cycle)]


def load_tokenizer(setting: str) -> MockTokenizer:
    """``""`` or ``rudder-bytes``: bytes; else a local model folder. Raises ValueError naming the
    setting when the folder is missing or cannot be loaded (start-up stops)."""
    if setting in ("", protocol_tokenizer.NAME):
        return BYTES
    field = "RUDDER_MOCK__TOKENIZER"
    if not os.path.isdir(setting):
        raise ValueError(f"{field}={setting!r} is not a local model folder")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise ValueError(f"{field}: transformers is not installed (pip install 'rudder[vllm]')") from exc
    try:
        tok = transformers.AutoTokenizer.from_pretrained(setting, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"{field}={setting!r} failed to load: {exc}") from exc
    return HfTokenizer(os.path.abspath(setting), tok)
