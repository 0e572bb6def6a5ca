"""The glm family against HF transformers (the oracle): Glm5NextForConditionalGeneration with a tiny vision tower.

fp32, weights re-drawn N(0, 1/fan_in) (the indexer's gate and ape included): logits at every one of 64 prompt
positions within 1e-4 of HF eager (one-shot, and in uneven pieces then token by token), and 32 greedy tokens
identical to HF's generate, on checkpoints HF wrote and on the flat one `plugin.write_tiny` writes. Where the DSA
indexer really selects (kpool 4 / topk 8 or 16), the seed is one whose top-k cut has a score gap > 1e-4 on every
query of every full indexer, so torch.topk's tie order cannot decide HF's selection. Run `pytest -s` to see the
measured differences.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from glm_oracle import (
    compare_with_hf,
    every_row,
    hf_checkpoint,
    hf_logits,
    hf_model,
    mtp_tensors,
    ours,
    prompt_tokens,
    store,
    transformers_module,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold_glm import load as loader
from tensorfold_glm import plugin
from tensorfold_glm.config import GlmConfig
from tensorfold_glm.names import expected_shapes

KDA, MLA = "linear_attention", "indexed_attention"
DENSE, MOE = "dense", "sparse"

# What a GLM-5.3-Flash family can get wrong: the DSA regime (select-all; a real top-2 / top-4 of up to 24 pools),
# an MLA layer first, a shared indexer reusing the previous layer's selection (derived from index_topk_pattern as
# HF derives it), dense and MoE layers in any order, grouped routing, two shared experts, tied embeddings, paged
# memory. (label, seed, paged, selects, fields)
CASES: list[tuple[str, int, bool, bool, dict[str, Any]]] = [
    ("LLLI-DMMM select-all tied n_group2", 0, False, False,
     dict(index_topk=128, tie=True, n_group=2, topk_group=1)),
    ("ILLI-MDMD kpool4 topk8 paged", 0, True, True,
     dict(layer_types=[MLA, KDA, KDA, MLA], mlp_layer_types=[MOE, DENSE, MOE, DENSE], index_topk=8, index_n_heads=8)),
    ("LISL-DMDM kpool4 topk8 shared", 6, False, True,
     dict(layer_types=[KDA, MLA, MLA, KDA], mlp_layer_types=[DENSE, MOE, DENSE, MOE], indexer_types=None,
          index_topk_pattern="FFSF", index_topk=8, n_shared_experts=2)),
]
FLAT_SEED = 9            # write_tiny: LLLI, kpool 4 / topk 16; a seed with a wide top-k gap


@pytest.mark.parametrize("label, seed, paged, selects, fields", CASES, ids=[case[0] for case in CASES])
def test_matches_hf(tmp_path: Path, label: str, seed: int, paged: bool, selects: bool, fields: dict) -> None:
    directory = hf_checkpoint(tmp_path / "ckpt", seed=seed, **fields)
    config = GlmConfig.from_dict(Checkpoint(directory).config)
    assert config.schedule == label[:4] and config.mlp_schedule == label[5:9]
    with safe_open(directory / "model.safetensors", "pt") as f:       # HF's init (zero ape, gate of ones) redrawn
        name = next(n for n in f.keys() if n.endswith("index_kpool_compress_ape"))
        assert f.get_tensor(name).std() > 0.2
    compare_with_hf(directory, label, paged=paged, selects=selects)


def test_own_tiny_checkpoint_loads_in_hf_and_matches(tmp_path: Path) -> None:
    plugin.write_tiny(tmp_path, seed=FLAT_SEED)
    assert "text_config" not in Checkpoint(tmp_path).config
    compare_with_hf(tmp_path, f"write_tiny seed {FLAT_SEED} (flat LLLI-DMMM kpool4 topk16)")


# ---------------------------------------------------------------- bf16

def test_bf16_keeps_float32_where_hf_does_and_tracks_hf(tmp_path: Path) -> None:
    """Every text tensor is held in the dtype HF holds it in at a bf16 load (float32: convs, A_log, dt_bias, mHC
    base and scale, router and its bias; bf16 the rest), and bf16 logits stay near HF's bf16 logits: within a loose
    0.25 (measured 3.1e-2 on this select-all config; in bf16 both sides, HF included, are ~4.5 away from fp32,
    where rounding moves MoE routing)."""
    directory = hf_checkpoint(tmp_path / "ckpt", seed=0, **CASES[0][4])
    captured: dict[str, torch.Tensor] = {}
    build = loader.build_weights

    def capture(config: GlmConfig, found: dict[str, torch.Tensor]) -> Any:
        captured.update(found)
        return build(config, found)

    with mock.patch.object(loader, "build_weights", capture):
        half = ours(directory, torch.bfloat16)
    hf_half = hf_model(directory, torch.bfloat16)
    hf_half.save_pretrained(tmp_path / "hf_bf16")                  # back in the checkpoint's own names
    with safe_open(tmp_path / "hf_bf16" / "model.safetensors", "pt") as f:
        theirs = {name: f.get_slice(name).get_dtype() for name in f.keys() if not name.startswith("model.visual.")}
    mine = {name: str(tensor.dtype).removeprefix("torch.") for name, tensor in captured.items()}
    assert set(mine) == set(theirs) == set(expected_shapes(half.config))
    names = {"F32": "float32", "BF16": "bfloat16"}
    assert {name: names[dtype] for name, dtype in theirs.items()} == mine
    kept = {name.split(".", 4)[-1] for name, dtype in mine.items() if dtype == "float32"}
    assert kept == {"hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale", "self_attn.A_log",
                    "self_attn.dt_bias", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                    *(f"self_attn.{part}_conv1d.weight" for part in "qkv")}
    layer = half.weights.layers
    assert layer[0].mixer.conv.dtype == layer[0].mixer.A_log.dtype == layer[1].ffn.router.dtype == torch.float32
    assert layer[0].attn_hc.base.dtype == layer[0].ffn_hc.scale.dtype == torch.float32
    assert layer[3].mixer.kv_b_proj.dtype == half.weights.embed.dtype == torch.bfloat16

    tokens = prompt_tokens(seed=7)
    chunked = every_row(half, store(directory, torch.bfloat16), tokens, cuts=[20, 41])
    one_shot = every_row(half, store(directory, torch.bfloat16), tokens, cuts=[])
    assert one_shot.dtype == torch.float32 and torch.isfinite(chunked).all()
    reference = hf_logits(hf_half, tokens)
    full = hf_logits(hf_model(directory), tokens)
    vs_hf, vs_fp32 = float((one_shot - reference).abs().max()), float((one_shot - full).abs().max())
    hf_own = float((reference - full).abs().max())
    print(f"\n[glm bf16] vs HF bf16 (eager) {vs_hf:.2e}; vs HF fp32 {vs_fp32:.2e} (HF bf16 vs HF fp32 {hf_own:.2e}); "
          f"chunked vs one-shot {float((chunked - one_shot).abs().max()):.2e}")
    assert vs_hf <= 0.25, "bf16 logits stray from HF's bf16"


# ---------------------------------------------------------------- the loader

def test_vision_and_mtp_are_skipped_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = hf_checkpoint(tmp_path / "ckpt", seed=1)
    config = GlmConfig.from_dict(Checkpoint(directory).config)
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = list(f.keys())
    mtp = mtp_tensors(config.layers, config.hidden_size)
    vision = [name for name in names if name.startswith("model.visual.")]
    assert vision and set(mtp) <= set(names)
    with caplog.at_level(logging.INFO, logger="tensorfold_glm.load"):
        model = ours(directory)
    lines = [r.getMessage() for r in caplog.records if r.name == "tensorfold_glm.load"]
    assert len(lines) == 1 and f"skipped {len(vision) + len(mtp)} tensors" in lines[0], lines
    assert len(model.weights.layers) == config.layers

    # HF drops the same tensors: shared_head silently, the rest of the MTP layer reported as unexpected
    hf_class = transformers_module().Glm5NextForConditionalGeneration
    _, info = hf_class.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] == {name for name in mtp if "shared_head" not in name}


@pytest.mark.parametrize("damage", ["missing", "mis-shaped"])
def test_missing_or_misshaped_tensor_raises_naming_it(tmp_path: Path, damage: str) -> None:
    plugin.write_tiny(tmp_path, seed=0)
    path = tmp_path / "model.safetensors"
    weights = load_file(path)
    if damage == "missing":
        name = "model.language_model.layers.3.self_attn.indexer.index_kpool_compress_ape"
        del weights[name]
    else:
        name = "model.language_model.layers.1.self_attn.dt_bias"
        weights[name] = torch.zeros(31)
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        ours(tmp_path)
