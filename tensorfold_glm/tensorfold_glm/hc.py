"""Manifold-constrained hyper-connections (mHC) and the norms around them (HF glm5_next).

The residual is `mult` streams per token instead of one. The embedding is copied to every stream. Each block
(attention, then the MLP) reads and writes the streams through three per-token mixes, computed in float32 from
the streams themselves:

    mixes = rms(flatten(streams)) @ fnᵀ                                   unweighted RMSNorm, [(2 + m)·m]
    pre   = sigmoid(mixes_pre · s0 + b_pre) + hc_eps                      [m]      collapse to the block input
    post  = 2 · sigmoid(mixes_post · s1 + b_post)                         [m]      spread the block output
    comb  = Sinkhorn(softmax(mixes_comb · s2 + b_comb) + hc_eps)          [m, m]   near doubly stochastic
    block input = Σ_i pre_i · stream_i
    stream'_j   = post_j · out + Σ_i comb[i, j] · stream_i

Sinkhorn: one column normalisation x / (colsum + hc_eps), then `iters - 1` rounds of row then column. After the
last layer the streams are averaged (`hc_head`, an unweighted mean) and the final RMSNorm follows. The layer norms
scale by a plain w (not the zero-centred 1 + w of Qwen3.5).

Shapes in comments: T rows, m streams (hc_mult), E hidden size, M = (2 + m)·m mixes.

Everything here except `hc_mixes` (one float32 GEMM over the rows) works row by row in a fixed order, so a row's
result does not depend on the other rows of the call.

On CUDA, hc_pre (after its mixes GEMM) and hc_post run hc_fused's Triton kernels: three launches per block instead
of ~120 tiny torch ops. hc_post's kernel is bit for bit `spread`; the coefficients may differ from hc_coefficients
in the last bits of float32 (exp and the softmax's last step), see hc_fused. The torch functions here are the CPU
path and the reference.
"""

from __future__ import annotations

from types import ModuleType

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.rmsnorm import rms_norm as kernel_rms_norm


@attrs.frozen
class HcWeights:
    """One block's hyper-connection (HF `layers.{i}.hc_attn_*` or `layers.{i}.hc_ffn_*`; the module attributes
    `attn_hc.*` / `ffn_hc.*`). base and scale stay float32 at a bf16 load; fn takes the model dtype."""

    fn: torch.Tensor                    # [M, m·E]   M = (2 + m)·m
    base: torch.Tensor                  # [M]        float32
    scale: torch.Tensor                 # [3]        float32: pre, post, comb

    @property
    def mult(self) -> int:
        """m, the number of streams, from base's length M = (2 + m)·m."""
        return int(round((1 + self.base.shape[0]) ** 0.5 - 1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Layer and final RMSNorm, plain w: w · (x̂ in float32, cast back to x's dtype), the product in the
    weight's dtype (the model dtype)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def step_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` for the decode step: where Triton runs, core's kernel in the same order (one launch instead of
    seven torch ops; its 1/sqrt IEEE-rounded, so within an ulp of the torch ops, not their bits); elsewhere the
    torch ops themselves. x [N, D]."""
    if use_triton(x):
        return kernel_rms_norm(x, weight, eps, zero_centred=False, weight_after_cast=True)
    return rms_norm(x, weight, eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps), the factor computed in float32 then cast to x's dtype (no weight)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def expand(x: torch.Tensor, mult: int) -> torch.Tensor:
    """The embedding copied to every stream: [T, E] -> [T, m, E] (contiguous)."""
    return x.unsqueeze(1).expand(-1, mult, -1).contiguous()


def hc_mixes(w: HcWeights, streams: torch.Tensor, eps: float) -> torch.Tensor:
    """The raw mixes: unweighted RMSNorm of the flattened streams, then fn, all in float32: [T, m, E] -> [T, M]."""
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), eps)   # [T, m·E] float32
    return F.linear(flat, w.fn.float())                                               # [T, M] float32


def sinkhorn(comb: torch.Tensor, iters: int, hc_eps: float) -> torch.Tensor:
    """One column normalisation, then iters - 1 rounds of (row, column), each x / (sum + hc_eps): [..., m, m]."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def hc_coefficients(w: HcWeights, mixes: torch.Tensor, iters: int, hc_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw mixes [T, M] float32 -> (pre [T, m], post [T, m], comb [T, m, m]), float32, row by row."""
    m = w.mult
    pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
    base = w.base.float()
    pre_b, post_b, comb_b = base.split([m, m, m * m])
    pre_s, post_s, comb_s = w.scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    logits = comb_w.reshape(-1, m, m) * comb_s + comb_b.reshape(m, m)              # [T, m, m]: [in i, out j]
    comb = sinkhorn(torch.softmax(logits, dim=-1) + hc_eps, iters, hc_eps)
    return pre, post, comb


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block input Σ_i pre_i · stream_i, summed in float32 in stream order, cast to the streams' dtype:
    pre [T, m] float32, streams [T, m, E] -> [T, E]."""
    total = pre[:, 0, None] * streams[:, 0]                                          # [T, E] float32
    for i in range(1, streams.shape[1]):
        total = total + pre[:, i, None] * streams[:, i]
    return total.to(streams.dtype)


def _fused(streams: torch.Tensor) -> ModuleType | None:
    """hc_fused where its kernels apply (CUDA with triton, m up to its MAX_STREAMS), else None: the torch form."""
    if not use_triton(streams):
        return None
    from tensorfold_glm import hc_fused  # triton: the gpu extra
    return hc_fused if streams.shape[1] <= hc_fused.MAX_STREAMS else None


def hc_pre(w: HcWeights, streams: torch.Tensor, eps: float, iters: int, hc_eps: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entering a block: streams [T, m, E] -> (block input [T, E] in the streams' dtype, post [T, m] float32,
    comb [T, m, m] float32). eps is the model's rms_norm_eps, iters hc_sinkhorn_iters."""
    mixes = hc_mixes(w, streams, eps)
    fused = _fused(streams)
    if fused is not None:
        return fused.coefficients_and_collapse(mixes, w.base, w.scale, streams, iters, hc_eps)
    pre, post, comb = hc_coefficients(w, mixes, iters, hc_eps)
    return collapse(pre, streams), post, comb


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Leaving a block: stream'_j = post_j · out + Σ_i comb[i, j] · stream_i -> [T, m, E] in the streams' dtype
    (`spread`; on CUDA its one-launch kernel, the same bits)."""
    fused = _fused(streams)
    if fused is not None:
        return fused.post(block_out, streams, post, comb)
    return spread(block_out, streams, post, comb)


def spread(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_post in torch ops: stream'_j = post_j · out + Σ_i comb[i, j] · stream_i -> [T, m, E] in streams' dtype.

    post and comb are cast to the streams' dtype first (as HF does); the comb mix is summed in float32 in stream
    order and rounded once (HF's batched matmul accumulates in float32 too), then added to post · out."""
    dtype = streams.dtype
    post, comb = post.to(dtype), comb.to(dtype).float()                             # [T, m], [T, m, m]
    mixed = comb[:, 0, :, None] * streams[:, 0, None, :].float()                    # [T, m, E] float32
    for i in range(1, streams.shape[1]):
        mixed = mixed + comb[:, i, :, None] * streams[:, i, None, :].float()
    return post[:, :, None] * block_out[:, None, :].to(dtype) + mixed.to(dtype)


def hc_head(streams: torch.Tensor) -> torch.Tensor:
    """The final collapse before the final norm: the unweighted mean of the streams, [T, m, E] -> [T, E]."""
    return streams.mean(dim=1)
