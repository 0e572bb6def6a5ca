"""The files of a family's tiny HF checkpoint (`family_make_tiny`), written without transformers: the tiny
tokenizer, config.json and generation_config.json that name its special tokens, and weights drawn from one seed.

`draw_weight` is the default weight rule (docs/writing-a-family.md, family_make_tiny): activations stay at unit
scale, so logits are far from flat, and an SSM neither forgets everything within a token or two nor never forgets,
so a resumed state has something to carry.
"""

from __future__ import annotations

import json
import math
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


def draw_weight(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """One float32 weight by its name and shape:

    A_log      log U(0.1, 1): A = exp(A_log) between 0.1 and 1
    dt_bias    -2 + 0.5·N(0, 1): at its mean, dt = softplus(x - 2) is 0.05 to 0.31 for an input x within ±1,
               so a token keeps e^(-A·dt) of the state it is handed: 73% to 99.5%, a memory of tens of tokens
               (a norm's rule, 1 + 0.1·N for both, keeps about 3%: the state is gone within two tokens and a
               resumed one carries nothing a test can see; HF's init keeps nearly all of it, which hides as much)
    a conv     N(0, 1/fan_in), fan_in = prod(shape[1:]): K for a depthwise conv1d [C, 1, K], never a norm's rule
    2+ dims    N(0, 1/fan_in), fan_in = the last dim: matrices, embeddings, stacked experts [E, out, in]
    *.bias     0.1·N(0, 1)
    other 1-D  1 + 0.1·N(0, 1): norm weights (one that scales by 1 + w wants 0.1·N: override it), Mamba's D
    """
    if name.endswith("A_log"):
        return (0.1 + 0.9 * torch.rand(shape, generator=generator)).log()
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("dt_bias"):
        return -2.0 + 0.5 * noise
    if len(shape) >= 2:
        module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]          # "conv1d" of "….mixer.conv1d.weight"
        fan_in = math.prod(shape[1:]) if "conv" in module else shape[-1]
        return noise * fan_in ** -0.5
    if name.endswith(".bias"):
        return 0.1 * noise
    return 1.0 + 0.1 * noise


def write_tiny_weights(directory: Path, shapes: Mapping[str, Sequence[int]], draw: Draw = draw_weight,
                       seed: int = 0) -> None:
    """model.safetensors with each tensor `draw(name, shape, generator)`, drawn in name order from one generator
    seeded with `seed`, so one seed writes the same bytes."""
    generator = torch.Generator().manual_seed(seed)
    weights = {name: draw(name, tuple(shapes[name]), generator) for name in sorted(shapes)}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
