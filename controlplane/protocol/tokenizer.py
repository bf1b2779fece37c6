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


# -- Hugging Face tokenizers (a local model folder) ----------------------------------------------
# The rules by which vLLM turns a request into token ids, shared by the router (router/tokenize.py)
# and the mock engine (worker/engines/mock/tokenizer.py) so that both count and hash the very same
# tokens. ``tok`` is a ``transformers`` tokenizer; this module never imports transformers.


def as_text_content(message: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's "string" content format: text parts of a content array joined with newlines."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return out


def template_ids(out: Any) -> list[int]:
    """Token ids from ``apply_chat_template``: a list (transformers 4) or a dict-like
    ``BatchEncoding`` with ``input_ids`` (transformers 5)."""
    ids = out if isinstance(out, list) else out["input_ids"]
    if ids and isinstance(ids[0], list):  # a batch of one conversation
        ids = ids[0]
    return [int(t) for t in ids]


def hf_chat_ids(tok: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """A chat rendered with the folder's template, generation prompt added, as vLLM does.
    Raises whatever the template raises (no template, jinja2 missing, refused messages)."""
    msgs = [as_text_content(m) for m in messages]
    return template_ids(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))


def hf_prompt_ids(tok: Any, text: str) -> list[int]:
    """A completions prompt, special tokens added (BOS), as vLLM does."""
    return [int(t) for t in tok.encode(text, add_special_tokens=True)]
