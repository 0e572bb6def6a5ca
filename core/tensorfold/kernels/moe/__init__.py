"""Routed experts of a mixture-of-experts layer (the part after the router): each row's k chosen experts' MLPs,
weighted and summed; and the router's last step in one kernel (routing.py: `softmax_top_k`, Qwen's softmax, and
`sigmoid_bias_top_k`, GLM-5's biased sigmoid; `router_top_k`, a decode step's whole softmax router with its
projection), whose pairs come ordered (`routed_experts(..., ordered=True)`). Two expert activations:

    "silu_gate" (default)  SwiGLU, HF transformers 5.x's fused layout (`Qwen3_5MoeExperts`): gate_up [N, 2F, E]
                           with the gate rows first, then the up rows; down [N, E, F]
    "relu2"                relu(up @ x)², no gate (HF `NemotronHExperts`): gate_up holds the up weights only,
                           [N, F, E] (HF's `experts.up_proj`, the checkpoint's per-expert `up_proj.weight` [F, E]
                           stacked on dim 0), down [N, E, F] (`experts.down_proj`, per-expert `down_proj.weight`
                           [E, F] stacked). With `moe_latent_size` set, E is the latent size.

`limit` (silu_gate only) clamps the SwiGLU as GLM-5 does: silu(min(g, limit)) · clamp(u, -limit, limit), g and u
rounded to x's dtype before the clamp (HF's `swiglu_limit`); None: no clamp.

Two sums. By default each pair's output is weighted in x's dtype and the row's sum rounded after each add
(tensorfold_qwen's torch `moe`). `float32_sum` (GLM-5; HF's grouped_mm experts path) takes float32 weights: each
pair's output rounded to x's dtype, times its weight in float32, summed in float32 in ascending expert order,
rounded once. With `shared_last` the row's last pair (its largest id: a shared expert folded in as expert N) is
left out of that sum and added after its rounding, round(round(Σ routed) + round(c · weight)), as a family's
`routed + shared` adds the shared expert.

Shapes: T rows, E hidden size, F expert intermediate size, N experts, k experts per row. Intermediates are
rounded to x's dtype where tensorfold_qwen's torch `moe` (and HF's nemotron_h experts) round them.

Tolerance, Triton vs naive, unit-scale outputs (tests/core/kernels/test_moe.py): float32 rtol = atol = 1e-5 (IEEE
float32 dots, another summation order); bfloat16 rtol = atol = 2^-6 (bf16 intermediates may round one ulp apart,
and a one-ulp gate or up moves the output by about that). The Triton path has no host sync (CUDA-graph
capturable), is deterministic and batch invariant: see `triton_moe`.
"""

from __future__ import annotations

import torch

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.moe.routing import router_top_k, sigmoid_bias_top_k, softmax_top_k
from tensorfold.kernels.strides import row_major

__all__ = ["ACTIVATIONS", "KINDS", "TILES", "routed_experts", "routed_experts_norm", "router_top_k",
           "sigmoid_bias_top_k", "softmax_top_k"]

# The Triton path's tiles, for a family's identity facts: a state kept under other tiles is not resumed.
TILES = "triton tiles: decode 16-row blocks, 32-wide F and E tiles, bf16 E steps of 128; prefill 128-row blocks"

ACTIVATIONS = ("silu_gate", "relu2")
KINDS = ("decode", "prefill")


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, x: torch.Tensor) -> None:
    """t is `shape` in `dtype` on x's device."""
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != x.device:
        raise ValueError(f"routed_experts: {name} must be {list(shape)} {dtype} on {x.device}, "
                         f"got {list(t.shape)} {t.dtype} on {t.device}")


