"""Multi-head latent attention (MLA) with DSA sparse selection, the indexed-attention mixer of GLM-5.3-Flash,
for one stream and one step.

    q_resid = RMSNorm(q_a_proj x);  q = q_b_proj(q_resid)              [T, H, DQ]       DQ = qk_nope_head_dim
    latent = RMSNorm(kv_a_proj_with_mqa x)                             [T, R]           stored per row
    [k | v] = kv_b_proj(latent) for every row [0, end)                 [S, H, DQ + DV]
    out = softmax(q kᵀ / sqrt(DQ), masked to the selection) v -> o_proj
    selection: the layer's own DSA indexer (indexer.py), or for a "shared" layer the previous layer's selection

The text model has no RoPE (qk_rope_head_dim 0, which HF's config enforces), so kv_a_proj gives the latent only.
RMSNorm is weighted (w·x̂, x̂ in float32 then back to x's dtype) with rms_norm_eps. Scores are scaled by
(qk_nope_head_dim + qk_rope_head_dim)^-0.5 and softmaxed in float32, probabilities cast back to x's dtype. A row
that selects no key (possible only without always_select_tail) outputs zeros, as HF's SDPA path does.
The KvStore holds the normalised latent (row "latent"); a full indexer adds rows "pooled_key" and the fixed
"pool_tail". This reference recomputes K and V from the latents every step.

Two forms of the softmax attention, by device:
- CPU (`attend`, the reference, HF eager's arithmetic): scores [H, t, S] by einsum in x's dtype, masked to the
  selection, softmax in float32, probabilities cast back to x's dtype, einsum with v; query rows in blocks whose
  float32 scores take at most SCORE_BYTES.
- CUDA (core's `masked_attention` kernel): flash-style online softmax in float32 with the selection as its mask,
  the scores never in memory; key blocks on the absolute grid, so a row's bits depend on its q, its selection and
  its keys only, not on the chunk it sits in (resumed == fresh holds). Its bits differ from the einsum form's,
  which the family's identity fact `mla_attention` says.
Shapes in comments: T rows of this step, S = end keys, E hidden, H heads, R kv_lora_rank.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.masked_attention import masked_attention
from tensorfold.kv import KvStore
from tensorfold_glm import indexer as dsa

SCORE_BYTES = 256 << 20     # float32 scores one block of query rows may take (CPU): long prompts attend in blocks


@attrs.frozen
class MlaWeights:
    """One MLA layer's tensors (HF names under `self_attn.`); indexer None for a "shared" layer."""

    q_a_proj: torch.Tensor                      # [Q, E]
    q_a_layernorm: torch.Tensor                 # [Q]
    q_b_proj: torch.Tensor                      # [H·DQ, Q]
    kv_a_proj_with_mqa: torch.Tensor            # [R, E]
    kv_a_layernorm: torch.Tensor                # [R]
    kv_b_proj: torch.Tensor                     # [H·(DQ + DV), R]   per head: DQ key rows, then DV value rows
    o_proj: torch.Tensor                        # [E, H·DV]
    indexer: dsa.IndexerWeights | None = None


@attrs.frozen
class MlaDims:
    """The config numbers MLA needs (HF: num_attention_heads, qk_nope_head_dim, v_head_dim, rms_norm_eps and the
    index_* fields)."""

    heads: int
    qk_nope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    index: dsa.IndexerDims


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm: x̂ in float32, back to x's dtype, times w."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def mla_attention(w: MlaWeights, d: MlaDims, x: torch.Tensor, start: int, kv: KvStore, layer: int, slot: int,
                  selection_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [start, start + T) of one stream through the layer: [T, E] -> ([T, E], selection [T, start + T]).

    A full layer computes its selection; a shared layer (w.indexer None) takes selection_in, the mask the
    previous decoder layer used for the same rows. The selection used is returned for the next layer.
    """
    T, H, DQ, DV = x.shape[0], d.heads, d.qk_nope_head_dim, d.v_head_dim
    end = start + T
    q_resid = rms_norm(F.linear(x, w.q_a_proj), w.q_a_layernorm, d.rms_norm_eps)   # [T, Q]
    q = F.linear(q_resid, w.q_b_proj).view(T, H, DQ)                                # [T, H, DQ]
    latent = rms_norm(F.linear(x, w.kv_a_proj_with_mqa), w.kv_a_layernorm, d.rms_norm_eps)   # [T, R]

    # Write this step's rows first, then read the whole window back.
    kv.write_rows(layer, "latent", slot, start, latent)
    latents = kv.rows(layer, "latent", slot, end)                                   # [S, R]
    k, v = F.linear(latents, w.kv_b_proj).view(end, H, DQ + DV).split([DQ, DV], dim=-1)   # [S, H, DQ], [S, H, DV]

    if w.indexer is not None:
        selection = index_step(w.indexer, d.index, x, q_resid, start, kv, layer, slot)
    elif selection_in is None:
        raise ValueError(f"layer {layer} shares its DSA selection but the previous layer passed none")
    else:
        selection = selection_in
    if selection.shape != (T, end):
        raise ValueError(f"layer {layer}: selection {tuple(selection.shape)} does not cover rows {T} x keys {end}")

    out = attention(q, k, v, selection)                                             # [T, H, DV]
    return F.linear(out.reshape(T, H * DV), w.o_proj), selection                   # [T, E]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
    """Every query row's attention: q [T, H, DQ], k [S, H, DQ], v [S, H, DV], selection [T, S] -> [T, H, DV]. The
    masked_attention kernel on a Triton device; elsewhere the einsum form in blocks of rows that bound the scores."""
    if use_triton(q):
        return masked_attention(q, k, v, selection, q.shape[-1] ** -0.5)
    T, H, S = q.shape[0], q.shape[1], k.shape[0]
    rows = max(1, SCORE_BYTES // (H * S * 4))             # query rows per block: bounds the scores' memory
    return torch.cat([attend(q[a: a + rows], k, v, selection[a: a + rows], q.dtype) for a in range(0, T, rows)])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: torch.Tensor, dtype: torch.dtype
           ) -> torch.Tensor:
    """Softmax attention of rows q [t, H, DQ] over keys k [S, H, DQ] / values v [S, H, DV] where `selection`
    [t, S] allows: [t, H, DV]. Scores scaled by DQ^-0.5, softmax in float32, probabilities back to `dtype`."""
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5               # [H, t, S]
    probs = torch.softmax(scores.masked_fill(~selection, float("-inf")).float(), dim=-1).to(dtype)
    probs = probs.masked_fill(~selection.any(-1)[None, :, None], 0.0)   # a row that selects nothing gives 0
    return torch.einsum("hts,shd->thd", probs, v)                                  # [t, H, DV]


def index_step(w: dsa.IndexerWeights, d: dsa.IndexerDims, x: torch.Tensor, q_resid: torch.Tensor, start: int,
               kv: KvStore, layer: int, slot: int) -> torch.Tensor:
    """Advance the layer's pooled-key state by this step's rows and select their keys: bool [T, start + T]."""
    keys, gates = dsa.raw_keys(w, x)                                                # [T, DI] each
    tail = kv.fixed(layer, "pool_tail", slot) if d.kpool > 1 else None
    completed = dsa.extend_pools(w, keys, gates, start, tail)                       # [M, DI]
    if completed.shape[0]:
        kv.write_rows(layer, "pooled_key", slot, start, completed)
    pooled = kv.rows(layer, "pooled_key", slot, start + x.shape[0])                # [N, DI]
    return dsa.select(w, d, x, q_resid, start, pooled)
