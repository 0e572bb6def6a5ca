"""The conformance kit on the nemotron family: the embedded tiny checkpoint (M E * M -: Mamba2, grouped-routing MoE,
attention, relu² MLP) and a dense twin in Nemotron-H-8B's layer order (M - M * - M -, no MoE).

Resume points fall inside an SSD chunk of 64 (13, 32, 40), on the grid (64), just before and after it (63, 65),
and one prefill chunk crosses a grid line (80 in one piece). Every check runs in float32 and bfloat16; a float32
run is held to HF transformers' logits (the kit's oracle) within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from nemotron_oracle import hf_oracle

from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_nemotron import plugin

PROMPT = [(i * 53 + 7) % 500 + 3 for i in range(96)]
VARIANTS = ["tiny", "dense"]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
DENSE = {"layers_block_type": ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
                               "linear_attention", "mlp"]}
# chunked vs one shot: fp32 as the engine's contract; bf16 rounds the chunked scan differently, so a loose bound
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.1}


@pytest.fixture(scope="module")
def family():
    return load_families(["nemotron"])["nemotron"]


@pytest.fixture(scope="module")
def checkpoints(family, tmp_path_factory):
    found = {}
    for variant in VARIANTS:
        directory = tmp_path_factory.mktemp(f"nemotron-kit-{variant}")
        if variant == "tiny":
            family.make_tiny(directory, seed=1)
        else:
            plugin.write_tiny(directory, seed=1, **DENSE)
        found[variant] = directory
    return found


@pytest.fixture(scope="module")
def oracles(checkpoints):
    """HF's logits for every position: the truth a float32 run is held to within 1e-4 (kit.check_reference)."""
    return {variant: hf_oracle(directory) for variant, directory in checkpoints.items()}


def oracle(oracles, variant, dtype):
    return oracles[variant] if dtype == torch.float32 else None


@pytest.fixture(scope="module")
def subjects(family, checkpoints):
    return {(variant, dtype): kit.load(family, checkpoints[variant], dtype=dtype)
            for variant in VARIANTS for dtype in DTYPES}


@pytest.mark.parametrize("variant", VARIANTS)
def test_declarations(family, checkpoints, variant):
    found = kit.check_declarations(family, checkpoints[variant])
    kinds = [layer.kind for layer in found.layout.layers]
    assert kinds == (["mamba", "moe", "attention", "mamba", "mlp"] if variant == "tiny"
                     else ["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "mlp"])
    assert all(not layer.rows and not layer.fixed for layer in found.layout.layers if layer.kind in ("mlp", "moe"))
    assert not found.image.problems(found.layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("at, chunk", [(13, 8), (32, 16), (40, 20), (63, 64), (64, 32), (65, 64), (80, 80)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_is_bitwise(subjects, oracles, variant, dtype, at, chunk):
    kit.check_resume_bitwise(subjects[variant, dtype], PROMPT, at=at, chunk=chunk,
                             oracle=oracle(oracles, variant, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_vs_one_shot(subjects, oracles, variant, dtype):
    worst = kit.check_chunked(subjects[variant, dtype], PROMPT, cuts=[1, 9, 13, 33, 64, 65, 90],
                              tolerance=TOLERANCE[dtype], oracle=oracle(oracles, variant, dtype))
    print(f"\n[nemotron kit {variant} {dtype}] chunked vs one-shot max |Δlogit| {worst:.2e}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_equals_window(subjects, variant, dtype):
    kit.check_paged(subjects[variant, dtype], PROMPT, page_rows=16, chunk=32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_invariance(subjects, variant, dtype):
    kit.check_batch_invariance(subjects[variant, dtype], PROMPT)
