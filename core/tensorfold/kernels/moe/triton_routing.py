"""Triton softmax → top-k → renormalise, one program per row (routing.py says what it computes).

    program (row t)   the row's N logits in one block, float32: max, e = exp(logit - max), p = e / Σe;
                      k rounds of (largest remaining logit, lowest index among equals) mark the chosen;
                      w = p / Σ_chosen p, rounded to the output dtype; then k rounds of (lowest chosen index)
                      write the pairs in ascending id order; with SHARED, (N, round(sigmoid(s))) last

A row reads only its own logits and the config (block size, warps) is a function of N alone, so a row's bits are
the same in any batch; one launch, no host sync, nothing sized by data (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels.triton_rounding import round_to


@triton.jit(do_not_specialize=["N"])
def _route_kernel(logit_ptr, shared_ptr, weight_ptr, chosen_ptr, N, s_lt, s_st, s_wt, s_ct,
                  K: tl.constexpr, BLOCK_N: tl.constexpr, SHARED: tl.constexpr):
    """weights[t], chosen[t] from logits[t] (and the shared gate logit shared[t] with SHARED)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    valid = cols < N
    logit = tl.load(logit_ptr + t * s_lt + cols, mask=valid, other=0.0).to(tl.float32)
    key = tl.where(valid & (logit == logit), logit, float("-inf"))         # padding and NaN: -inf
    e = tl.exp(key - tl.max(key, 0))
    p = e / tl.sum(e, 0)
    taken = cols < 0
    for _ in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), key), 0)
        first = tl.min(tl.where(valid & (taken == 0) & (key == best), cols, BLOCK_N), 0)
        taken = taken | (cols == first)
    ty = weight_ptr.dtype.element_ty
    w = round_to(p / tl.sum(tl.where(taken, p, 0.0), 0), ty)
    for j in tl.static_range(K):
        first = tl.min(tl.where(taken, cols, BLOCK_N), 0)
        tl.store(chosen_ptr + t * s_ct + j, first.to(tl.int64))
        tl.store(weight_ptr + t * s_wt + j, tl.sum(tl.where(cols == first, w, 0.0), 0).to(ty))
        taken = taken & (cols != first)
    if SHARED:
        s = tl.load(shared_ptr + t * s_st).to(tl.float32)
        tl.store(chosen_ptr + t * s_ct + K, N.to(tl.int64))
        tl.store(weight_ptr + t * s_wt + K, round_to(1.0 / (1.0 + tl.exp(-s)), ty).to(ty))


def softmax_top_k(logits: torch.Tensor, k: int, shared: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: logits [T, N] -> (weights [T, k'], chosen [T, k'] long), k' = k + (shared is not None)."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    T, N = logits.shape
    width = k + (shared is not None)
    weights = torch.empty((T, width), dtype=logits.dtype, device=logits.device)
    chosen = torch.empty((T, width), dtype=torch.long, device=logits.device)
    if T:
        block = triton.next_power_of_2(N)
        gate = logits if shared is None else shared
        _route_kernel[(T,)](logits, gate, weights, chosen, N, logits.stride(0), gate.stride(0), weights.stride(0),
                            chosen.stride(0), K=k, BLOCK_N=block, SHARED=shared is not None,
                            num_warps=1 if block <= 1024 else 4)
    return weights, chosen
