"""The HF transformers oracle for the glm family's tests, and the helpers that drive our model the same way.

transformers is imported lazily, inside these helpers, after each test has moved into its own tmp_path: HF probes
optional kernels (`fla`, `causal_conv1d`) with importlib, so a folder named like one in the working directory
would fool it.

Checkpoints are written by transformers itself: Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=…,
vision_config=tiny)).save_pretrained, i.e. `model.language_model.*` + `lm_head.weight` in the original checkpoint
spelling, with a tiny vision tower (`model.visual.*`). HF's own init (std 0.02, zero ape, gate of ones) gives
near-flat logits and tied index scores, so every saved tensor is drawn again by its checkpoint name with the
family's own rule (`plugin.draw`: N(0, 1/fan_in) matrices, the indexer's gate and ape included) and the
safetensors file is rewritten; an MTP layer (`layers.{N}.*`, N = num_hidden_layers) and `shared_head` tensors
are added, as published checkpoints carry them (HF reports and drops them; our loader skips them).

DSA top-k: torch.topk orders tied scores by the tensor's width, so HF's one-shot, chunked and cached selections
differ where the k-th and (k+1)-th candidate pools tie (hf-reference.md §6.2); `index_margins` measures the gap
at the cut with our own indexer functions, and the tests only compare configs and seeds that keep it wide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.kv import KvStore, PagedStore, WindowStore
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.testing.kit import every_row, greedy
from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold_glm import indexer, plugin
from tensorfold_glm.config import GlmConfig
from tensorfold_glm.load import load
from tensorfold_glm.model import GlmModel

PROMPT = 64
GREEDY = 32
VOCAB = 512
PAGE_ROWS = 16                       # a multiple of every kpool used here
MARGIN = 1e-4                        # the least gap at the top-k cut that the comparisons rely on

VISION = plugin.TINY_CONFIG["vision_config"]
NOT_TEXT = ("model_type", "architectures", "vision_config", "dtype")
TEXT = {k: v for k, v in plugin.TINY_CONFIG.items() if k not in NOT_TEXT}


def mtp_tensors(layers: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """A stand-in for the MTP layer real checkpoints hold after the last decoder layer, with its shared_head."""
    mtp = f"model.language_model.layers.{layers}."
    return {mtp + "eh_proj.weight": (hidden, 2 * hidden), mtp + "enorm.weight": (hidden,),
            mtp + "hnorm.weight": (hidden,), mtp + "input_layernorm.weight": (hidden,),
            mtp + "self_attn.q_a_proj.weight": (32, hidden), mtp + "shared_head.norm.weight": (hidden,),
            mtp + "shared_head.head.weight": (VOCAB, hidden)}


def transformers_module():
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def hf_checkpoint(directory: Path, seed: int, tie: bool = False, mtp: bool = True, **fields: Any) -> Path:
    """A tiny random GLM-5.3-Flash written by transformers (config, safetensors, tokenizer); `fields` change the
    tiny text config."""
    transformers = transformers_module()
    specials = write_tiny_tokenizer(directory, VOCAB)
    text = {**TEXT, "bos_token_id": specials["<|endoftext|>"], "eos_token_id": specials["<|im_end|>"],
            "pad_token_id": specials["<|endoftext|>"], "tie_word_embeddings": tie, **fields}
    config = transformers.Glm5NextConfig(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
    transformers.Glm5NextForConditionalGeneration(config).save_pretrained(directory)
    redraw(directory, seed, mtp)
    assert Checkpoint(directory).model_type == "glm5_next"
    return directory


def redraw(directory: Path, seed: int, mtp: bool) -> None:
    """Every saved tensor drawn again by its name with the family's rule, in name order, from one generator."""
    path = directory / "model.safetensors"
    saved = load_file(path)
    if mtp:
        c = GlmConfig.from_dict(Checkpoint(directory).config)
        saved.update({name: torch.empty(shape) for name, shape in mtp_tensors(c.layers, c.hidden_size).items()})
    generator = torch.Generator().manual_seed(seed)
    weights = {name: plugin.draw(name, saved[name].shape, generator) for name in sorted(saved)}
    save_file(weights, str(path), metadata={"format": "pt"})


def hf_model(directory: Path, dtype: torch.dtype = torch.float32, attention: str = "eager"):
    """The checkpoint as transformers loads it, ready to decode greedily to the full length."""
    transformers = transformers_module()
    model = transformers.Glm5NextForConditionalGeneration.from_pretrained(directory, dtype=dtype,
                                                                          attn_implementation=attention)
    model.eval()
    model.generation_config.eos_token_id = None   # decode the full length; never stop early
    return model


def hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """HF's one-shot logits of every position: float32 [len(tokens), V]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(model: Any, tokens: list[int], steps: int = GREEDY) -> list[int]:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False)
    return out[0, len(tokens):].tolist()


def prompt_tokens(seed: int, length: int = PROMPT) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- driving our model

def ours(directory: Path, dtype: torch.dtype = torch.float32) -> GlmModel:
    return load(Checkpoint(directory), dtype, torch.device("cpu"), progress=False)


def store(directory: Path, dtype: torch.dtype = torch.float32, paged: bool = False, slots: int = 2,
          capacity: int = PROMPT + GREEDY + 1) -> KvStore:
    """Memory as the engine would hold it, from the family's own Layout for this checkpoint, poisoned; paged: the
    slots' pages handed out in a scrambled order."""
    layout = plugin.family_kv_layout(config=Checkpoint(directory).config, dtype=dtype)
    if not paged:
        return WindowStore(layout, slots, capacity, poison=True)
    per_slot = -(-capacity // PAGE_ROWS)
    kv = PagedStore(layout, slots, slots * per_slot, PAGE_ROWS, poison=True)
    order = torch.randperm(slots * per_slot, generator=torch.Generator().manual_seed(5)).tolist()
    for slot in range(slots):
        kv.bind(slot, order[slot * per_slot:(slot + 1) * per_slot])
    kv.fill(order)
    return kv


@contextlib.contextmanager
def recorded_scores() -> Iterator[list[tuple[torch.Tensor, int]]]:
    """Every (index scores [T, N], start) our full indexers compute while the block runs, in call order."""
    found: list[tuple[torch.Tensor, int]] = []
    original = indexer.top_pools

    def top_pools(scores: torch.Tensor, start: int, d: indexer.IndexerDims) -> torch.Tensor:
        found.append((scores.clone(), start))
        return original(scores, start, d)

    with mock.patch.object(indexer, "top_pools", top_pools):
        yield found


def index_margins(model: GlmModel, tokens: list[int]) -> tuple[float, int]:
    """The least gap between the k-th and (k+1)-th candidate pool's score over every query row and full indexer
    of a one-shot run, and how many (row, layer) pairs had more candidates than k (a real selection)."""
    kv = WindowStore(plugin.kv_layout(model.config, "float32"), 1, len(tokens) + 1)
    d = model.mla_dims.index
    with recorded_scores() as found:
        model.forward_all(StepPlan([StreamStep(0, 0, tokens)]), kv)
    least, cuts = float("inf"), 0
    k = d.pools_kept
    for scores, start in found:
        T, N = scores.shape
        positions = torch.arange(start, start + T)[:, None]
        candidate = torch.arange(N)[None, :] * d.kpool + d.kpool - 1 <= positions         # [T, N]
        ranked = scores.masked_fill(~candidate, float("-inf")).sort(dim=-1, descending=True).values
        cut = candidate.sum(-1) > k                                                       # rows with a real cut
        if cut.any():
            cuts += int(cut.sum())
            least = min(least, float((ranked[cut, k - 1] - ranked[cut, k]).min()))
    return least, cuts


# ---------------------------------------------------------------- the comparison

def compare_with_hf(directory: Path, label: str, paged: bool = False, selects: bool = True,
                    tolerance: float = 1e-4) -> dict[str, float]:
    """Ours vs HF in float32 on one checkpoint; returns the measured max-abs differences.

    - one-shot prefill of 64 tokens: logits at every position vs HF eager within `tolerance`, vs HF sdpa within
      `tolerance` plus HF's own eager-sdpa gap;
    - the same prompt prefilled in uneven pieces, the last 24 tokens one per step: every position vs HF one-shot;
    - 32 greedy tokens (prefill, then one token per step) identical to HF's generate;
    - the DSA selection: over prompt and HF's greedy tokens, `selects` real top-k cuts happen and every cut has a
      gap > MARGIN (else none happens: select-all).
    """
    tokens = prompt_tokens(seed=1)
    model = ours(directory)
    eager = hf_model(directory)
    references = {"eager": hf_logits(eager, tokens), "sdpa": hf_logits(hf_model(directory, attention="sdpa"), tokens)}
    hf_tokens = hf_greedy(eager, tokens)
    assert len(hf_tokens) == GREEDY

    least, cuts = index_margins(model, tokens + hf_tokens)
    if selects:
        assert cuts > 0, f"{label}: no query has more candidate pools than the top-k keeps"
        assert least > MARGIN, f"{label}: DSA scores nearly tie at the top-k cut (gap {least:.2e}); pick a seed"
    else:
        assert cuts == 0, f"{label}: expected select-all, but {cuts} rows cut"

    one_shot = every_row(model, store(directory, paged=paged), tokens, cuts=[])               # [PROMPT, V]
    cuts_at = [5, 17, 40, *range(41, PROMPT)]                   # uneven pieces, then one token per step
    pieces = every_row(model, store(directory, paged=paged), tokens, cuts=cuts_at, slot=1)
    diffs = {name: float((one_shot - ref).abs().max()) for name, ref in references.items()}
    diffs["pieces"] = float((pieces - references["eager"]).abs().max())
    gap = float((references["eager"] - references["sdpa"]).abs().max())
    spread = float(references["eager"].std(dim=-1).mean())
    margin = f"top-k gap {least:.2e} over {cuts} cut rows" if cuts else "select-all"
    print(f"\n[glm vs HF] {label}: max |logits - HF| over {PROMPT} positions: eager {diffs['eager']:.2e}, "
          f"sdpa {diffs['sdpa']:.2e} (HF eager vs sdpa {gap:.2e}); in pieces then token by token "
          f"{diffs['pieces']:.2e}; logit std {spread:.2f}; {margin}")
    assert one_shot.shape == references["eager"].shape
    assert spread > 0.3, f"{label}: HF's logits are nearly flat (std {spread:.3f}); the test would prove little"
    assert diffs["eager"] <= tolerance, f"{label}: logits differ from HF eager by {diffs['eager']:.3e}"
    assert diffs["sdpa"] <= tolerance + gap, f"{label}: logits differ from HF sdpa by {diffs['sdpa']:.3e}"
    assert diffs["pieces"] <= tolerance, f"{label}: pieces/decode differ from HF one-shot by {diffs['pieces']:.3e}"

    mine = greedy(model, store(directory, paged=paged), tokens, GREEDY)
    assert mine == hf_tokens, f"{label}: greedy tokens differ from HF:\n ours {mine}\n HF   {hf_tokens}"
    return diffs
