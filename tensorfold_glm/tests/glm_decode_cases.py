"""What the glm decode tests share (test_glm_decode.py, test_glm_decode_runner.py): the checkpoints, the streams,
the bounds of decode against forward, and the helpers that drive both on a store."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from tensorfold.plan import StepPlan, share_logits
from tensorfold.plugins import load_families
from tensorfold.testing import decode_engine, kit
from tensorfold.testing.decode_engine import fixed_states, same_bytes  # noqa: F401 (the tests import them here)
from tensorfold_glm import plugin

CONTEXT, PAGE_ROWS, SLOTS, STEPS = 96, 16, 5, 8
batch_of = partial(decode_engine.batch_of, context=CONTEXT)
PROMPTS = {3: 30, 0: 9, 1: 17}             # slot -> prompt length; slot 2 and the last slot (4) stay idle
SHARED = {"num_hidden_layers": 5,
          "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                          "indexed_attention"],
          "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
          "indexer_types": ["full", "full", "shared", "full", "full"]}
ODD = {"num_hidden_layers": 3, "layer_types": ["indexed_attention", "linear_attention", "indexed_attention"],
       "mlp_layer_types": ["sparse", "dense", "sparse"], "indexer_types": ["full", "full", "full"],
       "index_kpool": 1, "index_topk": 8, "index_kpool_always_select_tail": False, "n_group": 4, "topk_group": 2,
       "norm_topk_prob": False, "linear_attn_config": {"gate_lower_bound": None, "safe_gate": False}}
VARIANTS = {"tiny": {}, "shared": SHARED, "odd": ODD}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# decode vs forward, max |Δlogit| (docs/families/glm.md, "The decode step", gives what was measured). fp32: the MLA's
# other order of products (kv_b absorbed) and the GEMMs' rounding of a row by its place in the batch, a few ulps
# carried to the logits; the bound is the kit's fp32 reference tolerance. bf16: the same reorderings round some
# activations one bf16 ulp apart, a few ulps of the logits (about 0.03 each at their magnitude).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25}
# max |Δ| / max |state| of a state those reorderings reach: fp32 a few ulps grown over the steps of a float32 KDA
# state; bf16 up to 16 bf16 ulps of the state's scale.
STATE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2 ** -4}
# Where bf16 rounding flips near-tied discrete choices, decode and forward part ways by a different pool or expert,
# not by rounding: odd's MLA keeps 8 single tokens by score (index_kpool 1, no tail), where bf16 forward itself
# parts from fp32 forward by whole logits. Only the bitwise part (a batch of one, up to the first MLA layer) and the
# padded rows' writes are checked there.
FLIPS = {("odd", torch.bfloat16)}


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 500 + 3 for i in range(n))


def load_subjects(directory: Path, names: list[str], dtypes: list[torch.dtype], device: str = "cpu") -> dict:
    """(variant, dtype) -> a kit Subject on `device`, each checkpoint written once under `directory`."""
    family = load_families(["glm"])["glm"]
    found = {}
    for name in names:
        plugin.write_tiny(directory / name, seed=1, **VARIANTS[name])
        found.update({(name, dtype): kit.load(family, directory / name, dtype=dtype, device=device)
                      for dtype in dtypes})
    return found


def prefill(subject, store, prompts: dict[int, int]) -> dict[int, int]:
    """Each prompt (slot -> length) through `forward` alone; each stream's greedy first token."""
    return decode_engine.prefill(subject, store, {slot: tokens(n, slot) for slot, n in prompts.items()})


@torch.no_grad()
def per_stream(model, plan: StepPlan, kv) -> torch.Tensor:
    """The step one stream at a time through `hidden` (GlmModel.forward without its decode route): the reference
    the decode step is held to, float32 logits [plan.logit_rows, V]."""
    return torch.cat([rows for step in plan.streams for rows in share_logits(step, model.hidden(step, kv),
                                                                              model.logits)])
