"""GLM's mHC on CUDA in three Triton launches (hc.py has the math and the torch reference these follow).

hc.py's torch form costs ~120 tiny kernels per block (sigmoid, softmax, the Sinkhorn rounds over [T, m, m], the
loops over streams); here a block costs the mixes (hc_mixes, unchanged), two launches entering it and one leaving it:

- `coefficients`: one program per BLOCK_T rows: pre, post and comb in float32 registers, op by op in
  hc_coefficients' order. Every sum over streams is taken in stream order one term at a time (a masked tl.sum that
  keeps one element is exact), so no reduction tree decides a bit; divisions are IEEE (div_rn) and exp is
  libdevice's (CUDA's expf, which torch's CUDA sigmoid calls). Softmax divides by its sum, as torch's CUDA kernel
  does (its CPU kernel multiplies by the reciprocal and has its own exp: the coefficients differ from the torch
  form in the last bits, docs/families/glm.md "Fused mHC").
- `collapse`: one program per (row, E-block): Σ_i pre_i · stream_i in float32 in stream order, rounded once.
- `post`: one program per (row, E-block): hc_post bit for bit, every cast and rounding where hc_post has it.

Kernels compile without fp fusion: a fused multiply-add would round a product and a sum once where torch rounds
twice. No launcher reads a value back to the host and every shape follows the inputs', so the launches can be
captured in a CUDA graph; each row is computed alone in a fixed order, so a row's bits do not depend on the batch.
bfloat16 rounding is done on the bits (nearest even), because triton's interpreter truncates on a plain cast.

Shapes: T rows, m streams (1..MAX_STREAMS), E hidden size, M = (2 + m)·m mixes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels.triton_ieee import INTERPRETED
from tensorfold.kernels.triton_ieee import div as _div
from tensorfold.kernels.triton_ieee import exp as _exp
from tensorfold.kernels.triton_ieee import sigmoid as _sigmoid
from tensorfold.kernels.triton_rounding import round_to

MAX_STREAMS = 8                                                    # m is padded to a power of two up to this
BLOCK_T = 16                                                       # rows per coefficients program
MAX_BLOCK_E = 1024                                                 # columns per collapse / post program


@triton.jit
def _sum_in_order(x, idx, axis: tl.constexpr, M: tl.constexpr):
    """Σ_k x[k] along axis for k = 0..M-1 added in that order (kept dims); each term is picked alone, exactly."""
    total = tl.sum(tl.where(idx == 0, x, 0.0), axis=axis, keep_dims=True)
    for k in tl.static_range(1, M):
        total = total + tl.sum(tl.where(idx == k, x, 0.0), axis=axis, keep_dims=True)
    return total


@triton.jit
def _coefficients_kernel(mixes_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, stride_mix, hc_eps,
                         M: tl.constexpr, MP: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
    """pre [T, M], post [T, M], comb [T, M, M] from the raw mixes [T, (2 + M)·M], hc_coefficients op by op."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)     # [BT]
    row_ok = rows < T
    s = tl.arange(0, MP)                                                         # [MP] a stream, padded
    s_ok = s < M
    pre_s = tl.load(scale_ptr).to(tl.float32)
    post_s = tl.load(scale_ptr + 1).to(tl.float32)
    comb_s = tl.load(scale_ptr + 2).to(tl.float32)
    ok = row_ok[:, None] & s_ok[None, :]                                         # [BT, MP]
    mix_row = mixes_ptr + rows[:, None] * stride_mix                             # [BT, 1]
    pre_w = tl.load(mix_row + s[None, :], mask=ok, other=0.0).to(tl.float32)
    pre_b = tl.load(base_ptr + s, mask=s_ok, other=0.0).to(tl.float32)
    pre = _sigmoid(pre_w * pre_s + pre_b[None, :], LIBDEVICE) + hc_eps
    post_w = tl.load(mix_row + M + s[None, :], mask=ok, other=0.0).to(tl.float32)
    post_b = tl.load(base_ptr + M + s, mask=s_ok, other=0.0).to(tl.float32)
    post = 2.0 * _sigmoid(post_w * post_s + post_b[None, :], LIBDEVICE)
    tl.store(pre_ptr + rows[:, None] * M + s[None, :], pre, mask=ok)
    tl.store(post_ptr + rows[:, None] * M + s[None, :], post, mask=ok)

    i = s[None, :, None]                                                         # [1, MP, 1] input stream
    j = s[None, None, :]                                                         # [1, 1, MP] output stream
    k = 2 * M + i * M + j                                                        # where comb[i, j]'s mix sits
    in_range = (i < M) & (j < M)
    comb_w = tl.load(mixes_ptr + rows[:, None, None] * stride_mix + k,
                     mask=row_ok[:, None, None] & in_range, other=0.0).to(tl.float32)
    comb_b = tl.load(base_ptr + k, mask=in_range, other=0.0).to(tl.float32)
    logits = tl.where(j < M, comb_w * comb_s + comb_b, float("-inf"))            # [BT, MP, MP]; padding adds 0
    e = _exp(logits - tl.max(logits, axis=2, keep_dims=True), LIBDEVICE)
    comb = _div(e, _sum_in_order(e, j, 2, M)) + hc_eps                           # softmax over j, + hc_eps
    comb = _div(comb, _sum_in_order(comb, i, 1, M) + hc_eps)                     # Sinkhorn: columns first,
    for _ in range(ITERS - 1):                                                   # then rows and columns
        comb = _div(comb, _sum_in_order(comb, j, 2, M) + hc_eps)
        comb = _div(comb, _sum_in_order(comb, i, 1, M) + hc_eps)
    tl.store(comb_ptr + rows[:, None, None] * (M * M) + i * M + j, comb, mask=row_ok[:, None, None] & in_range)


