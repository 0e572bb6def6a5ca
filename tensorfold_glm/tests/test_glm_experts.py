"""The grouped routed experts (the GPU's path) against the one-row-at-a-time reference: the same sums within GEMM
rounding in float32, equal where every expert sees one row, and the clamp applied alike."""

from __future__ import annotations

import torch

from tensorfold_glm.experts import grouped_experts
from tensorfold_glm.mlp import MlpWeights, MoeWeights, route, routed_experts

N, E, F, T, K = 8, 32, 16, 40, 3


def weights(seed: int) -> MoeWeights:
    g = torch.Generator().manual_seed(seed)
    shared = MlpWeights(*(torch.randn(shape, generator=g) * shape[-1] ** -0.5 for shape in ((F, E), (F, E), (E, F))))
    return MoeWeights(router=torch.randn(N, E, generator=g) * E ** -0.5,
                      e_score_correction_bias=0.1 * torch.randn(N, generator=g),
                      gate_up=torch.randn(N, 2 * F, E, generator=g) * E ** -0.5,
                      down=torch.randn(N, E, F, generator=g) * F ** -0.5, shared_experts=shared)


def test_grouped_experts_equal_the_row_by_row_sums():
    w = weights(0)
    x = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    mix, chosen = route(w, x, K, 2.5, True)
    for limit in (None, 0.5):
        grouped = grouped_experts(w, x, mix, chosen, limit)
        reference = routed_experts(w, x, mix, chosen, limit)
        assert (grouped - reference).abs().max().item() < 1e-5
    one = x[:1]
    mix, chosen = route(w, one, K, 2.5, True)          # one row: every expert sees that row alone
    assert torch.equal(grouped_experts(w, one, mix, chosen, 0.5), routed_experts(w, one, mix, chosen, 0.5))
    bf = x.bfloat16()
    w16 = MoeWeights(router=w.router, e_score_correction_bias=w.e_score_correction_bias,
                     gate_up=w.gate_up.bfloat16(), down=w.down.bfloat16(), shared_experts=w.shared_experts)
    mix, chosen = route(w16, bf, K, 2.5, True)
    close = (grouped_experts(w16, bf, mix, chosen, 0.5).float() - routed_experts(w16, bf, mix, chosen, 0.5).float())
    assert close.abs().max().item() < 0.05 and grouped_experts(w16, bf, mix, chosen, 0.5).dtype == torch.bfloat16
