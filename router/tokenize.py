"""The tokenizer seam: prompt → token ids, chosen by the workers' membership ``tokenizer``.

- ``rudder-bytes`` (the mock engine's) is built in.
- A local folder path (what the vLLM engine advertises: its model folder) is loaded with
  ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)`` (``HF_HUB_OFFLINE``),
  once per path, in a thread, and cached by :class:`TokenizerRegistry`. Chat requests are rendered
  with the folder's chat template (``apply_chat_template(messages, add_generation_prompt=True,
  tokenize=True)``) and completions encoded with ``add_special_tokens=True``, as vLLM does, so
  the router hashes the very tokens the engine caches.
- Anything else (several tokenizers for one model, a hub name, a folder that fails to load,
  ``transformers`` not installed) falls back to :class:`EstimatingTokenizer`: no token ids, so no
  prefix hashes and no predicted overlap, and a prompt length estimated at 4 bytes a token, which
  keeps load-based selection meaningful. Each such fallback is logged once.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from controlplane.protocol import tokenizer as byte_tokenizer
from controlplane.protocol.errors import InvalidRequest

log = logging.getLogger(__name__)


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
_BYTE_NAMES = frozenset({byte_tokenizer.NAME})


class HfTokenizer:
    """A Hugging Face tokenizer loaded from a local model folder (the vLLM engine's)."""

    def __init__(self, path: str, tokenizer: Any) -> None:
        self.name = path
        self._tok = tokenizer
        self._warned = False

    def chat(self, messages: Any) -> tuple[list[int], int]:
        try:
            ids = byte_tokenizer.hf_chat_ids(self._tok, _check_messages(messages))
        except Exception as exc:
            # No template, jinja2 missing, or messages the template refuses: route on an
            # estimate and let the engine judge the request.
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "chat template of %s failed (%r): prompt length estimated", self.name, exc)
            return ESTIMATE.chat(messages)
        return ids, len(ids)

    def prompt(self, prompt: Any) -> tuple[list[int], int]:
        parts = _prompt_parts(prompt)
        if parts and isinstance(parts[0], int):
            return [int(t) for t in parts], len(parts)
        if len(parts) != 1:  # a batch of prompts: no single token sequence to hash
            return ESTIMATE.prompt(prompt)
        ids = byte_tokenizer.hf_prompt_ids(self._tok, str(parts[0]))
        return ids, len(ids)


def load_hf_tokenizer(path: str) -> Tokenizer:
    """Load the tokenizer of a local model folder, or the estimate (logged) when it cannot be.
    Blocking (imports transformers, reads files): call it in a thread."""
    if not os.path.isdir(path):
        log.warning("tokenizer %r is not a local folder: prompt lengths are estimated", path)
        return ESTIMATE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        log.warning(
            "tokenizer %s: transformers is not installed (pip install 'rudder[vllm]'): prompt "
            "lengths are estimated and no prefix is predicted", path,
        )
        return ESTIMATE
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        log.warning("tokenizer %s failed to load (%s): prompt lengths are estimated", path, exc)
        return ESTIMATE
    log.info("tokenizer loaded from %s (%s)", path, type(tok).__name__)
    return HfTokenizer(path, tok)


class TokenizerRegistry:
    """The tokenizer for a model's workers, each loaded once per name, off the event loop.

    :meth:`prewarm` starts loads for names seen in the discovery snapshot; :meth:`get` awaits a
    load in progress, so a request is never tokenized with a guess while the real tokenizer is
    a moment away."""

    def __init__(self) -> None:
        self._ready: dict[str, Tokenizer] = {byte_tokenizer.NAME: BYTES}
        self._loading: dict[str, asyncio.Future[Tokenizer]] = {}

    def _start(self, name: str) -> asyncio.Future[Tokenizer]:
        fut = asyncio.get_running_loop().run_in_executor(None, load_hf_tokenizer, name)
        self._loading[name] = fut

        def done(f: asyncio.Future[Tokenizer]) -> None:
            self._loading.pop(name, None)
            if f.cancelled():
                return
            exc = f.exception()
            if exc is not None:
                log.error("tokenizer %s: loader failed: %r", name, exc)
                self._ready[name] = ESTIMATE
            else:
                self._ready[name] = f.result()

        fut.add_done_callback(done)
        return fut

    def prewarm(self, names: Iterable[str]) -> None:
        """Start loading every name not loaded or loading yet (needs a running loop)."""
        for name in names:
            if name not in self._ready and name not in self._loading:
                self._start(name)

    def loaded(self, name: str) -> Tokenizer | None:
        return self._ready.get(name)

    def ready(self, names: frozenset[str]) -> Tokenizer | None:
        """What :meth:`get` answers without waiting, else None (a tokenizer still to load)."""
        if names == _BYTE_NAMES:
            return BYTES
        if len(names) != 1:
            return ESTIMATE
        (name,) = names
        return self._ready.get(name)

    async def get(self, names: frozenset[str]) -> Tokenizer:
        """The tokenizer every worker of a model shares; the estimate when they differ."""
        tok = self.ready(names)
        if tok is not None:
            return tok
        (name,) = names
        fut = self._loading.get(name) or self._start(name)
        return await asyncio.shield(fut)