@triton.jit
def _collapse_kernel(streams_ptr, pre_ptr, out_ptr, E, stride_st, stride_ss, stride_o,
                     M: tl.constexpr, BLOCK_E: tl.constexpr):
    """out[t] = Σ_i pre[t, i] · streams[t, i] in float32 in stream order, rounded once to out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)                    # [BE]
    ok = cols < E
    stream = streams_ptr + row * stride_st + cols
    total = tl.load(pre_ptr + row * M) * tl.load(stream, mask=ok, other=0.0).to(tl.float32)
    for i in tl.static_range(1, M):
        total = total + tl.load(pre_ptr + row * M + i) * tl.load(stream + i * stride_ss, mask=ok, other=0.0).to(
            tl.float32)
    tl.store(out_ptr + row * stride_o + cols, round_to(total, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _post_kernel(block_out_ptr, streams_ptr, post_ptr, comb_ptr, new_ptr, E, stride_b, stride_st, stride_ss,
                 stride_nt, stride_ns, M: tl.constexpr, MP: tl.constexpr, BLOCK_E: tl.constexpr):
    """new[t, j] = round(round(post_j · out) + round(Σ_i comb[i, j] · stream_i)), hc_post's casts in its order."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)                    # [BE]
    ok = cols < E
    j = tl.arange(0, MP)                                                         # [MP] output stream, padded
    j_ok = j < M
    ty = new_ptr.dtype.element_ty
    stream = streams_ptr + row * stride_st + cols
    comb_row = comb_ptr + row * (M * M) + j                                      # comb[t, i, :] at + i·M
    weight = round_to(tl.load(comb_row, mask=j_ok, other=0.0).to(tl.float32), ty)
    mixed = weight[:, None] * tl.load(stream, mask=ok, other=0.0).to(tl.float32)[None, :]        # [MP, BE]
    for i in tl.static_range(1, M):
        weight = round_to(tl.load(comb_row + i * M, mask=j_ok, other=0.0).to(tl.float32), ty)
        mixed = mixed + weight[:, None] * tl.load(stream + i * stride_ss, mask=ok, other=0.0).to(tl.float32)[None, :]
    post = round_to(tl.load(post_ptr + row * M + j, mask=j_ok, other=0.0).to(tl.float32), ty)
    out = round_to(tl.load(block_out_ptr + row * stride_b + cols, mask=ok, other=0.0).to(tl.float32), ty)
    new = round_to(round_to(post[:, None] * out[None, :], ty) + round_to(mixed, ty), ty)
    tl.store(new_ptr + row * stride_nt + j[:, None] * stride_ns + cols[None, :], new,
             mask=j_ok[:, None] & ok[None, :])


