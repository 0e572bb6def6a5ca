"""The GLM-5.3-Flash text model: KDA and MLA (with the DSA pooled-key indexer) mixers, dense or MoE feed-forwards,
all inside mHC hyper-connections; a prefill chunk one stream at a time (`hidden`), a step's one-token rows through
the tensor-only decode step (decode.py, one token of each of B streams at once: `decoded`).

    streams = embed(tokens) copied to m streams                                  [T, m, E]
    per layer, per block (mixer, then feed-forward):
        x, post, comb = hc_pre(streams)              the block's input mixed from the streams (hc.py)
        out = block(rms_norm(x))                     mixer: KDA (kda.py) or MLA (mla.py); ffn: SwiGLU or MoE (mlp.py)
        streams = post ⊗ out + combᵀ streams
    logits = lm_head(rms_norm(mean over streams))    every rms_norm here is plain: w·x̂

A shared-indexer MLA layer attends to the keys the MLA layer right before it selected for the same rows; every
other layer's selection is its own. Everything a later step needs is in the KvStore: the KDA conv tail and
recurrent state as fixed states, the MLA latents and pooled index keys as rows by position, the incomplete pool's
raw index keys as a fixed state. Shapes in comments: T rows of this step, m streams, E hidden size, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.upload import ints
from tensorfold.kv import KvStore
from tensorfold.plan import DecodeBatch, StepPlan, StreamStep, share_logits
from tensorfold.shard import SINGLE, Shard
from tensorfold_glm.config import CONV, RECURRENT, GlmConfig
from tensorfold_glm.hc import HcWeights, expand, hc_head, hc_post, hc_pre, rms_norm
from tensorfold_glm.indexer import IndexerDims
from tensorfold_glm.kda import KdaWeights, kimi_delta_attention
from tensorfold_glm.mla import MlaDims, MlaWeights, mla_attention
from tensorfold_glm.mlp import MlpWeights, MoeWeights, moe, swiglu


@attrs.frozen
class LayerWeights:
    """One decoder layer: each block's hyper-connection and norm, the mixer and the feed-forward."""

    attn_hc: HcWeights                  # hc_attn_{fn,base,scale}
    input_norm: torch.Tensor            # [E]   input_layernorm.weight
    mixer: KdaWeights | MlaWeights      # self_attn.*
    ffn_hc: HcWeights                   # hc_ffn_{fn,base,scale}
    post_norm: torch.Tensor             # [E]   post_attention_layernorm.weight
    ffn: MlpWeights | MoeWeights        # mlp.*


@attrs.frozen
class Weights:
    """Every tensor of the model, on its device (float32 where HF keeps float32, else the model's dtype)."""

    embed: torch.Tensor                 # [V, E]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor                  # [E]
    lm_head: torch.Tensor               # [V, E] (the embedding itself when tied)