def check(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
          down: torch.Tensor, activation: str = "silu_gate", float32_sum: bool = False) -> None:
    """Raise ValueError naming the first argument whose shape, dtype or device does not fit (no device reads)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"routed_experts: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"routed_experts: x must be a floating [T, E] tensor, got {list(x.shape)} {x.dtype}")
    T, E = x.shape
    if chosen.dim() != 2 or chosen.shape[0] != T or chosen.shape[1] < 1:
        raise ValueError(f"routed_experts: chosen must be [T, k] with T = {T} rows and k >= 1, "
                         f"got {list(chosen.shape)}")
    k = chosen.shape[1]
    _check("chosen", chosen, (T, k), torch.long, x)
    _check("weights", weights, (T, k), torch.float32 if float32_sum else x.dtype, x)
    if activation == "relu2":
        if gate_up.dim() != 3 or gate_up.shape[0] < 1:
            raise ValueError(f"routed_experts: gate_up must be [N, F, E] (up rows only, relu2) with N >= 1, "
                             f"got {list(gate_up.shape)}")
        N, F = gate_up.shape[0], gate_up.shape[1]
        _check("gate_up", gate_up, (N, F, E), x.dtype, x)
        _check("down", down, (N, E, F), x.dtype, x)
        return
    if gate_up.dim() != 3 or gate_up.shape[0] < 1 or gate_up.shape[1] % 2:
        raise ValueError(f"routed_experts: gate_up must be [N, 2F, E] (gate rows, then up rows) with N >= 1, "
                         f"got {list(gate_up.shape)}")
    N, F = gate_up.shape[0], gate_up.shape[1] // 2
    _check("gate_up", gate_up, (N, 2 * F, E), x.dtype, x)
    _check("down", down, (N, E, F), x.dtype, x)


def routed_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, activation: str = "silu_gate", kind: str = "decode",
                   limit: float | None = None, ordered: bool = False, float32_sum: bool = False,
                   shared_last: bool = False) -> torch.Tensor:
    """x [T, E], chosen [T, k] long, weights [T, k] (x's dtype), gate_up [N, 2F, E], down [N, E, F] -> [T, E]:
    out[t] = Σ_j weights[t, j] · down[e] @ (silu(g) · u), [g | u] = gate_up[e] @ x[t], e = chosen[t, j].
    activation="relu2": gate_up [N, F, E] holds the up weights only and the expert is down[e] @ relu(u)², u =
    gate_up[e] @ x[t] (Nemotron-H's experts; layouts in the module docstring). limit: the clamped SwiGLU (module
    docstring).

    kind: "decode" (a step's one row per stream) or "prefill" (a prefill chunk's rows) picks the Triton tiles; a
    row's bits are the same in any batch of one kind (triton_moe). The naive path has one form for both.

    On the CPU the expert ids are checked to lie in [0, N); on the GPU that would cost a sync, so there an id
    outside the range contributes nothing. ordered=True promises each row's ids ascending and in [0, N) (what
    `softmax_top_k` writes): the Triton path then takes them as they are, without its sort and range check (an id
    out of range would then read outside the weights); the naive path does not need it.

    float32_sum: weights [T, k] float32, the sum in float32, rounded once; shared_last (with float32_sum): the
    row's last pair added after that rounding (module docstring)."""
    check(x, chosen, weights, gate_up, down, activation, float32_sum)
    if shared_last and not float32_sum:
        raise ValueError("routed_experts: shared_last applies to the float32 sum only (float32_sum=True)")
    if kind not in KINDS:
        raise ValueError(f"routed_experts: kind must be one of {KINDS}, got {kind!r}")
    if limit is not None and activation != "silu_gate":
        raise ValueError(f"routed_experts: limit clamps the silu_gate activation only, got {activation!r}")
    if use_triton(x):
        from tensorfold.kernels.moe import triton_moe
        return triton_moe.routed_experts(x, chosen, weights, gate_up, down, activation, kind, limit=limit,
                                         ordered=ordered, float32_sum=float32_sum, shared_last=shared_last)
    N = gate_up.shape[0]
    if not x.is_cuda and chosen.numel() and not bool(((chosen >= 0) & (chosen < N)).all()):
        raise ValueError(f"routed_experts: chosen holds expert ids outside [0, {N})")
    from tensorfold.kernels.moe import naive
    return naive.routed_experts(x, chosen, weights, gate_up, down, activation, limit, float32_sum, shared_last)


def routed_experts_norm(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                        zero_centred: bool, kind: str = "decode", ordered: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm(routed_experts(x, ...), norm_weight, eps, zero_centred=..., residual=residual)`: a MoE layer's
    output added to the residual stream and normalised for the next layer, (out, residual + output), each [T, E].
    The Triton path runs the experts' sum, the add and the norm in one launch (triton_sum_norm), the same bits as
    the two calls; the naive path is the two calls. The default sum and activation only (silu_gate, no limit)."""
    check(x, chosen, weights, gate_up, down)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"routed_experts_norm: residual must be {list(x.shape)} {x.dtype} on {x.device}, "
                         f"got {list(residual.shape)} {residual.dtype} on {residual.device}")
    if kind not in KINDS:
        raise ValueError(f"routed_experts_norm: kind must be one of {KINDS}, got {kind!r}")
    if use_triton(x) and x.shape[1] > 0 and gate_up.shape[1] > 0:
        from tensorfold.kernels.moe import triton_moe, triton_sum_norm
        contrib, plan = triton_moe.contributions(x, chosen, weights, gate_up, down, kind=kind, ordered=ordered)
        residual = row_major(residual)
        return triton_sum_norm.sum_then_norm(contrib, plan.expert, gate_up.shape[0], chosen.shape[1], residual,
                                             norm_weight, eps, zero_centred)
    from tensorfold.kernels.rmsnorm import rms_norm
    out = routed_experts(x, chosen, weights, gate_up, down, kind=kind, ordered=ordered)
    return rms_norm(out, norm_weight, eps, zero_centred=zero_centred, residual=residual)
