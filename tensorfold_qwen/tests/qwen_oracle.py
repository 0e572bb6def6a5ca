"""The HF transformers oracle for the qwen family's tests, and the helpers that drive our model the same way.

transformers is imported lazily, inside these helpers, after each test has moved into its own tmp_path: HF probes
optional kernels (`fla`, `causal_conv1d`) with importlib, so a folder named like one in the working directory
would fool it.

Checkpoints are written by transformers itself, in the layout of each served model type:

    qwen3_5_text, qwen3_5_moe_text   Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM         weights model.layers.*
    qwen3_5, qwen3_5_moe             Qwen3_5ForConditionalGeneration / ...Moe...         model.language_model.*,
                                     with a tiny vision tower (model.visual.*) and two mtp.* tensors added

HF's own init (std 0.02, zero norms, A_log up to log 16) gives near-flat logits; every weight is drawn again with
the family's own rule (`plugin.draw`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.kv import KvStore, WindowStore
from tensorfold.testing.kit import every_row, greedy
from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold_qwen import plugin
from tensorfold_qwen.load import load
from tensorfold_qwen.model import QwenModel

PROMPT = 64
GREEDY = 32
VOCAB = 512

TEXT = dict(vocab_size=VOCAB, hidden_size=64, rms_norm_eps=1e-6, max_position_embeddings=4096)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=16, patch_size=4, temporal_patch_size=2)
MTP = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,)}     # a stand-in for the MTP head real checkpoints hold


def transformers_module():
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def hf_checkpoint(directory: Path, model_type: str, seed: int, rope_theta: float = 10000.0,
                  partial_rotary_factor: float = 0.25, tie: bool = False, **fields: Any) -> Path:
    """A tiny random Qwen3.5 of `model_type`, written by transformers (config, safetensors, tokenizer)."""
    transformers = transformers_module()
    specials = write_tiny_tokenizer(directory, VOCAB)
    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                                       "partial_rotary_factor": partial_rotary_factor},
                tie_word_embeddings=tie, bos_token_id=specials["<|endoftext|>"],
                eos_token_id=specials["<|im_end|>"], pad_token_id=specials["<|endoftext|>"], **fields)
    moe = "moe" in model_type
    if model_type.endswith("_text"):
        config = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(**text)
        model = (transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM)(config)
    else:
        config = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
            text_config=text, vision_config=VISION, tie_word_embeddings=tie)
        model = (transformers.Qwen3_5MoeForConditionalGeneration if moe
                 else transformers.Qwen3_5ForConditionalGeneration)(config)
    redraw(model, seed)
    model.save_pretrained(directory)
    if not model_type.endswith("_text"):
        add_mtp(directory, seed)
    assert Checkpoint(directory).model_type == model_type
    return directory


def redraw(model: Any, seed: int) -> None:
    """Every parameter drawn again with the family's rule, in name order, from one generator."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(plugin.draw(name, param.shape, generator))


def add_mtp(directory: Path, seed: int) -> None:
    """Add a couple of `mtp.*` tensors, as the published VL checkpoints carry (HF ignores them too)."""
    path = directory / "model.safetensors"
    weights = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    weights.update({name: torch.randn(shape, generator=generator) for name, shape in MTP.items()})
    save_file(weights, str(path), metadata={"format": "pt"})


def hf_model(directory: Path, dtype: torch.dtype = torch.float32, attention: str = "eager"):
    """The checkpoint as transformers loads it (the VL container as its own class), ready to decode greedily."""
    transformers = transformers_module()
    model_type = Checkpoint(directory).model_type
    if model_type.endswith("_text"):
        cls = transformers.AutoModelForCausalLM
    else:
        cls = (transformers.Qwen3_5MoeForConditionalGeneration if "moe" in model_type
               else transformers.Qwen3_5ForConditionalGeneration)
    model = cls.from_pretrained(directory, dtype=dtype, attn_implementation=attention)
    model.eval()
    model.generation_config.eos_token_id = None   # decode the full length; never stop early
    return model


def prompt_tokens(seed: int, length: int = PROMPT) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- driving our model

def ours(directory: Path, dtype: torch.dtype = torch.float32) -> QwenModel:
    return load(Checkpoint(directory), dtype, torch.device("cpu"), progress=False)


def store(directory: Path, dtype: torch.dtype = torch.float32, slots: int = 2,
          capacity: int = PROMPT + GREEDY + 1) -> KvStore:
    """Memory as the engine would hold it, from the family's own Layout for this checkpoint, poisoned."""
    layout = plugin.family_kv_layout(config=Checkpoint(directory).config, dtype=dtype)
    return WindowStore(layout, slots, capacity, poison=True)


def compare_with_hf(directory: Path, label: str, tolerance: float = 1e-4) -> float:
    """Our logits vs HF's at every prompt position, and 32 greedy tokens vs HF's generate; returns the max-abs
    difference to HF eager.

    HF eager attention does the arithmetic in our order and is held to `tolerance`. HF's default, sdpa, is itself
    up to ~1e-4 away from HF eager on some configs (a 1e-6 change in layer 0 grows through the layers), so ours
    is held to `tolerance` plus HF's own eager-sdpa gap.
    """
    tokens = prompt_tokens(seed=1)
    ids = torch.tensor([tokens])
    logits = every_row(ours(directory), store(directory), tokens, cuts=[])           # [PROMPT, V]
    references, models = {}, {}
    for attention in ("eager", "sdpa"):
        models[attention] = hf_model(directory, attention=attention)
        with torch.no_grad():
            references[attention] = models[attention](ids).logits[0].float()         # [PROMPT, V]
        assert logits.shape == references[attention].shape
    diffs = {name: float((logits - reference).abs().max()) for name, reference in references.items()}
    gap = float((references["eager"] - references["sdpa"]).abs().max())
    spread = float(references["eager"].std(dim=-1).mean())
    print(f"\n[qwen vs HF] {label}: max |logits - HF| over {PROMPT} positions: eager {diffs['eager']:.2e}, "
          f"sdpa {diffs['sdpa']:.2e} (HF eager vs sdpa {gap:.2e}; logit std {spread:.2f})")
    assert spread > 0.3, f"{label}: HF's logits are nearly flat (std {spread:.3f}); the test would prove little"
    assert diffs["eager"] <= tolerance, f"{label}: logits differ from HF eager by {diffs['eager']:.3e}"
    assert diffs["sdpa"] <= tolerance + gap, f"{label}: logits differ from HF sdpa by {diffs['sdpa']:.3e}"

    with torch.no_grad():
        hf_tokens = models["eager"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY,
                                              do_sample=False)[0, PROMPT:].tolist()
    assert len(hf_tokens) == GREEDY
    mine = greedy(ours(directory), store(directory), tokens, GREEDY)
    assert mine == hf_tokens, f"{label}: greedy tokens differ from HF:\n ours {mine}\n HF   {hf_tokens}"
    return diffs["eager"]
