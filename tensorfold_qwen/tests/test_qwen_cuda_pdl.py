"""Qwen3.5 decode through the graph runner with programmatic dependent launch on and off (kernels/pdl.py): every
step's logits the same bits, dense and MoE (the folded shared expert: the decode MoE kernels and the routing kernel),
bf16 and fp32. Skipped without CUDA; run in device sessions (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.kernels import pdl
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_qwen import plugin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CONTEXT = 256
PROMPTS = [[(i * (13 + 4 * p) + 7 * p) % 500 + 3 for i in range(20 + 11 * p)] for p in range(3)]
STEPS = 12


def decoded(subject) -> list[torch.Tensor]:
    """Each step's logits: the prompts prefilled one at a time, then decoded together by graph replay."""
    store = subject.store(4, CONTEXT, page_rows=16)
    runner = DecodeRunner(subject.model, store, batch_sizes(4), CONTEXT, graphs=True)
    runner.capture()
    last, position, steps = [], [], []
    for slot, prompt in enumerate(PROMPTS):
        logits = subject.model.forward(StepPlan((StreamStep(slot, 0, tuple(prompt)),)), store)
        steps.append(logits.clone())
        last.append(int(logits[0].argmax()))
        position.append(len(prompt))
    for _ in range(STEPS):
        plan = StepPlan(tuple(StreamStep(s, position[s], (last[s],)) for s in range(len(PROMPTS))))
        logits = runner.forward(plan, store)
        steps.append(logits.clone())
        last = [int(row.argmax()) for row in logits]
        position = [p + 1 for p in position]
    return steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["dense", "moe-folded"])
def test_decode_gives_the_same_bits_with_pdl_on_and_off(kind: str, dtype: torch.dtype, tmp_path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.write_tiny(tmp_path, seed=7, folded=kind == "moe-folded")
    subject = kit.load(load_families(["qwen"])["qwen"], tmp_path, dtype=dtype, device="cuda")
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", on)
        runs[on] = decoded(subject)
    assert len(runs[True]) == len(PROMPTS) + STEPS
    for a, b in zip(runs[True], runs[False], strict=True):
        assert torch.equal(a, b)
