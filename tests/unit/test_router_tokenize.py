"""The router's tokenizer seam with a real (tiny, locally trained) Hugging Face tokenizer folder."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from controlplane.protocol import tokenizer as byte_tokenizer
from router.tokenize import BYTES, ESTIMATE, HfTokenizer, TokenizerRegistry, load_hf_tokenizer
from tests.support_router.hf_tokenizer import build_tokenizer_folder

pytestmark = pytest.mark.timeout(60)

MESSAGES = [
    {"role": "system", "content": "You are a router test."},
    {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tokenizer_folder(tmp_path_factory.mktemp("tok")))


def test_chat_tokens_are_the_chat_template_rendering_as_vllm_tokenizes_it(folder: str) -> None:
    tok = load_hf_tokenizer(folder)
    assert isinstance(tok, HfTokenizer)
    ids, n = tok.chat(MESSAGES)
    ref = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    # vLLM: content parts joined with newlines, template rendered with the generation prompt,
    # tokenized without adding special tokens again (the template carries the BOS).
    flat = [MESSAGES[0], {"role": "user", "content": "hello\nworld"}]
    text = ref.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<s><|system|>") and text.endswith("<|assistant|>\n")
    assert ids == ref.encode(text, add_special_tokens=False)
    assert n == len(ids) and ids[0] == ref.bos_token_id and ids.count(ref.bos_token_id) == 1


def test_completion_prompt_gets_bos_like_vllm_and_token_prompts_pass_through(folder: str) -> None:
    tok = load_hf_tokenizer(folder)
    ref = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids, n = tok.prompt("route this prompt")
    assert ids == ref.encode("route this prompt", add_special_tokens=True)
    assert ids[0] == ref.bos_token_id and n == len(ids)
    assert tok.prompt(["route this prompt"]) == (ids, n)  # a batch of one
    assert tok.prompt([5, 6, 7]) == ([5, 6, 7], 3)
    assert tok.prompt(["a", "b"])[0] == []  # a real batch: estimated


def test_not_a_folder_is_estimated() -> None:
    assert load_hf_tokenizer("meta-llama/not-a-local-folder") is ESTIMATE


def test_transformers_missing_falls_back_to_the_estimate_and_says_so(
    folder: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers → ImportError
    with caplog.at_level(logging.WARNING, logger="router.tokenize"):
        assert load_hf_tokenizer(folder) is ESTIMATE
    assert "transformers is not installed" in caplog.text


async def test_registry_loads_each_folder_once_in_a_thread(folder: str, caplog: pytest.LogCaptureFixture) -> None:
    reg = TokenizerRegistry()
    with caplog.at_level(logging.INFO, logger="router.tokenize"):
        reg.prewarm([folder])
        got = await asyncio.gather(*(reg.get(frozenset({folder})) for _ in range(5)))
        assert await reg.get(frozenset({folder})) is got[0]
    assert all(t is got[0] for t in got) and isinstance(got[0], HfTokenizer)
    loads = [r for r in caplog.records if r.getMessage().startswith("tokenizer loaded from")]
    assert len(loads) == 1  # once, and not on the event loop's thread
    assert loads[0].thread != threading.main_thread().ident
    assert reg.loaded(folder) is got[0]


async def test_registry_names() -> None:
    reg = TokenizerRegistry()
    assert await reg.get(frozenset({byte_tokenizer.NAME})) is BYTES
    assert await reg.get(frozenset()) is ESTIMATE
    assert await reg.get(frozenset({byte_tokenizer.NAME, "/some/folder"})) is ESTIMATE
    assert await reg.get(frozenset({"/no/such/folder"})) is ESTIMATE
    assert reg.loaded("/no/such/folder") is ESTIMATE  # remembered, not retried per request


def test_chat_template_failure_is_estimated(folder: str, tmp_path: Path) -> None:
    tok = load_hf_tokenizer(folder)
    assert isinstance(tok, HfTokenizer)
    ids, n = tok.chat([{"role": "user", "content": "x" * 40, "extra": object()}])
    assert ids and n == len(ids)  # extra keys are fine for this template
    no_template = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    no_template.chat_template = None
    bare = HfTokenizer("bare", no_template)
    assert bare.chat([{"role": "user", "content": "x" * 40}]) == ESTIMATE.chat([{"role": "user", "content": "x" * 40}])
