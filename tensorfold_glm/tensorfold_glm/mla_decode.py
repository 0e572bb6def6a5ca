"""MLA with its DSA indexer for the decode step: one row for each of B streams, keys read through the page tables,
tensor ops only (no host sync, no shape that depends on data), so a CUDA graph captures it.

    latent, q, q_resid as mla.py; the latent written at the row's position (write_rows: a padded row writes none)
    indexer:  the row's raw key and gate complete its pool (position ≡ kpool-1: the pooled key is written) or join
              the pool tail (fixed state, updated through write_rows); each row's pooled keys [B, NP, DI] gathered
              through its table, zero past its complete pools; indexer.py's scores; the top kept pools by a stable
              sort over all NP entries (non-candidates at -inf) as their tokens, plus with always_select_tail the
              row's own incomplete pool -> K = kept·P (+ P-1) picked positions and which of them count
    attention over the picked latents [B, K, R] only (gathered through the table), kv_b absorbed:
              q_lat = W_kᵀ q [B, H, R];  scores = q_lat · latents / sqrt(DQ);  probs (float32 softmax over the valid
              picks, back to x's dtype);  out = W_v (probs · latents) [B, H, DV] -> o_proj

mla.py forms K and V from every latent of [0, end) (kv_b applied to [S, R]) and masks the scores to the selection;
here a row reads only the latents its selection names, as they are stored, with kv_b folded into the query and the
output: the step's memory and work grow with B · index_topk, not with the table's width, and decompressing even
those would take 2·H·D / R times their bytes (64× for the published config). The attention's products are the
same up to their order (float32 logits within a few ulps of mla.py's; tests/test_glm_decode.py). The pool tail,
the pooled keys, the scores and the choice of pools are computed as mla.py and indexer.py compute them.
Shapes in comments: B rows, E hidden, H heads, DQ/DV key/value head dims, R kv_lora_rank, Q q_lora_rank, NI/DI
index heads and dim, P kpool, W table width, NP = W·page_rows/P pooled entries, K picked positions.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.paged_write import decode_rows, row_ids, write_rows
from tensorfold.kv import KvStore
from tensorfold.plan import DecodeBatch
from tensorfold_glm import indexer as dsa
from tensorfold_glm.config import LATENT, POOL_TAIL, POOLED_KEY
from tensorfold_glm.hc import step_rms_norm
from tensorfold_glm.mla import MlaDims, MlaWeights


@attrs.frozen
class Rows:
    """What every MLA layer of one decode step reads of the batch (every layer's pages share one geometry)."""

    batch: DecodeBatch
    latent_rows: torch.Tensor           # [B] int64 flat page row of each row's latent, -1 for a padded row

    @classmethod
    def of(cls, batch: DecodeBatch, kv: KvStore, layer: int) -> Rows:
        """The rows of `batch` over the pages of MLA layer `layer`'s latents."""
        page_rows = kv.row_pages(layer, LATENT).shape[1]
        return cls(batch=batch, latent_rows=decode_rows(batch.tables, batch.positions, batch.slots, page_rows)[0])


@attrs.frozen
class Picked:
    """The key positions each row attends to, at a fixed width K (kept pools · kpool, plus kpool - 1 tail places
    with always_select_tail): a full indexer's choice, which the shared layer after it reuses."""

    keys: torch.Tensor                  # [B, K] int64 positions (0 where not valid)
    valid: torch.Tensor                 # [B, K] bool; the valid positions of a row are distinct

    def mask(self, width: int) -> torch.Tensor:
        """The picks as indexer.selection_mask gives them: bool [B, width], True at each valid position."""
        counts = torch.zeros(self.keys.shape[0], width, dtype=torch.int32, device=self.keys.device)
        return counts.scatter_add_(1, self.keys, self.valid.to(torch.int32)) > 0


def gather(pages: torch.Tensor, tables: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's entries in table order, zero where not `valid` (NaN poison and stale rows stay out of every
    product): pages [pages, per_page, X], tables [B, W], valid [B, W·per_page] -> [B, W·per_page, X]."""
    B, W = tables.shape
    rows = pages[tables].reshape(B, W * pages.shape[1], pages.shape[2])
    return rows.masked_fill(~valid[:, :, None], 0)


def entries_at(pages: torch.Tensor, tables: torch.Tensor, picked: Picked) -> torch.Tensor:
    """The entries at each row's picked positions, through its table, zero where not valid: pages [pages,
    page_rows, X] (one entry per position), tables [B, W] -> [B, K, X]."""
    per_page = pages.shape[1]
    flat = tables.gather(1, picked.keys // per_page).long() * per_page + picked.keys % per_page     # [B, K]
    return pages.view(-1, pages.shape[2])[flat].masked_fill(~picked.valid[:, :, None], 0)


def mla_step(w: MlaWeights, d: MlaDims, x: torch.Tensor, rows: Rows, kv: KvStore, layer: int,
             picked_in: Picked | None) -> tuple[torch.Tensor, Picked]:
    """One row per stream through an MLA layer: x [B, E] -> ([B, E], the keys it attended to). A full layer picks
    its keys, a shared one (w.indexer None) takes the previous layer's."""
    B, H, DQ, DV = x.shape[0], d.heads, d.qk_nope_head_dim, d.v_head_dim
    q_resid = step_rms_norm(F.linear(x, w.q_a_proj), w.q_a_layernorm, d.rms_norm_eps)  # [B, Q]
    q = F.linear(q_resid, w.q_b_proj).view(B, H, DQ)                                   # [B, H, DQ]
    latent = step_rms_norm(F.linear(x, w.kv_a_proj_with_mqa), w.kv_a_layernorm, d.rms_norm_eps)   # [B, R]
    pages = kv.row_pages(layer, LATENT)                                                # [pages, page_rows, R]
    write_rows(pages, latent, rows.latent_rows)
    if w.indexer is not None:
        picked = index_step(w.indexer, d.index, x, q_resid, rows.batch, kv, layer)
    elif picked_in is None:
        raise ValueError(f"layer {layer} shares its DSA selection but the previous layer passed none")
    else:
        picked = picked_in
    latents = entries_at(pages, rows.batch.tables, picked)                             # [B, K, R]
    out = absorbed_attention(q, latents, w.kv_b_proj, picked.valid, DV)               # [B, H, DV]
    return F.linear(out.reshape(B, H * DV), w.o_proj), picked                         # [B, E]


