"""The DSA pooled-key indexer of GLM-5.3-Flash: which key positions each query of an MLA layer attends to.

    k_t = LayerNorm(wk x_t)  (weight, bias, eps 1e-6);   g_t = compress_gate x_t        raw index key, gate logits
    pool j = positions kpool·j .. kpool·j + kpool-1 (anchored at absolute position 0)
    pk_j[d] = Σ_i softmax_i(g[i,d] + ape[i,d]) · k[i,d]      per-channel softmax over the pool's kpool tokens
    q_h = wq_b(q_resid);  w = weights_proj(x) / sqrt(NI)
    score(p, j) = Σ_h w_h · relu(q_h · pk_j / sqrt(DI))      float32
    candidates of query p: complete pools whose last token <= p; keep the top min(topk / kpool, #candidates),
    higher score first and, among equal scores, the lower pool index (a deterministic tie-break; HF's torch.topk
    order among ties depends on the tensor's width). With always_select_tail the raw tokens
    kpool·floor((p+1)/kpool) .. p are added; at p ≡ kpool-1 that tail is empty and p sees itself only if its own
    pool wins.

State between steps: one pooled key per complete pool (row state "pooled_key", every=kpool) and, for the pool still
filling, its raw keys and gate logits (fixed state "pool_tail" [kpool-1, 2, DI]). A complete pool never changes,
so a pool's key is computed once, in the step that completes it, with HF's order of operations (fp32 softmax,
probabilities cast to the key dtype, product and sum in the key dtype): the same bits whatever the step split.

The selection is a boolean mask [T, end] over key positions (True: query row t attends to key position s); a
"shared" layer reuses the previous layer's mask as it is.
Shapes in comments: T rows of this step, E hidden, Q q_lora_rank, NI index heads, DI index head dim, P kpool,
N complete pools in [0, end).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold_glm import config

INDEX_KEY_NORM_EPS = 1e-6   # HF hard-codes nn.LayerNorm(index_head_dim, eps=1e-6)


@attrs.frozen
class IndexerWeights:
    """One full indexer's tensors (HF names under `self_attn.indexer.`)."""

    wq_b: torch.Tensor                          # [NI·DI, Q]
    wk: torch.Tensor                            # [DI, E]
    k_norm: torch.Tensor                        # [DI]      k_norm.weight (LayerNorm)
    k_norm_bias: torch.Tensor                   # [DI]      k_norm.bias
    weights_proj: torch.Tensor                  # [NI, E]
    index_kpool_compress_ape: torch.Tensor      # [P, DI]   added to the gate logits by position inside a pool
    index_kpool_compress_gate: torch.Tensor     # [DI, E]


@attrs.frozen
class IndexerDims:
    """The few config numbers the indexer needs (HF: index_n_heads, index_head_dim, index_topk, index_kpool,
    index_kpool_always_select_tail)."""

    n_heads: int
    head_dim: int
    topk: int
    kpool: int
    always_select_tail: bool = True

    @property
    def pools_kept(self) -> int:
        """Pools a query keeps at most: the top-k budget counted in pools."""
        return self.topk // self.kpool


