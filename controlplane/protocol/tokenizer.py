"""The mock engine's tokenizer (``rudder-bytes``), shared by the mock worker and the router.

Deterministic and reversible: token ids are the UTF-8 bytes of the text (0..255). Chat messages
are rendered with a fixed template before encoding, so a router predicts exactly the tokens the
mock engine caches. A real engine (vLLM) uses its Hugging Face tokenizer instead; the router loads
that from the model folder named in the worker's membership record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

NAME = "rudder-bytes"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return str(content)


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    parts = [f"<|{m.get('role', 'user')}|>\n{_content_text(m.get('content'))}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
    return bytes(t & 0xFF for t in tokens).decode("utf-8", errors="replace")


def encode_chat(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    return encode(render_chat(messages))