def absorbed_attention(q: torch.Tensor, latents: torch.Tensor, kv_b: torch.Tensor, allowed: torch.Tensor,
                       DV: int) -> torch.Tensor:
    """mla.attend with kv_b folded in: q [B, H, DQ], latents [B, K, R], kv_b [H·(DQ + DV), R], allowed [B, K]
    -> [B, H, DV] in q's dtype. Scores scaled by DQ^-0.5, softmax in float32; a row allowed no key gives 0."""
    B, H, DQ = q.shape
    w_k, w_v = kv_b.view(H, DQ + DV, -1).split([DQ, DV], dim=1)                        # [H, DQ, R], [H, DV, R]
    q_lat = torch.einsum("bhd,hdr->bhr", q, w_k)                                       # [B, H, R]
    scores = torch.matmul(q_lat, latents.transpose(1, 2)) * DQ ** -0.5                 # [B, H, K]
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")).float(), dim=-1).to(q.dtype)
    probs = probs.masked_fill(~allowed.any(-1)[:, None, None], 0.0)
    return torch.einsum("bhr,hvr->bhv", torch.matmul(probs, latents), w_v)             # [B, H, DV]


def index_step(w: dsa.IndexerWeights, d: dsa.IndexerDims, x: torch.Tensor, q_resid: torch.Tensor,
               batch: DecodeBatch, kv: KvStore, layer: int) -> Picked:
    """Advance the pool state by each row's token (mla.index_step for one row per stream) and pick its keys."""
    P = d.kpool
    keys, gates = dsa.raw_keys(w, x)                                                   # [B, DI] each
    held = batch.positions % P                                                         # [B] tokens already pooled
    complete = batch.live & (held == P - 1)                                            # this token ends its pool
    if P > 1:
        tails = kv.fixed_states(layer, POOL_TAIL)                                      # [S, P-1, 2, DI]
        tail = tails.index_select(0, batch.slots.clamp(min=0))                         # [B, P-1, 2, DI]
        pooled = dsa.pool(w, torch.cat((tail[:, :, 0], keys[:, None]), 1).flatten(0, 1),
                          torch.cat((tail[:, :, 1], gates[:, None]), 1).flatten(0, 1))   # [B, DI]
        write_rows(tails[:, None], next_tail(tail, torch.stack((keys, gates), 1), held, complete), batch.slots)
    else:
        pooled = dsa.pool(w, keys, gates)
    pages = kv.row_pages(layer, POOLED_KEY)                                            # [pages, page_rows/P, DI]
    write_rows(pages, pooled, row_ids(batch.tables, batch.positions // P, complete, pages.shape[1]))
    pools = torch.arange(batch.tables.shape[1] * pages.shape[1], device=x.device)     # [NP]
    ended = pools[None, :] < torch.where(batch.live, batch.positions + 1, 0)[:, None] // P   # [B, NP] candidates
    scores = index_scores(w, d, q_resid, x, gather(pages, batch.tables, ended))        # [B, NP]
    return pick(scores, ended, batch.positions, batch.live, d)


def next_tail(tail: torch.Tensor, raw: torch.Tensor, held: torch.Tensor, complete: torch.Tensor) -> torch.Tensor:
    """The pool tail after a row's token (indexer.extend_pools for one token): its raw key and gate [B, 2, DI] at
    place `held`, the places after it zero; all zero when the token completed the pool: [B, P-1, 2, DI]."""
    place = torch.arange(tail.shape[1], device=tail.device)[None, :, None, None]     # [1, P-1, 1, 1]
    at = held[:, None, None, None]
    kept = torch.where((place < at) & ~complete[:, None, None, None], tail, 0)
    return torch.where(place == at, raw[:, None], kept)


def index_scores(w: dsa.IndexerWeights, d: dsa.IndexerDims, q_resid: torch.Tensor, x: torch.Tensor,
                 pooled: torch.Tensor) -> torch.Tensor:
    """indexer.index_scores with each row's own pooled keys [B, NP, DI]: float32 [B, NP]."""
    B = x.shape[0]
    q = F.linear(q_resid, w.wq_b).view(B, d.n_heads, d.head_dim)                      # [B, NI, DI]
    scores = torch.matmul(q.float(), pooled.float().transpose(1, 2))                  # [B, NI, NP]
    scores = F.relu(scores * d.head_dim ** -0.5)
    heads = F.linear(x, w.weights_proj).float() * d.n_heads ** -0.5                   # [B, NI]
    return torch.matmul(heads.unsqueeze(-2), scores).squeeze(-2)                      # [B, NP]


def pick(scores: torch.Tensor, candidate: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
         d: dsa.IndexerDims) -> Picked:
    """indexer.top_pools and selection_mask at a fixed width: each row keeps its top min(kept, #candidates)
    candidate pools, ties to the lower pool (a stable sort; the non-candidates, at -inf, sort after every
    candidate), as their tokens; with always_select_tail, then the places of its own incomplete pool
    kpool·floor((p+1)/kpool) .. p. A padded row keeps nothing; a place not kept reads position 0."""
    B, NP = scores.shape
    P = d.kpool
    ranked = scores.masked_fill(~candidate, float("-inf"))
    top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, : min(d.pools_kept, NP)]   # [B, n]
    within = torch.arange(P, device=scores.device)                                     # [P]
    keys = (top[:, :, None] * P + within).flatten(1)                                   # [B, n·P]
    valid = candidate.gather(1, top)[:, :, None].expand(-1, -1, P).flatten(1)         # [B, n·P]
    if d.always_select_tail and P > 1:
        tail = ((positions + 1) // P * P)[:, None] + within[: P - 1]                   # [B, P-1]
        keys = torch.cat((keys, tail), dim=1)
        valid = torch.cat((valid, tail <= positions[:, None]), dim=1)
    valid = valid & live[:, None]
    return Picked(keys=torch.where(valid, keys, 0), valid=valid)           # a tail place past the table: 0