def _check_mult(op: str, mult: int) -> None:
    """The kernels pad m to a power of two in registers: refuse what they were not written for."""
    if not 1 <= mult <= MAX_STREAMS:
        raise ValueError(f"{op}: hc_mult must be 1..{MAX_STREAMS}, got {mult}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride in its last dim (a no-op for the model's tensors)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _block_e(width: int, tile_rows: int) -> int:
    """Columns per program: up to MAX_BLOCK_E, and at most 4k float32 values of a [tile_rows, BLOCK_E] tile."""
    return min(triton.next_power_of_2(width), MAX_BLOCK_E, max(16, 4096 // tile_rows))


def coefficients(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, mult: int, iters: int,
                 hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw mixes [T, M] float32, base [M], scale [3] -> (pre [T, m], post [T, m], comb [T, m, m]) float32."""
    _check_mult("coefficients", mult)
    n_mixes = (2 + mult) * mult
    if mixes.dim() != 2 or mixes.shape[1] != n_mixes or mixes.dtype != torch.float32:
        raise ValueError(f"coefficients: mixes must be float32 [T, {n_mixes}], got {list(mixes.shape)} {mixes.dtype}")
    if tuple(base.shape) != (n_mixes,) or tuple(scale.shape) != (3,):
        raise ValueError(f"coefficients: base must be [{n_mixes}] and scale [3], got {list(base.shape)}, "
                         f"{list(scale.shape)}")
    mixes = _rows(mixes)
    n = mixes.shape[0]
    pre = torch.empty((n, mult), dtype=torch.float32, device=mixes.device)
    post = torch.empty((n, mult), dtype=torch.float32, device=mixes.device)
    comb = torch.empty((n, mult, mult), dtype=torch.float32, device=mixes.device)
    if n:
        _coefficients_kernel[(triton.cdiv(n, BLOCK_T),)](
            mixes, base.contiguous(), scale.contiguous(), pre, post, comb, n, mixes.stride(0), hc_eps,
            M=mult, MP=triton.next_power_of_2(mult), ITERS=iters, BLOCK_T=BLOCK_T, LIBDEVICE=not INTERPRETED,
            num_warps=4, enable_fp_fusion=False)
    return pre, post, comb


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block input Σ_i pre_i · stream_i: pre [T, m] float32, streams [T, m, E] -> [T, E] in streams' dtype."""
    if streams.dim() != 3 or tuple(pre.shape) != tuple(streams.shape[:2]) or pre.dtype != torch.float32:
        raise ValueError(f"collapse: streams must be [T, m, E] and pre float32 [T, m], got {list(streams.shape)}, "
                         f"{list(pre.shape)} {pre.dtype}")
    _check_mult("collapse", streams.shape[1])
    streams, pre = _rows(streams), pre.contiguous()
    n, mult, width = streams.shape
    out = torch.empty((n, width), dtype=streams.dtype, device=streams.device)
    if out.numel():
        block_e = _block_e(width, 1)
        _collapse_kernel[(n, triton.cdiv(width, block_e))](
            streams, pre, out, width, streams.stride(0), streams.stride(1), out.stride(0),
            M=mult, BLOCK_E=block_e, num_warps=4, enable_fp_fusion=False)
    return out


def coefficients_and_collapse(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor,
                              iters: int, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_pre after its mixes GEMM, in two launches: -> (block input [T, E] in the streams' dtype, post [T, m],
    comb [T, m, m] float32)."""
    pre, post, comb = coefficients(mixes, base, scale, streams.shape[1], iters, hc_eps)
    return collapse(pre, streams), post, comb


def post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_post in one launch: block_out [T, E], streams [T, m, E], post [T, m], comb [T, m, m] -> new streams
    [T, m, E] in the streams' dtype, bit for bit hc_post's."""
    if streams.dim() != 3 or tuple(block_out.shape) != (streams.shape[0], streams.shape[2]) \
            or tuple(post.shape) != tuple(streams.shape[:2]) or tuple(comb.shape) != tuple(streams.shape[:2]) + (
            streams.shape[1],):
        raise ValueError(f"post: want block_out [T, E], streams [T, m, E], post [T, m], comb [T, m, m], got "
                         f"{list(block_out.shape)}, {list(streams.shape)}, {list(post.shape)}, {list(comb.shape)}")
    _check_mult("post", streams.shape[1])
    streams, block_out, post, comb = _rows(streams), _rows(block_out), post.contiguous(), comb.contiguous()
    n, mult, width = streams.shape
    new = torch.empty((n, mult, width), dtype=streams.dtype, device=streams.device)
    if new.numel():
        mp = triton.next_power_of_2(mult)
        block_e = _block_e(width, mp)
        _post_kernel[(n, triton.cdiv(width, block_e))](
            block_out, streams, post, comb, new, width, block_out.stride(0), streams.stride(0), streams.stride(1),
            new.stride(0), new.stride(1), M=mult, MP=mp, BLOCK_E=block_e, num_warps=4, enable_fp_fusion=False)
    return new
