"""A tiny Hugging Face tokenizer folder, built locally (no download): a byte-level BPE trained on
the repository's own docs, saved as a ``PreTrainedTokenizerFast`` with a BOS post-processor and a
simple chat template, as a model folder served by vLLM would hold it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer_folder(path: Path, *, vocab_size: int = 400) -> Path:
    """Train and save the tokenizer into ``path`` (created). Needs ``tokenizers`` and
    ``transformers`` (the ``vllm`` extra)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))] + [(ROOT / "README.md").read_text()]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path
