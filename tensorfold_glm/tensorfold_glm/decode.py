"""The decode step: one token for each of B streams, tensors in and out, no host sync, so a CUDA graph captures it
(core's engine/graphs.py) and replays it for every batch padded to B.

    streams = embed(tokens) copied to m streams                                    [B, m, E]
    per layer, per block: hc_pre, rms_norm, the block, hc_post (hc.py: row by row, as in model.py)
        KDA:    the q/k/v projections, the conv on each row's slot tail (read by index, written through
                write_rows: a padded row writes none), the gates, kernels/kda's recurrent step on the slots' float32
                states (in place; a padded row touches none), the gated norm, o_proj
        MLA:    mla_decode.py: the latent and the pool state written, the DSA pick on the device over the pooled
                keys read through the page tables, the attention over the picked latents with kv_b absorbed
        ffn:    the clamped SwiGLU, or the MoE through mlp.moe_routed (on CUDA mlp.moe_fused: the router GEMM, the
                routing kernel, the grouped experts with the shared one folded in; on the CPU routing in tensor ops
                and the experts in the kernels' routed_experts)
        TP=N:   each block's output is this rank's part, summed over ranks by shard.reduce as in model.py
    logits = lm_head(rms_norm(mean over streams))                                  [B, V] float32

Every op but the MLA attention is model.py's per-stream path (`hidden`) for one token, on B rows instead of one (the
conv, the KDA step and the experts on slots and pairs instead of one stream); where Triton runs, the block norms and
the MLA's q_a / kv_a norms are core's rms_norm kernel in hc.rms_norm's order (hc.step_rms_norm: one launch, within
an ulp of the torch ops). On the CPU a stream alone in its batch
therefore writes every state up to the first MLA layer's attention as `hidden` does, bit for bit; the MLA's other
order of products (mla_decode.py) and, in a larger batch, the GEMMs' rounding of a row by its place carry a few ulps
into what follows (tests/test_glm_decode.py states the bounds). `forward` runs a step's one-token rows through this
step too (model.py `decoded`), so a decode row has the same bits in a pure decode step and in one mixed with a
prefill chunk. The naive CPU paths of core's kernels read slots and experts back; their GPU paths do not, and
nothing else here does. A row at position 0 must go through `hidden` (it clears the stream's states); neither the
runner nor `forward` sends one. On CUDA the step needs Triton (the experts, the paged writes)
and, with KDA layers, fla-core (the only sync-free KDA step): `sync_free` says whether this model has them, and
the model offers `decode` only then.
Shapes in comments: B rows, m streams, E hidden, H KDA heads of D, C = 3·H·D conv channels, K conv kernel, S slots,
V vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import triton_installed
from tensorfold.kernels.kda import kda_gate, recurrent_kda_step, step_backend
from tensorfold.kernels.paged_write import write_rows
from tensorfold.kv import KvStore
from tensorfold.plan import DecodeBatch
from tensorfold_glm.config import CONV, RECURRENT, GlmConfig
from tensorfold_glm.hc import expand, hc_head, hc_post, hc_pre, step_rms_norm
from tensorfold_glm.kda import KdaWeights, gated_norm
from tensorfold_glm.mla_decode import Rows, mla_step
from tensorfold_glm.mlp import MlpWeights, MoeWeights, moe_routed, swiglu

if TYPE_CHECKING:
    from tensorfold_glm.model import GlmModel


def sync_free(model: GlmModel) -> bool:
    """Whether `decode` runs without a host sync on the model's device: anywhere but CUDA (where it is never
    captured), or on CUDA with Triton and, for a model with KDA layers, kernels/kda's fla step."""
    if model.device.type != "cuda":
        return True
    kda = any(isinstance(layer.mixer, KdaWeights) for layer in model.weights.layers)
    return triton_installed() and (not kda or step_backend(model.device) == "fla")


