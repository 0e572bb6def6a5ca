"""The batched forward (the GPU path) computes what the per-stream reference computes, within tolerance, over
steps that mix prefill chunks (packed into varlen calls) and decode rows of several streams in pages."""

from __future__ import annotations

import pytest
import torch

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_qwen import plugin
from tensorfold_qwen.batched import batched_forward

TOLERANCE = 1e-4


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 500 + 3 for i in range(n))


STEPS = [  # per step: (slot, start, length) shares
    [(0, 0, 40), (1, 0, 7)],
    [(0, 40, 1), (1, 7, 64), (2, 0, 1)],
    [(0, 41, 1), (1, 71, 1), (2, 1, 30)],
    [(0, 42, 1), (1, 72, 1), (2, 31, 1), (3, 0, 65)],
    [(3, 65, 1), (0, 43, 1)],
    [(0, 44, 20), (3, 66, 1), (1, 73, 9), (2, 32, 33)],   # three prefill chunks packed around a decode row
]


@pytest.fixture(scope="module", params=["dense", "moe"])
def subject(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"qwen-batched-{request.param}")
    plugin.write_tiny(directory, seed=2, moe=request.param == "moe")
    return kit.load(load_families(["qwen"])["qwen"], directory)


def test_batched_equals_per_stream(subject):
    reference, batched = (subject.store(4, 160, page_rows=16) for _ in range(2))
    worst = 0.0
    for shares in STEPS:
        plan = StepPlan(tuple(StreamStep(slot, start, tokens(start + length, slot)[start:]) for slot, start, length
                              in shares))
        expected = subject.model.forward(plan, reference)
        got = batched_forward(subject.model, plan, batched)
        worst = max(worst, float((expected - got).abs().max()))
    print(f"batched vs per-stream max |Δlogit| {worst:.2e}")
    assert worst < TOLERANCE
    for layer, kind in enumerate(subject.model.config.layer_types):
        name = "recurrent" if kind != "full_attention" else None
        if name:
            assert torch.allclose(reference.fixed_states(layer, name), batched.fixed_states(layer, name), atol=1e-4)


def test_moe_rows_take_the_experts_tiles_of_their_kind(subject, monkeypatch):
    """A MoE step's prefill rows go through the experts' prefill tiles and its one-row streams through the decode
    tiles the captured decode step uses (the CPU's naive experts have one form for both; which kind each call
    asks for is what the GPU's bits depend on)."""
    if not subject.model.config.moe:
        pytest.skip("a dense model has no experts")
    from tensorfold_qwen import mlp

    calls = []
    real = mlp.routed_experts

    def recorded(x, *args, kind="decode", **kwargs):
        calls.append((x.shape[0], kind))
        return real(x, *args, kind=kind, **kwargs)

    monkeypatch.setattr(mlp, "routed_experts", recorded)
    store = subject.store(4, 160, page_rows=16)
    layers = len(subject.model.config.layer_types)
    expected = {0: [(47, "prefill")], 1: [(2, "decode"), (64, "prefill")], 2: [(2, "decode"), (30, "prefill")],
                3: [(3, "decode"), (65, "prefill")], 4: [(2, "decode")], 5: [(1, "decode"), (62, "prefill")]}
    for step, shares in enumerate(STEPS):
        calls.clear()
        plan = StepPlan(tuple(StreamStep(slot, start, tokens(start + length, slot)[start:]) for slot, start, length
                              in shares))
        batched_forward(subject.model, plan, store)
        assert calls == expected[step] * layers, (step, calls)



def test_a_step_uploads_its_page_tables_once(subject):
    """Every attention layer of a step reads its keys through the same tables and flat rows (batched.KeyRows), so
    the store builds the step's tables once, however many attention layers the model has; the step still computes
    what the per-stream reference computes (test_qwen_batched_bits.py: bit for bit what a step building them in
    every layer computes)."""
    assert sum(kind == "full_attention" for kind in subject.model.config.layer_types) > 1
    kept, reference = (subject.store(4, 160, page_rows=16) for _ in range(2))
    calls, built = [], kept.tables

    def counted(slots):
        calls.append(list(slots))
        return built(slots)

    kept.tables = counted
    for shares in STEPS:
        plan = StepPlan(tuple(StreamStep(slot, start, tokens(start + length, slot)[start:]) for slot, start, length
                              in shares))
        calls.clear()
        got = batched_forward(subject.model, plan, kept)
        assert calls == [[slot for slot, _, _ in shares]]
        assert float((subject.model.forward(plan, reference) - got).abs().max()) < TOLERANCE
