"""The HF transformers oracle for the nemotron family's tests, and the helpers that drive our model the same way.

transformers is imported lazily, inside these helpers, after each test has moved into its own tmp_path: HF probes
optional kernels (`mamba_ssm`, `causal_conv1d`) with importlib, so a folder named like one in the working directory
would fool it.

Checkpoints are written by transformers itself (`NemotronHForCausalLM.save_pretrained`: `backbone.*`, experts one by
one). HF's own init (std 0.02, A_log up to log MH, dt up to 0.1) gives near-flat logits; every weight is drawn again
with the family's own rule (`plugin.draw`), the router's correction bias (a buffer) included.

The dt policy: HF's mixer clamps dt to (time_step_min, inf) in its multi-token path and not at all in its one-token
path. Every HF model here has each Mamba2 mixer's `time_step_limit` set to the config's `time_step_limit`, the
policy the family applies in every path; HF's one-token path still never clamps, so a config whose limit can bind
takes its greedy reference from whole-sequence forwards (`hf_greedy`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.kv import KvStore, WindowStore
from tensorfold.testing.kit import every_row, greedy
from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold_nemotron import plugin
from tensorfold_nemotron.config import time_step_limit
from tensorfold_nemotron.load import load
from tensorfold_nemotron.model import NemotronModel

PROMPT = 64
GREEDY = 32
VOCAB = 512

BASE = dict(vocab_size=VOCAB, hidden_size=64, layer_norm_epsilon=1e-5, max_position_embeddings=4096,
            mlp_hidden_act="relu2", mamba_hidden_act="silu", conv_kernel=4, use_conv_bias=True, chunk_size=128)


def transformers_module():
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def hf_checkpoint(directory: Path, seed: int, **fields: Any) -> Path:
    """A tiny random Nemotron-H written by transformers (config, safetensors, tokenizer)."""
    transformers = transformers_module()
    specials = write_tiny_tokenizer(directory, VOCAB)
    config = transformers.NemotronHConfig(**{**BASE, **fields}, bos_token_id=specials["<|endoftext|>"],
                                          eos_token_id=specials["<|im_end|>"], pad_token_id=specials["<|endoftext|>"])
    model = transformers.NemotronHForCausalLM(config)
    redraw(model, seed)
    model.save_pretrained(directory)
    assert Checkpoint(directory).model_type == "nemotron_h"
    return directory


def redraw(model: Any, seed: int) -> None:
    """Every parameter and the routers' correction biases drawn again with the family's rule, in name order."""
    generator = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update({name: b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")})
    with torch.no_grad():
        for name, tensor in sorted(tensors.items()):
            tensor.copy_(plugin.draw(name, tensor.shape, generator))


def apply_dt_policy(model: Any) -> None:
    """Each Mamba2 mixer's dt clamp set to the config's time_step_limit: the family's policy (module docstring)."""
    limit = time_step_limit(model.config.to_dict())
    for layer in model.model.layers:
        if hasattr(layer.mixer, "time_step_limit"):
            layer.mixer.time_step_limit = limit


def hf_model(directory: Path, dtype: torch.dtype = torch.float32, attention: str = "eager"):
    """The checkpoint as transformers loads it, its dt policy patched, ready to decode greedily."""
    transformers = transformers_module()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=attention)
    model.eval()
    apply_dt_policy(model)
    model.generation_config.eos_token_id = None   # decode the full length; never stop early
    return model


def hf_oracle(directory: Path) -> Callable[[Sequence[int]], torch.Tensor]:
    """The kit's oracle (tensorfold.testing.kit.Oracle): HF's float32 logits at every position of a token list, from
    one whole-sequence forward (its dt policy patched)."""
    model = hf_model(directory)

    def every(tokens: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([list(tokens)]), use_cache=False).logits[0].float()

    return every


def limit_binds(directory: Path) -> bool:
    """Whether the config's time_step_limit can clamp a softplus (anything but [0, inf))."""
    low, high = time_step_limit(Checkpoint(directory).config)
    return low > 0 or not math.isinf(high)


def hf_greedy(model: Any, tokens: list[int], steps: int) -> list[int]:
    """Greedy tokens from whole-sequence forwards without a cache (HF's multi-token path, its clamp patched)."""
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(tokens):]


def prompt_tokens(seed: int, length: int = PROMPT) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- driving our model

def ours(directory: Path, dtype: torch.dtype = torch.float32) -> NemotronModel:
    return load(Checkpoint(directory), dtype, torch.device("cpu"), progress=False)


def store(directory: Path, dtype: torch.dtype = torch.float32, slots: int = 2,
          capacity: int = PROMPT + GREEDY + 1) -> KvStore:
    """Memory as the engine would hold it, from the family's own Layout for this checkpoint, poisoned."""
    layout = plugin.family_kv_layout(config=Checkpoint(directory).config, dtype=dtype)
    return WindowStore(layout, slots, capacity, poison=True)


def compare_with_hf(directory: Path, label: str, tolerance: float = 1e-4) -> float:
    """Ours vs HF's one-shot logits at every prompt position, run one-shot, chunked (on and off the scan grid) and
    token by token; and 32 greedy tokens vs HF's. Returns the largest max-abs difference to HF eager.

    HF eager attention does the arithmetic in our order and is held to `tolerance`; HF's sdpa may sit a little
    away from its eager, so ours is held to `tolerance` plus that gap.
    """
    tokens = prompt_tokens(seed=1)
    ids = torch.tensor([tokens])
    model = ours(directory)
    runs = {"one-shot": [], "chunked": [1, 17, 40, 41], "token by token": list(range(1, PROMPT))}
    logits = {name: every_row(model, store(directory), tokens, cuts=cuts) for name, cuts in runs.items()}
    references, models = {}, {}
    for attention in ("eager", "sdpa"):
        models[attention] = hf_model(directory, attention=attention)
        with torch.no_grad():
            references[attention] = models[attention](ids).logits[0].float()         # [PROMPT, V]
    gap = float((references["eager"] - references["sdpa"]).abs().max())
    spread = float(references["eager"].std(dim=-1).mean())
    diffs = {name: float((found - references["eager"]).abs().max()) for name, found in logits.items()}
    vs_sdpa = float((logits["one-shot"] - references["sdpa"]).abs().max())
    print(f"\n[nemotron vs HF] {label}: max |logits - HF eager| over {PROMPT} positions: "
          + ", ".join(f"{name} {d:.2e}" for name, d in diffs.items())
          + f"; one-shot vs sdpa {vs_sdpa:.2e} (HF eager vs sdpa {gap:.2e}; logit std {spread:.2f})")
    assert spread > 0.3, f"{label}: HF's logits are nearly flat (std {spread:.3f}); the test would prove little"
    for name, diff in diffs.items():
        assert logits[name].shape == references["eager"].shape
        assert diff <= tolerance, f"{label}: {name} logits differ from HF eager by {diff:.3e}"
    assert vs_sdpa <= tolerance + gap, f"{label}: logits differ from HF sdpa by {vs_sdpa:.3e}"

    if limit_binds(directory):
        hf_tokens = hf_greedy(models["eager"], tokens, GREEDY)
    else:
        with torch.no_grad():
            hf_tokens = models["eager"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY,
                                                 do_sample=False)[0, PROMPT:].tolist()
    assert len(hf_tokens) == GREEDY
    mine = greedy(model, store(directory), tokens, GREEDY)
    assert mine == hf_tokens, f"{label}: greedy tokens differ from HF:\n ours {mine}\n HF   {hf_tokens}"
    return max(diffs.values())