@torch.no_grad()
def decode(model: GlmModel, batch: DecodeBatch, kv: KvStore) -> torch.Tensor:
    """One token per row through every layer; float32 logits [B, V] (rows of padding hold no meaning)."""
    c, w = model.config, model.weights
    mla = [i for i, layer in enumerate(w.layers) if not isinstance(layer.mixer, KdaWeights)]
    rows = Rows.of(batch, kv, mla[0]) if mla else None
    streams = expand(w.embed[batch.tokens], c.hc_mult)                                 # [B, m, E]
    picked = None
    for index, layer in enumerate(w.layers):
        x, post, comb = hc_pre(layer.attn_hc, streams, c.rms_norm_eps, c.hc_sinkhorn_iters, c.hc_eps)
        h = step_rms_norm(x, layer.input_norm, c.rms_norm_eps)
        if isinstance(layer.mixer, KdaWeights):
            out = kda_step(layer.mixer, c, h, batch.slots, index, kv)
            picked = None
        else:
            out, picked = mla_step(layer.mixer, model.mla_dims, h, rows, kv, index, picked)
        streams = hc_post(model.shard.reduce(out), streams, post, comb)
        x, post, comb = hc_pre(layer.ffn_hc, streams, c.rms_norm_eps, c.hc_sinkhorn_iters, c.hc_eps)
        h = step_rms_norm(x, layer.post_norm, c.rms_norm_eps)
        streams = hc_post(model.shard.reduce(ffn(layer.ffn, c, h)), streams, post, comb)
    return model.logits(hc_head(streams))


def ffn(w: MlpWeights | MoeWeights, c: GlmConfig, h: torch.Tensor) -> torch.Tensor:
    """The clamped SwiGLU, or the MoE with no host sync: [B, E] -> [B, E]."""
    if isinstance(w, MoeWeights):
        return moe_routed(w, h, c.num_experts_per_tok, c.routed_scaling_factor, c.norm_topk_prob, c.n_group,
                          c.topk_group, c.swiglu_limit)
    return swiglu(w, h, c.swiglu_limit)


def kda_step(w: KdaWeights, c: GlmConfig, x: torch.Tensor, slots: torch.Tensor, index: int,
             kv: KvStore) -> torch.Tensor:
    """kda.kimi_delta_attention for one token of each of B streams, on their slots' conv tails and recurrent
    states (in place; a padded row touches neither): [B, E] -> [B, E]."""
    B, H, D = x.shape[0], c.linear_num_heads, c.linear_head_dim
    if w.inputs is not None:                                                          # stacked: one GEMM over x
        qkv, f_a, b, g_a = F.linear(x, w.inputs).split([3 * H * D, D, H, D], dim=-1)
    else:
        qkv = torch.cat((F.linear(x, w.q_proj), F.linear(x, w.k_proj), F.linear(x, w.v_proj)), dim=-1)   # [B, C]
        f_a, b, g_a = F.linear(x, w.f_a_proj), F.linear(x, w.b_proj), F.linear(x, w.g_a_proj)
    qkv = conv_step(qkv, w.conv, kv.fixed_states(index, CONV, x.dtype), slots)      # [B, C]
    q, k, v = qkv.view(B, 3, H, D).unbind(1)                                          # [B, H, D] each
    g, beta = kda_gate(F.linear(f_a, w.f_b_proj), b, w.A_log, w.dt_bias, c.linear_lower_bound)   # float32
    # q and k l2-normalised and q scaled inside the step (on the CPU the same torch ops as kda.py, bit for bit;
    # with fla, in its kernel: no launches of their own)
    out = recurrent_kda_step(q.float(), k.float(), v.float(), g, beta,
                             kv.fixed_states(index, RECURRENT, torch.float32), slots, scale=1 / D ** 0.5,
                             qk_l2norm=True)
    gate = F.linear(g_a, w.g_b_proj).view(B, H, D)                                   # [B, H, D]
    out = gated_norm(out.to(x.dtype), gate, w.o_norm, c.rms_norm_eps)
    return F.linear(out.reshape(B, H * D), w.o_proj)                                  # [B, E]


def conv_step(x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """kda.causal_conv for one row of each of B streams: x [B, C], weight [C, K] (the conv in its dtype), tails
    [S, C, K-1] in x's dtype (each live row's slot shifted in place, a padded row's untouched) -> [B, C] in x's
    dtype. core's causal_conv1d_update computes in x's dtype; GLM's conv weight stays float32 on a bf16 model."""
    C = weight.shape[0]
    window = torch.cat((tails.index_select(0, slots.clamp(min=0)), x[:, :, None]), dim=2)   # [B, C, K]
    write_rows(tails[:, None], window[:, :, 1:], slots)
    out = F.conv1d(window.to(weight.dtype), weight[:, None, :], groups=C)[:, :, 0]     # [B, C]
    return F.silu(out).to(x.dtype)