class GlmModel:
    """A loaded GLM-5.3-Flash checkpoint; `forward(plan, kv)` is the FamilyModel entry the engine calls."""

    def __init__(self, config: GlmConfig, weights: Weights, shard: Shard = SINGLE) -> None:
        self.config = config                    # this rank's: its KDA and MLA heads, its MLP and expert columns
        self.shard = shard
        self.weights = weights
        self.vocab_size = config.vocab_size
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        # forward's one-token rows through `decode`: all in one batch on CUDA, as the DecodeRunner batches a pure
        # decode step; one row a batch elsewhere, where float32 GEMMs round a row by the batch's size (the CPU
        # engine has no runner, and one row a batch keeps its concurrent == solo)
        self.decode_together = self.device.type == "cuda"
        c = config
        self.mla_dims = MlaDims(heads=c.num_attention_heads, qk_nope_head_dim=c.qk_nope_head_dim,
                                v_head_dim=c.v_head_dim, rms_norm_eps=c.rms_norm_eps,
                                index=IndexerDims(n_heads=c.index_n_heads, head_dim=c.index_head_dim,
                                                  topk=c.index_topk, kpool=c.index_kpool,
                                                  always_select_tail=c.index_kpool_always_select_tail))

    @torch.no_grad()
    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Run one step; float32 logits [plan.logit_rows, V]: each stream's logit rows (its last when it
        samples, all with every_row), in order. With `decode`, the step's one-token rows past position 0 run
        through it (`decoded`), so a decode row's bits do not depend on a prefill chunk sharing its step."""
        return self._step(plan, kv, every_row=False)

    @property
    def decode(self) -> Callable[[DecodeBatch, KvStore], torch.Tensor] | None:
        """`decode(batch, kv)`: one token for each row of `batch`, tensors only (no host sync: a CUDA graph captures
        it), float32 logits [B, V] (decode.py). None where a kernel it needs would read the device back (CUDA
        without Triton, or without fla-core for the KDA step), so the engine runs `forward` there."""
        from tensorfold_glm import decode

        if not decode.sync_free(self):
            return None
        return lambda batch, kv: decode.decode(self, batch, kv)

    @torch.no_grad()
    def forward_all(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Like forward, but float32 logits for every row of every stream, in plan order: [plan.rows, V]."""
        return self._step(plan, kv, every_row=True)

    def _step(self, plan: StepPlan, kv: KvStore, every_row: bool) -> torch.Tensor:
        """The step's logit rows in plan order: each stream's share (share_logits), or with `every_row` all its
        rows; a stream `decoded` takes gives its one row from there."""
        decoded = self.decoded(plan, kv)
        picked = []
        for i, step in enumerate(plan.streams):
            if i in decoded:
                picked += [decoded[i]] if every_row or step.logit_rows else []
                continue
            x = self.hidden(step, kv)                                          # [T, E]
            picked += [self.logits(x)] if every_row else share_logits(step, x, self.logits)
        if not picked:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return torch.cat(picked)

    def decoded(self, plan: StepPlan, kv: KvStore) -> dict[int, torch.Tensor]:
        """The step's one-token streams past position 0 through `decode`, in plan order: one DecodeBatch of them
        all (the batch a pure decode step of the same streams runs), or with `decode_together` off one each.
        Stream index -> float32 logits [1, V]; empty without `decode` (position 0 clears a stream's states:
        `hidden` does that)."""
        step = self.decode
        single = [i for i, s in enumerate(plan.streams) if len(s.tokens) == 1 and s.start > 0]
        if step is None or not single:
            return {}
        groups = [single] if self.decode_together else [[i] for i in single]
        found = {}
        for group in groups:
            shares = [plan.streams[i] for i in group]
            logits = step(decode_batch(shares, kv, self.device), kv)                 # [B, V]
            found.update({i: logits[n: n + 1] for n, i in enumerate(group)})
        return found

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: [N, E] -> float32 [N, V]."""
        return F.linear(rms_norm(x, self.weights.norm, self.config.rms_norm_eps), self.weights.lm_head).float()

    def hidden(self, step: StreamStep, kv: KvStore) -> torch.Tensor:
        """One stream's rows through every layer, writing its states: [T, E], the streams' mean before the norm."""
        c = self.config
        tokens = torch.tensor(step.tokens, dtype=torch.long, device=self.device)          # [T]
        streams = expand(self.weights.embed[tokens], c.hc_mult)                           # [T, m, E]
        selection = None
        for index, layer in enumerate(self.weights.layers):
            x, post, comb = hc_pre(layer.attn_hc, streams, c.rms_norm_eps, c.hc_sinkhorn_iters, c.hc_eps)
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            if isinstance(layer.mixer, KdaWeights):
                out = kimi_delta_attention(layer.mixer, c.linear_num_heads, c.linear_head_dim,
                                           c.linear_conv_kernel_dim, c.rms_norm_eps, c.linear_lower_bound, h,
                                           step.start, kv.fixed(index, CONV, step.slot),
                                           kv.fixed(index, RECURRENT, step.slot))
                selection = None
            else:
                out, selection = mla_attention(layer.mixer, self.mla_dims, h, step.start, kv, index, step.slot,
                                               selection_in=selection)
            streams = hc_post(self.shard.reduce(out), streams, post, comb)     # o_proj row-parallel
            x, post, comb = hc_pre(layer.ffn_hc, streams, c.rms_norm_eps, c.hc_sinkhorn_iters, c.hc_eps)
            h = rms_norm(x, layer.post_norm, c.rms_norm_eps)
            if isinstance(layer.ffn, MoeWeights):
                out = moe(layer.ffn, h, c.num_experts_per_tok, c.routed_scaling_factor, c.norm_topk_prob, c.n_group,
                          c.topk_group, c.swiglu_limit)
            else:
                out = swiglu(layer.ffn, h, c.swiglu_limit)
            streams = hc_post(self.shard.reduce(out), streams, post, comb)     # down projections row-parallel
        return hc_head(streams)                                                           # [T, E]


def decode_batch(shares: list[StreamStep], kv: KvStore, device: torch.device) -> DecodeBatch:
    """One-token shares as the DecodeBatch a pure decode step of them gets: tokens, positions, slots, and the
    slots' page tables from the store."""
    values = [s.tokens[0] for s in shares] + [s.start for s in shares] + [s.slot for s in shares]
    rows = ints(values, torch.long, device).view(3, len(shares))                      # tokens, positions, slots
    return DecodeBatch(tokens=rows[0], positions=rows[1], slots=rows[2], tables=kv.tables([s.slot for s in shares]))
