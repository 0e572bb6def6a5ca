"""A small deterministic tokenizer and ChatML template that any family's tiny checkpoint can ship."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A conversation is kept, never prefilled twice. "
    "Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is. "
    "user assistant system You are a helpful assistant. Tell me a story about a cat and a model. "
    "one two three four five six seven eight nine ten 0123456789 + - * / = ( ) [ ] { } , . ; : ! ? "
    "Kept states live on the device, in pinned host memory and on disk across restarts. Resume, do not recompute. "
    "Mamba layers carry a recurrent state; attention layers grow a cache of keys and values, page by page. "
    "Why is the sky blue? Because air scatters short waves more than long ones. Write a poem about the sea. "
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June July "
)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on a fixed text to exactly `vocab_size` ids (specials first)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = CORPUS.split()
    lines = [CORPUS] + [" ".join(words[i::k]) for k in range(2, 9) for i in range(k)]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the fixed text yields {tokenizer.get_vocab_size()} ids, not {vocab_size}")
    return tokenizer


def write_tiny_tokenizer(directory: Path, vocab_size: int) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json (with the template); return the special tokens' ids."""
    tokenizer = build_tokenizer(vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "chat_template": CHATML, "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {token: tokenizer.token_to_id(token) for token in SPECIALS}