def raw_keys(w: IndexerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new rows' LayerNorm'd index keys and compress-gate logits, both in x's dtype: [T, E] -> 2 × [T, DI]."""
    k = F.layer_norm(F.linear(x, w.wk), (w.wk.shape[0],), w.k_norm, w.k_norm_bias, INDEX_KEY_NORM_EPS)
    return k, F.linear(x, w.index_kpool_compress_gate)


def pool(w: IndexerWeights, keys: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Pooled keys of whole pools: keys, gates [N·P, DI] (pool-aligned) -> [N, DI] in the keys' dtype."""
    P, DI = w.index_kpool_compress_ape.shape
    keys = keys.reshape(-1, P, DI)                                                   # [N, P, DI]
    logits = gates.reshape(-1, P, DI).float() + w.index_kpool_compress_ape.float()[None]
    probs = logits.softmax(dim=1).to(keys.dtype)                                     # per channel, over the pool
    return (probs * keys).sum(dim=1)                                                 # [N, DI]


def extend_pools(w: IndexerWeights, keys: torch.Tensor, gates: torch.Tensor, start: int,
                 tail: torch.Tensor | None) -> torch.Tensor:
    """Pooled keys of the pools that rows [start, start + T) complete: [M, DI], M possibly 0.

    tail [P-1, 2, DI] holds the incomplete pool's raw keys [:, 0] and gate logits [:, 1] for positions
    P·floor(start/P) .. start-1 (ignored at start 0) and is updated in place to cover the new incomplete pool,
    its unused slots zeroed.
    tail is None only when P == 1.
    """
    P = w.index_kpool_compress_ape.shape[0]
    held = start % P
    if held:
        keys = torch.cat([tail[:held, 0], keys])                                     # [held + T, DI]
        gates = torch.cat([tail[:held, 1], gates])
    whole = keys.shape[0] // P * P
    if tail is not None:
        rest = keys.shape[0] - whole
        tail[:rest, 0] = keys[whole:]
        tail[:rest, 1] = gates[whole:]
        tail[rest:] = 0                    # unused slots zero: a kept state's bytes depend on its tokens alone
    return pool(w, keys[:whole], gates[:whole])


def index_scores(w: IndexerWeights, d: IndexerDims, q_resid: torch.Tensor, x: torch.Tensor,
                 pooled: torch.Tensor) -> torch.Tensor:
    """Σ_h w_h·relu(q_h·pk / sqrt(DI)) of every row against every pooled key, float32: -> [T, N]."""
    T = x.shape[0]
    q = F.linear(q_resid, w.wq_b).view(T, d.n_heads, d.head_dim)                    # [T, NI, DI]
    scores = torch.matmul(q.float(), pooled.float().t())                            # [T, NI, N]
    scores = F.relu(scores * d.head_dim ** -0.5)
    heads = F.linear(x, w.weights_proj).float() * d.n_heads ** -0.5                 # [T, NI]
    return torch.matmul(heads.unsqueeze(-2), scores).squeeze(-2)                    # [T, N]


def top_pools(scores: torch.Tensor, start: int, d: IndexerDims) -> torch.Tensor:
    """Which pools each row keeps: bool [T, N].

    Pool j is a candidate of the row at absolute position p when its last token kpool·j + kpool-1 <= p. Each row
    keeps its top min(topk/kpool, #candidates) candidates by score; among equal scores the lower pool index wins,
    so the choice does not depend on N or on how the rows were split into steps.
    """
    T, N = scores.shape
    positions = torch.arange(start, start + T, device=scores.device)                # [T]
    last = torch.arange(N, device=scores.device) * d.kpool + d.kpool - 1            # [N]
    candidate = last[None, :] <= positions[:, None]                                 # [T, N]
    ranked = scores.masked_fill(~candidate, float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices        # ties: lower index first
    keep = torch.zeros_like(candidate)
    keep.scatter_(-1, order[:, : min(d.pools_kept, N)], True)
    return keep & candidate


def selection_mask(keep: torch.Tensor, start: int, width: int, d: IndexerDims) -> torch.Tensor:
    """The key positions rows [start, start + T) attend to: the kept pools' tokens, plus the row's own incomplete
    pool (kpool·floor((p+1)/kpool) .. p) with always_select_tail: bool [T, width] (width past the last row's)."""
    T, N = keep.shape
    mask = torch.zeros(T, width, dtype=torch.bool, device=keep.device)
    mask[:, : N * d.kpool] = keep.repeat_interleave(d.kpool, dim=1)
    if d.always_select_tail:
        positions = torch.arange(start, start + T, device=keep.device)[:, None]     # [T, 1]
        keys = torch.arange(width, device=keep.device)[None, :]                     # [1, width]
        mask |= (keys >= (positions + 1) // d.kpool * d.kpool) & (keys <= positions)
    return mask


def select(w: IndexerWeights, d: IndexerDims, x: torch.Tensor, q_resid: torch.Tensor, start: int,
           pooled_rows: torch.Tensor) -> torch.Tensor:
    """The selection mask [T, end] of rows [start, start + T) given the pooled keys of [0, end): [N, DI]. In
    blocks of rows whose [rows, NI, N] scores fit config.SELECT_BYTES (one block unless the prompt is long): a row's
    selection is its own, and the blocks depend only on T and N, so a resumed pass blocks as a fresh one."""
    T, end = x.shape[0], start + x.shape[0]
    rows = max(1, config.SELECT_BYTES // (d.n_heads * max(1, pooled_rows.shape[0]) * 4))
    blocks = [selection_mask(top_pools(index_scores(w, d, q_resid[a: a + rows], x[a: a + rows], pooled_rows),
                                       start + a, d), start + a, end, d) for a in range(0, T, rows)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)
