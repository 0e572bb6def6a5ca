"""Qwen3.5 decode on a CUDA device through the graph runner: concurrent == solo, and bf16 against fp32 greedy
tokens on a fixed prompt set (agreement reported). Skipped without CUDA; run in device sessions (`pytest -m gpu`).
"""

from __future__ import annotations

import json

import pytest
import torch

from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.kernels import linear_norm
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_qwen import decode, plugin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CONTEXT = 256
PROMPTS = [[(i * (17 + 6 * p) + 5 * p) % 500 + 3 for i in range(24 + 9 * p)] for p in range(16)]
STEPS = 32


@pytest.fixture(scope="module", params=["dense", "moe", "moe-folded"])
def checkpoint(request, tmp_path_factory):
    """The tiny checkpoints; "moe-folded" gives the shared expert the experts' size, so the decode step runs it as
    one more expert of the grouped call (mlp.moe_fused), as Qwen3.5-35B-A3B's does."""
    directory = tmp_path_factory.mktemp(f"qwen-cuda-decode-{request.param}")
    plugin.write_tiny(directory, seed=5, moe=request.param == "moe", folded=request.param == "moe-folded")
    return directory


def greedy(subject, prompts: list[list[int]], steps: int, slots: int) -> list[list[int]]:
    """Greedy tokens of every prompt, prefilled one at a time, then decoded together by graph replay."""
    store = subject.store(slots, CONTEXT, page_rows=16)
    runner = DecodeRunner(subject.model, store, batch_sizes(slots), CONTEXT, graphs=True)
    runner.capture()
    out, position = [], []
    for slot, prompt in enumerate(prompts):
        logits = subject.model.forward(StepPlan((StreamStep(slot, 0, tuple(prompt)),)), store)
        out.append([int(logits[0].argmax())])
        position.append(len(prompt))
    for _ in range(steps - 1):
        plan = StepPlan(tuple(StreamStep(s, position[s], (out[s][-1],)) for s in range(len(prompts))))
        logits = runner.forward(plan, store)
        for s in range(len(prompts)):
            out[s].append(int(logits[s].argmax()))
            position[s] += 1
    assert runner.replays == steps - 1
    return out


@pytest.mark.parametrize("wide", [False, True], ids=["library-inputs", "gemv-inputs"])
def test_concurrent_equals_solo_under_graphs(checkpoint, monkeypatch, wide):
    """Each stream decoded alone (graph of batch 1) and among 5 others (padded to the graph of 8): same tokens;
    bf16, where the decode kernels are batch-invariant by construction and the GEMMs measured so. gemv-inputs: the
    tiny projections counted wide, so the input projections run linear_norm's one-launch GEMV, as the real shapes'."""
    if wide:
        monkeypatch.setattr(linear_norm, "ONE_SLICE_FROM", 64)
        monkeypatch.setattr(decode, "INPUT_GEMV", True)
    subject = kit.load(load_families(["qwen"])["qwen"], checkpoint, dtype=torch.bfloat16, device="cuda")
    together = greedy(subject, PROMPTS[:5], STEPS, slots=8)
    alone = [greedy(subject, [prompt], STEPS, slots=1)[0] for prompt in PROMPTS[:5]]
    assert together == alone


def test_bf16_against_fp32_greedy_agreement(checkpoint):
    """bf16 and fp32 on the GPU, greedy over 16 prompts: tokens agreeing before the first divergence, reported;
    random weights give flatter logits than a trained model, so the bound is loose. The folded checkpoint draws
    other weights, whose top-2 routing flips more often at the first token (docs/families/qwen.md); its bound is
    looser still, and its fp32 is held to the CPU reference in test_qwen_cuda.py."""
    family = load_families(["qwen"])["qwen"]
    runs = {dtype: greedy(kit.load(family, checkpoint, dtype=dtype, device="cuda"), PROMPTS, STEPS, slots=16)
            for dtype in (torch.float32, torch.bfloat16)}
    prefixes = []
    for a, b in zip(runs[torch.float32], runs[torch.bfloat16], strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefixes.append(same)
    first = sum(p > 0 for p in prefixes) / len(prefixes)
    whole = sum(p == STEPS for p in prefixes) / len(prefixes)
    print(json.dumps({"bench": "bf16_vs_fp32_greedy", "checkpoint": checkpoint.name, "prompts": len(PROMPTS),
                      "steps": STEPS, "first_token_agree": first, "all_tokens_agree": whole,
                      "mean_agreeing_prefix": sum(prefixes) / len(prefixes)}))
    assert first >= (0.625 if checkpoint.name.startswith("qwen-cuda-decode-moe-folded") else 0.75)
