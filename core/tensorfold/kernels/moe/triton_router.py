"""A decode step's router in two launches of ours (each with PDL, so each waits behind the kernel before; a library
GEMV is launched without it) instead of a library GEMV and the routing kernel:

    parts launch (linear_norm)   parts[s, m, n] = x[m, K slice s] · w[n, K slice s] in float32, SPLITS slices
    route launch, program (row)  logits = round(parts[0, m] + parts[1, m] + ...) (splits in order, rounded once to
                                 x's dtype, as the GEMV's sum kernel does), then triton_routing's `route_row`
                                 (softmax, top-k, renormalise; the shared pair from column N)

The route launch runs the routing kernel's own body with its warps and block, so the pairs are bit for bit
`softmax_top_k` on those summed logits (the tests check it). The config is a function of nothing but the call
being one of at most ROWS_UP_TO rows, and a row reads only its own x row: a row's pairs are the same alone or among
up to 16 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.linear_norm import ROWS_UP_TO
from tensorfold.kernels.linear_norm.triton_linear_norm import parts, summed
from tensorfold.kernels.moe.routing import ROUTER_SPLITS
from tensorfold.kernels.moe.triton_routing import pairs, route_config, route_row


@triton.jit(do_not_specialize=["N"])
def _route_parts_kernel(parts_ptr, weight_ptr, chosen_ptr, N, s_ps, s_pm, s_wt, s_ct, K: tl.constexpr,
                        SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, SHARED: tl.constexpr, BLOCK_K: tl.constexpr,
                        PACKED: tl.constexpr, PDL: tl.constexpr = False):
    """Row t's pairs from its summed logits (and its shared gate logit, column N, with SHARED)."""
    pdl.ordered(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ty = weight_ptr.dtype.element_ty
    logit = summed(parts_ptr, t * s_pm + cols, cols < N, s_ps, SPLITS, ty)
    shared = 0.0
    if SHARED:
        shared = summed(parts_ptr, t * s_pm + N, True, s_ps, SPLITS, ty)
    route_row(logit, shared, weight_ptr, chosen_ptr, t, N, s_wt, s_ct, K, BLOCK_N, SHARED, BLOCK_K, PACKED)


def route_parts(p: torch.Tensor, k: int, shared: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: float32 partial sums [splits, M, N (+1)] -> (weights [M, k'] in dtype, chosen [M, k'] long)."""
    splits, M, width_in = p.shape
    N = width_in - shared
    width = k + shared
    weights, chosen = pairs(M, width, dtype, p.device)
    if M:
        _route_parts_kernel[(M,)](p, weights, chosen, N, p.stride(0), p.stride(1), weights.stride(0),
                                  chosen.stride(0), SPLITS=splits, SHARED=shared, **route_config(N, k, dtype),
                                  **pdl.options(p))
    return weights, chosen


def router_top_k(x: torch.Tensor, weight: torch.Tensor, k: int, shared: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: x [M, E] (M <= ROWS_UP_TO), weight [N (+1 with shared), E] -> (weights [M, k'] x's dtype, chosen
    [M, k'] long), k' = k + shared."""
    if x.shape[0] > ROWS_UP_TO:
        raise ValueError(f"router_top_k: at most {ROWS_UP_TO} rows, got {x.shape[0]}")
    return route_parts(parts(x, weight, ROUTER_SPLITS), k, shared, x.dtype)
