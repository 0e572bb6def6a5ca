"""The routed experts' pair form (`pair_experts`, the decode step's path off the Triton path) against the
pair-by-pair reference: the same sums within the kernels' rounding in float32, the clamp applied alike, and a
row's bits the same alone and in a batch of its kind. On the CPU the kernels' `routed_experts` runs its naive form
(tests/core/kernels/test_moe.py holds the Triton form to it, clamp included, in the interpreter and on the H200)."""

from __future__ import annotations

import pytest
import torch

from tensorfold_glm import mlp
from tensorfold_glm.mlp import MlpWeights, MoeWeights, pair_experts, route, routed_experts

N, E, F, T, K = 8, 32, 16, 40, 3


def weights(seed: int) -> MoeWeights:
    g = torch.Generator().manual_seed(seed)
    shared = MlpWeights(*(torch.randn(shape, generator=g) * shape[-1] ** -0.5 for shape in ((F, E), (F, E), (E, F))))
    return MoeWeights(router=torch.randn(N, E, generator=g) * E ** -0.5,
                      e_score_correction_bias=0.1 * torch.randn(N, generator=g),
                      gate_up=torch.randn(N, 2 * F, E, generator=g) * E ** -0.5,
                      down=torch.randn(N, E, F, generator=g) * F ** -0.5, shared_experts=shared)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_pair_experts_equal_the_row_by_row_sums(kind):
    w = weights(0)
    x = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    mix, chosen = route(w, x, K, 2.5, True)
    for limit in (None, 0.5):
        paired = pair_experts(w, x, mix, chosen, limit, kind)
        reference = routed_experts(w, x, mix, chosen, limit)
        assert paired.dtype == x.dtype and (paired - reference).abs().max().item() < 1e-5
    bf = x.bfloat16()
    w16 = MoeWeights(router=w.router, e_score_correction_bias=w.e_score_correction_bias,
                     gate_up=w.gate_up.bfloat16(), down=w.down.bfloat16(), shared_experts=w.shared_experts)
    mix, chosen = route(w16, bf, K, 2.5, True)
    close = pair_experts(w16, bf, mix, chosen, 0.5, kind).float() - routed_experts(w16, bf, mix, chosen, 0.5).float()
    assert close.abs().max().item() < 0.05


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_rows_bits_do_not_depend_on_its_batch(kind):
    w = weights(2)
    x = torch.randn(T, E, generator=torch.Generator().manual_seed(3)).bfloat16()
    w16 = MoeWeights(router=w.router, e_score_correction_bias=w.e_score_correction_bias,
                     gate_up=w.gate_up.bfloat16(), down=w.down.bfloat16(), shared_experts=w.shared_experts)
    mix, chosen = route(w16, x, K, 2.5, True)
    together = pair_experts(w16, x, mix, chosen, 0.5, kind)
    for t in (0, 17, T - 1):
        alone = pair_experts(w16, x[t:t + 1], mix[t:t + 1], chosen[t:t + 1], 0.5, kind)
        assert torch.equal(alone[0], together[t])


def written_out(w: MoeWeights, x: torch.Tensor, mix: torch.Tensor, chosen: torch.Tensor,
                limit: float | None) -> torch.Tensor:
    """The reference's definition: one row and one expert at a time (F.linear, clamped SwiGLU, F.linear), each
    expert's output times its float32 weight summed in float32 in the order of `chosen`, rounded once."""
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1])
        for j, expert in enumerate(chosen[t].tolist()):
            gate, up = torch.nn.functional.linear(x[t:t + 1], w.gate_up[expert]).chunk(2, dim=-1)
            hidden = torch.nn.functional.linear(mlp.clamped_glu(gate, up, limit), w.down[expert])[0]
            total = total + hidden.float() * mix[t, j]
        out[t] = total.to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch_bytes", [mlp.PAIR_WEIGHT_BYTES, 1 << 13, 1], ids=["one-batch", "batches", "a-row"])
def test_the_reference_is_its_definition_bit_for_bit_however_its_rows_are_batched(dtype, batch_bytes, monkeypatch):
    """`routed_experts` batches the pairs' GEMMs (up to PAIR_WEIGHT_BYTES of gathered weights): every row's bits
    equal the definition's, with rows batched whole, in several batches (the budget monkeypatched down) or one
    a batch, with and without the clamp, and a row alone gives the same bits."""
    monkeypatch.setattr(mlp, "PAIR_WEIGHT_BYTES", batch_bytes)
    w = weights(4)
    w = MoeWeights(router=w.router, e_score_correction_bias=w.e_score_correction_bias, gate_up=w.gate_up.to(dtype),
                   down=w.down.to(dtype), shared_experts=w.shared_experts)
    x = torch.randn(T, E, generator=torch.Generator().manual_seed(5)).to(dtype)
    mix, chosen = route(w, x, K, 2.5, True)
    for limit in (None, 0.5):
        batched = routed_experts(w, x, mix, chosen, limit)
        assert batched.dtype == dtype and torch.equal(batched, written_out(w, x, mix, chosen, limit))
        for t in (0, 21, T - 1):
            assert torch.equal(routed_experts(w, x[t:t + 1], mix[t:t + 1], chosen[t:t + 1], limit)[0], batched[t])
