"""The conformance kit on the glm family: the embedded tiny checkpoint (three KDA layers, then one MLA layer with
its own DSA indexer) and a twin whose second MLA layer shares the first one's selection.

The tiny indexer pools 4 tokens and keeps 4 pools, so from row 19 on a query attends to a strict subset of the
keys. Resume points fall inside a pool (13), on pool boundaries (16, 32, 40, 80), inside a KDA chunk of 64 (13..40),
just before and after a chunk boundary (63, 65), and one prefill chunk crosses a chunk boundary (80 in one piece).
Every check runs in float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_glm import plugin

PROMPT = [(i * 53 + 7) % 500 + 3 for i in range(96)]
VARIANTS = ["tiny", "shared"]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
# KDA, MLA (full indexer), MLA (shared: the previous layer's selection), KDA, MLA (full)
SHARED = {"num_hidden_layers": 5,
          "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                          "indexed_attention"],
          "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
          "indexer_types": ["full", "full", "shared", "full", "full"]}
# chunked vs one shot: fp32 as the engine's contract; bf16 rounds the chunked KDA form differently, so a loose bound
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.1}
# The cuts hold a one-token piece [64, 65): a one-token row past position 0 runs the decode step (model.py `decoded`),
# whose arithmetic differs from a chunk's (the MLA's products in another order). In fp32 that stays far inside the
# bound. In bf16 it moves a logit by an ulp here and there, and the shared twin's greedy run then meets an exact
# bf16 tie of two tokens, which such an ulp decides either way; bf16 cuts [64, 66) instead, a chunk on both sides.
CUTS = {torch.float32: [1, 9, 13, 16, 33, 64, 65, 90], torch.bfloat16: [1, 9, 13, 16, 33, 64, 66, 90]}


@pytest.fixture(scope="module")
def family():
    return load_families(["glm"])["glm"]


@pytest.fixture(scope="module")
def checkpoints(family, tmp_path_factory):
    found = {}
    for variant in VARIANTS:
        directory = tmp_path_factory.mktemp(f"glm-kit-{variant}")
        if variant == "tiny":
            family.make_tiny(directory, seed=1)
        else:
            plugin.write_tiny(directory, seed=1, **SHARED)
        found[variant] = directory
    return found


@pytest.fixture(scope="module")
def subjects(family, checkpoints):
    return {(variant, dtype): kit.load(family, checkpoints[variant], dtype=dtype)
            for variant in VARIANTS for dtype in DTYPES}


@pytest.mark.parametrize("variant", VARIANTS)
def test_declarations(family, checkpoints, variant):
    found = kit.check_declarations(family, checkpoints[variant])
    kinds = [layer.kind for layer in found.layout.layers]
    assert kinds == (["kda"] * 3 + ["mla"] if variant == "tiny" else ["kda", "mla", "mla", "kda", "mla"])
    pooled = [s for layer in found.layout.layers for s in layer.rows if s.name == "pooled_key"]
    assert pooled and all(s.every == 4 for s in pooled)
    assert not found.image.problems(found.layout)


def test_selection_is_sparse_past_four_pools():
    """The prompt is long enough that the DSA indexer drops keys: without it the resume points inside and at pool
    boundaries would test nothing the dense attention does not."""
    from tensorfold_glm import indexer as dsa

    tiny = plugin.TINY_CONFIG
    dims = dsa.IndexerDims(n_heads=tiny["index_n_heads"], head_dim=tiny["index_head_dim"], topk=tiny["index_topk"],
                           kpool=tiny["index_kpool"], always_select_tail=tiny["index_kpool_always_select_tail"])
    assert (dims.kpool, dims.pools_kept) == (4, 4)
    keep = dsa.top_pools(torch.zeros(len(PROMPT), len(PROMPT) // 4), 0, dims)
    mask = dsa.selection_mask(keep, 0, len(PROMPT), dims)
    assert mask[:19].sum(-1).tolist() == list(range(1, 20))      # every key up to row 18
    assert int(mask[-2].sum()) == 16 + 3                         # 4 of 23 pools and the row's own pool tail
    assert int(mask[-1].sum()) == 16                             # a pool's last row: its pool must win


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("at, chunk", [(13, 8), (16, 16), (32, 16), (40, 20), (63, 64), (65, 64), (80, 80)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_is_bitwise(subjects, variant, dtype, at, chunk):
    kit.check_resume_bitwise(subjects[variant, dtype], PROMPT, at=at, chunk=chunk)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_vs_one_shot(subjects, variant, dtype):
    worst = kit.check_chunked(subjects[variant, dtype], PROMPT, cuts=CUTS[dtype], tolerance=TOLERANCE[dtype])
    print(f"\n[glm kit {variant} {dtype}] chunked vs one-shot max |Δlogit| {worst:.2e}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_equals_window(subjects, variant, dtype):
    kit.check_paged(subjects[variant, dtype], PROMPT, page_rows=16, chunk=32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_invariance(subjects, variant, dtype):
    kit.check_batch_invariance(subjects[variant, dtype], PROMPT)
