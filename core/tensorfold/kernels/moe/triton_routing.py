"""Triton routing kernels, one program per row (routing.py says what they compute).

    softmax_top_k (row t)       the row's N logits in one block, float32: max, e = exp(logit - max), p = e / Σe;
                                k rounds of (largest remaining logit, lowest index among equals) mark the chosen
                                (bfloat16 logits, PACKED: one max a round over int32 keys, the value's order in
                                the high half and the inverted index in the low, instead of a max and a min);
                                w = p / Σ_chosen p, rounded to the output dtype; a prefix count over the chosen
                                writes the pairs in ascending id order; with SHARED, (N, round(sigmoid(s)))
    sigmoid_bias_top_k (row t)  the row's logits as a [groups, group size] block, float32: s = sigmoid(logit),
                                b = s + bias; with GROUPED, each group's best and second best b (the best's lowest
                                index taken out) summed, and topk_group rounds of (largest group sum, lowest group)
                                keep groups, the rest's b set to -inf; k rounds of (largest b, lowest index) mark
                                the chosen; w = s / (Σ_chosen s + 1e-20) (with NORM) · scale; the pairs written in
                                ascending id order; with SHARED, (N, 1.0) last

A row reads only its own logits and the config (block sizes, warps) is a function of N and the group count alone,
so a row's bits are the same in any batch; one launch, no host sync, nothing sized by data (CUDA-graph
capturable). The sigmoid kernel compiles without fp fusion, so each product and sum rounds as torch's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.strides import row_major
from tensorfold.kernels.triton_ieee import INTERPRETED, div, sigmoid
from tensorfold.kernels.triton_rounding import round_to

PACKED_KEYS = True   # bfloat16 logits: the top-k on packed int32 keys (bench/decode_sweep.py times either)
NO_KEY = tl.constexpr(-2147483648)  # int32's least: a packed key never chosen (padding, or taken)


@triton.jit
def _top_k_packed(key, cols, valid, K: tl.constexpr):
    """The k largest of `key` (float32 holding bfloat16 values, NaN already -inf), the lowest index first among
    equals: each column's key packed into one int32, so a round is one max. The high half is the value's order
    (the float bits made signed-ordered, -0 taken as +0; a bfloat16's low 16 float32 bits are zero), the low
    half 65535 - column, so of equal values the lowest column is the largest key; keys are distinct."""
    bits = tl.where(key == 0.0, 0.0, key).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = tl.where(valid, (ordered & -65536) | (65535 - cols), NO_KEY)
    taken = cols < 0
    for _ in tl.static_range(K):
        top = tl.max(packed, 0)
        hit = (packed == top) & (top != NO_KEY)
        taken = taken | hit
        packed = tl.where(hit, NO_KEY, packed)
    return taken


@triton.jit
def route_row(logit, shared, weight_ptr, chosen_ptr, t, N, s_wt, s_ct, K: tl.constexpr, BLOCK_N: tl.constexpr,
              SHARED: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr):
    """Row t's pairs from its float32 logits [BLOCK_N] (and its shared gate logit with SHARED), written ordered;
    PACKED: the logits are bfloat16 values (route_config)."""
    cols = tl.arange(0, BLOCK_N)
    valid = cols < N
    key = tl.where(valid & (logit == logit), logit, float("-inf"))         # padding and NaN: -inf
    e = tl.exp(key - tl.max(key, 0))
    p = e / tl.sum(e, 0)
    if PACKED:
        taken = _top_k_packed(key, cols, valid, K)
    else:
        taken = cols < 0
        for _ in tl.static_range(K):
            best = tl.max(tl.where(taken, float("-inf"), key), 0)
            first = tl.min(tl.where(valid & (taken == 0) & (key == best), cols, BLOCK_N), 0)
            taken = taken | (cols == first)
    ty = weight_ptr.dtype.element_ty
    w = round_to(p / tl.sum(tl.where(taken, p, 0.0), 0), ty)
    # the chosen in ascending id order: a chosen column's place is the count of chosen columns up to it (one scan,
    # not k rounds of a reduction); places past the count (fewer than k chosen) get (BLOCK_N, 0), an id no expert has
    place = tl.cumsum(taken.to(tl.int32), 0) - 1
    tl.store(chosen_ptr + t * s_ct + place, cols.to(tl.int64), mask=taken)
    tl.store(weight_ptr + t * s_wt + place, w.to(ty), mask=taken)
    rest = tl.arange(0, BLOCK_K)
    missing = (rest >= tl.sum(taken.to(tl.int32), 0)) & (rest < K)
    tl.store(chosen_ptr + t * s_ct + rest, tl.full([BLOCK_K], BLOCK_N, tl.int64), mask=missing)
    tl.store(weight_ptr + t * s_wt + rest, tl.zeros([BLOCK_K], tl.float32).to(ty), mask=missing)
    if SHARED:
        tl.store(chosen_ptr + t * s_ct + K, N.to(tl.int64))
        tl.store(weight_ptr + t * s_wt + K, round_to(1.0 / (1.0 + tl.exp(-shared)), ty).to(ty))


@triton.jit(do_not_specialize=["N"])
def _route_kernel(logit_ptr, shared_ptr, weight_ptr, chosen_ptr, N, s_lt, s_st, s_wt, s_ct,
                  K: tl.constexpr, BLOCK_N: tl.constexpr, SHARED: tl.constexpr, BLOCK_K: tl.constexpr,
                  PACKED: tl.constexpr, PDL: tl.constexpr = False):
    """weights[t], chosen[t] from logits[t] (and the shared gate logit shared[t] with SHARED)."""
    pdl.ordered(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    logit = tl.load(logit_ptr + t * s_lt + cols, mask=cols < N, other=0.0).to(tl.float32)
    shared = 0.0
    if SHARED:
        shared = tl.load(shared_ptr + t * s_st).to(tl.float32)
    route_row(logit, shared, weight_ptr, chosen_ptr, t, N, s_wt, s_ct, K, BLOCK_N, SHARED, BLOCK_K, PACKED)


def pairs(T: int, width: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing output buffers: weights [T, width] in dtype, chosen [T, width] long."""
    return (torch.empty((T, width), dtype=dtype, device=device),
            torch.empty((T, width), dtype=torch.long, device=device))


def route_config(N: int, k: int, dtype: torch.dtype) -> dict[str, int | bool]:
    """route_row's block, warps and top-k form for N experts, k chosen, logits of dtype: every kernel that runs it
    launches with these, so their reductions, and the pairs' bits, are the same."""
    block = triton.next_power_of_2(N)
    packed = PACKED_KEYS and dtype == torch.bfloat16 and block <= 65536
    return {"K": k, "BLOCK_N": block, "BLOCK_K": triton.next_power_of_2(k), "PACKED": packed,
            "num_warps": 1 if block <= 1024 else 4}


def softmax_top_k(logits: torch.Tensor, k: int, shared: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: logits [T, N] -> (weights [T, k'], chosen [T, k'] long), k' = k + (shared is not None)."""
    logits = row_major(logits)
    T, N = logits.shape
    weights, chosen = pairs(T, k + (shared is not None), logits.dtype, logits.device)
    if T:
        gate = logits if shared is None else shared
        _route_kernel[(T,)](logits, gate, weights, chosen, N, logits.stride(0), gate.stride(0), weights.stride(0),
                            chosen.stride(0), SHARED=shared is not None, **route_config(N, k, logits.dtype),
                            **pdl.options(logits))
    return weights, chosen


@triton.jit(do_not_specialize=["N"])
def _sigmoid_route_kernel(logit_ptr, bias_ptr, weight_ptr, chosen_ptr, N, S, s_lt, s_wt, s_ct, scale,
                          K: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_S: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr,
                          LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    """weights[t], chosen[t] from logits[t]: expert g·S + s at [g, s] of the block (S experts a group)."""
    pdl.ordered(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    s = tl.arange(0, BLOCK_S)[None, :]
    valid = (g < GROUPS) & (s < S)
    col = tl.where(valid, g * S + s, N)                                     # [BG, BS] the expert id, N: padding
    logit = tl.load(logit_ptr + t * s_lt + col, mask=valid, other=0.0).to(tl.float32)
    score = sigmoid(logit, LIBDEVICE)
    biased = score + tl.load(bias_ptr + col, mask=valid, other=0.0)
    key = tl.where(valid & (biased == biased), biased, float("-inf"))     # padding and NaN: -inf
    if GROUPS > 1:
        best = tl.max(key, 1)                                               # [BG] each group's best
        first = tl.min(tl.where(valid & (key == best[:, None]), s, BLOCK_S), 1)
        second = tl.max(tl.where(s == first[:, None], float("-inf"), key), 1)
        g1 = tl.arange(0, BLOCK_G)
        group_score = tl.where(g1 < GROUPS, best + second, float("-inf"))
        kept = g1 < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(kept, float("-inf"), group_score), 0)
            lowest = tl.min(tl.where((g1 < GROUPS) & (kept == 0) & (group_score == top), g1, BLOCK_G), 0)
            kept = kept | (g1 == lowest)
        key = tl.where(kept[:, None], key, float("-inf"))
    taken = col < 0
    for _ in tl.static_range(K):
        top = tl.max(tl.max(tl.where(taken, float("-inf"), key), 1), 0)
        lowest = tl.min(tl.min(tl.where(valid & (taken == 0) & (key == top), col, N), 1), 0)
        taken = taken | (col == lowest)
    w = score
    if NORM:
        w = div(score, tl.sum(tl.sum(tl.where(taken, score, 0.0), 1), 0) + 1e-20)
    w = w * scale
    for j in tl.static_range(K):
        lowest = tl.min(tl.min(tl.where(taken, col, N), 1), 0)
        tl.store(chosen_ptr + t * s_ct + j, lowest.to(tl.int64))
        tl.store(weight_ptr + t * s_wt + j, tl.sum(tl.sum(tl.where(col == lowest, w, 0.0), 1), 0))
        taken = taken & (col != lowest)
    if SHARED:
        tl.store(chosen_ptr + t * s_ct + K, N.to(tl.int64))
        tl.store(weight_ptr + t * s_wt + K, 1.0)


def sigmoid_bias_top_k(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1,
                       norm: bool = True, scale: float = 1.0, shared: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: logits [T, N], bias [N] float32 -> (weights [T, k'] float32, chosen [T, k'] long), k' = k + shared."""
    logits = row_major(logits)
    T, N = logits.shape
    width = k + int(shared)
    weights = torch.empty((T, width), dtype=torch.float32, device=logits.device)
    chosen = torch.empty((T, width), dtype=torch.long, device=logits.device)
    if T:
        size = N // n_group
        block_g, block_s = triton.next_power_of_2(n_group), triton.next_power_of_2(size)
        _sigmoid_route_kernel[(T,)](logits, bias.contiguous(), weights, chosen, N, size, logits.stride(0),
                                    weights.stride(0), chosen.stride(0), float(scale), K=k, GROUPS=n_group,
                                    TOPK_GROUP=topk_group, BLOCK_G=block_g, BLOCK_S=block_s, NORM=norm,
                                    SHARED=shared, LIBDEVICE=not INTERPRETED,
                                    num_warps=1 if block_g * block_s <= 1024 else 4, enable_fp_fusion=False,
                                    **pdl.options(logits))
    return weights, chosen
