"""How many device ops one MoE feed-forward issues on the Triton path, counted on the CPU (tensorfold.testing.launches:
aten ops that compute, each one launch on CUDA, and every Triton kernel stubbed to count as one). It pins the
feed-forward's glue: a change that adds a launch moves a count here.

Before the fused path a bf16 decode feed-forward at T = 1, k = 8 counted 57: x's cast and the float32 router GEMM,
nine ops of torch routing, nine of the per-pair alignment (ones, sort, gather, range check, casts), the grouped
kernels' three launches, 26 of the float32 weighted sum (k casts, products and adds, the zeros, the last cast), the
shared expert's seven and the add. Now six.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import tensorfold.kernels.moe as moe_package
from tensorfold.kernels.moe import routing, triton_moe, triton_routing
from tensorfold.testing.launches import counting_triton
from tensorfold_glm import mlp
from tensorfold_glm.fused import can_fold, fuse_moe
from tensorfold_glm.mlp import MlpWeights, MoeWeights

E, N, F_EXPERT, LIMIT = 64, 16, 32, 10.0
KERNELS = {triton_moe: ("_gate_up_kernel", "_down_kernel", "_sum_kernel"),
           triton_routing: ("_sigmoid_route_kernel",)}


def route_stand_in(logits, bias, weights, chosen, N, S, s_lt, s_wt, s_ct, scale, **meta) -> None:
    """The routing kernel's pairs from its torch twin (the grouping after it indexes by them)."""
    pairs = routing.sigmoid_naive(logits, bias, meta["K"], meta["GROUPS"], meta["TOPK_GROUP"], meta["NORM"], scale,
                                  meta["SHARED"])
    weights.copy_(pairs[0])
    chosen.copy_(pairs[1])


def moe_layer(shared_f: int) -> MoeWeights:
    """A bf16 MoE layer (E 64, 16 experts of F 32, float32 router) in the layout the loader builds on a Triton
    device: the shared expert folded when it has an expert's width."""
    g = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()

    w = MoeWeights(router=draw(N, E).float(), e_score_correction_bias=torch.zeros(N), gate_up=draw(N, 2 * F_EXPERT, E),
                   down=draw(N, E, F_EXPERT), shared_experts=MlpWeights(draw(shared_f, E), draw(shared_f, E),
                                                                        draw(E, shared_f)))
    return fuse_moe(w) if can_fold(w) else w


def moe_ffn_ops(monkeypatch: pytest.MonkeyPatch, shared_f: int, top_k: int, T: int, kind: str,
                n_group: int = 1, topk_group: int = 1) -> Counter[str]:
    """The ops of one MoE feed-forward (`moe_routed` for decode, `moe` for prefill) over T rows, after a first call
    (a decode step's graph is captured after warm-up calls; the one-block-per-pair row map is made once per shape)."""
    w = moe_layer(shared_f)
    x = torch.randn(T, E, generator=torch.Generator().manual_seed(1)).bfloat16()
    call = mlp.moe_routed if kind == "decode" else mlp.moe
    effects = {"_sigmoid_route_kernel": route_stand_in}
    for _ in range(2):
        with monkeypatch.context() as mp, counting_triton(mp, KERNELS, (mlp, moe_package, routing), effects) as mode:
            call(w, x, top_k, 2.5, True, n_group, topk_group, LIMIT)
    return mode.ops


# x cast to float32 and the float32 router GEMM, the routing kernel, the grouped experts' three kernels
FOLDED = Counter({"_to_copy": 1, "mm": 1, "triton:_sigmoid_route_kernel": 1, "triton:_gate_up_kernel": 1,
                  "triton:_down_kernel": 1, "triton:_sum_kernel": 1})


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)], ids=["topk", "groups"])
def test_a_decode_moe_ffn_is_six_launches(monkeypatch, T, groups):
    """The shared expert folded in: nothing but the six launches, up to 8 streams at k = 8 (72 pairs with the
    shared expert's, one block each: the alignment issues no op), group-limited routing included."""
    assert moe_ffn_ops(monkeypatch, F_EXPERT, 8, T, "decode", *groups) == FOLDED


def test_a_decode_moe_ffn_with_the_shared_expert_apart(monkeypatch):
    """n_shared_experts = 2 (twice an expert's width): its clamped SwiGLU in torch and the add."""
    assert moe_ffn_ops(monkeypatch, 2 * F_EXPERT, 8, 1, "decode") == FOLDED + Counter({
        "mm": 3, "clamp": 2, "silu": 1, "mul": 1, "add": 1})


def test_a_prefill_moe_ffn_groups_its_pairs_on_the_device(monkeypatch):
    """Prefill rows are grouped by expert (on CUDA triton_align's two launches; here its torch reference's ops),
    the rest as in decode."""
    ops = moe_ffn_ops(monkeypatch, F_EXPERT, 4, 40, "prefill")
    assert ops == FOLDED + Counter({
        "sort": 1, "searchsorted": 2, "arange": 3, "index": 2, "sub": 4, "add": 2, "mul": 2, "floor_divide": 1,
        "cumsum": 1, "clamp": 1, "lt": 1, "where": 1, "scalar_tensor": 1, "full": 1, "scatter_": 1, "_to_copy": 2})
