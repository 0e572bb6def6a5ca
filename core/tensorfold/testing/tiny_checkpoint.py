"""The files of a family's tiny HF checkpoint (`family_make_tiny`), written without transformers: the tiny
tokenizer, config.json and generation_config.json that name its special tokens, and weights drawn from one seed."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer

Draw = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]


def write_tiny_config(directory: Path, config: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """Write the tiny tokenizer, config.json and generation_config.json; return the config as written.

    The tokenizer's ids become bos, eos (`<|im_end|>`, where a chat turn ends) and pad; `changes` then replace
    fields, and a field that is None is left out."""
    specials = write_tiny_tokenizer(directory, config["vocab_size"])
    written = {**config, "bos_token_id": specials["<|endoftext|>"], "eos_token_id": specials["<|im_end|>"],
               "pad_token_id": specials["<|endoftext|>"], **changes}
    written = {key: value for key, value in written.items() if value is not None}
    (directory / "config.json").write_text(json.dumps(written, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": specials["<|im_end|>"]}, indent=2))
    return written


def write_tiny_weights(directory: Path, shapes: Mapping[str, Sequence[int]], draw: Draw, seed: int) -> None:
    """model.safetensors with each tensor `draw(name, shape, generator)`, drawn in name order from one generator
    seeded with `seed`, so one seed writes the same bytes."""
    generator = torch.Generator().manual_seed(seed)
    weights = {name: draw(name, tuple(shapes[name]), generator) for name in sorted(shapes)}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
