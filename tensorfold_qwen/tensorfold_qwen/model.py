"""The Qwen3.5 model: a hybrid of Gated DeltaNet and gated-attention layers, dense or MoE, one stream at a time.

    x = embed(tokens)
    per layer:  x = x + mixer(rms_norm(x))     mixer: Gated DeltaNet (gdn.py) or gated attention (attention.py)
                x = x + ffn(rms_norm(x))       ffn: SwiGLU MLP, or a routed MoE with a shared expert (mlp.py)
    logits = lm_head(rms_norm(x))              every rms_norm here is zero-centred: x̂·(1 + w)

Every stream of a StepPlan runs alone through every layer, with its own slot, so a stream's arithmetic never
depends on the others in the step. Everything a later step needs is in the KvStore: attention keys/values as
rows, the GDN conv tail and recurrent state as fixed states. At tensor-parallel size N the model is one rank's
part (parallel.py): each mixer's and feed-forward's output is a partial sum, added over the ranks in rank order
(`shard.reduce`), so every rank holds the same bits of x.

Shapes in comments: T rows of this step, E hidden size, V vocab.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kv import KvStore
from tensorfold.plan import DecodeBatch, StepPlan, StreamStep, share_logits
from tensorfold.shard import SINGLE, Shard
from tensorfold_qwen.attention import AttentionWeights, gated_attention
from tensorfold_qwen.config import QwenConfig
from tensorfold_qwen.fused import fuse_mixer
from tensorfold_qwen.gdn import GdnWeights, gated_delta_net, with_gate_terms
from tensorfold_qwen.layers import inverse_frequencies, rms_norm, rope_tables
from tensorfold_qwen.mlp import MlpWeights, MoeWeights, moe, swiglu

# Names of the states in the Layout (plugin.family_kv_layout) and the KvStore.
CONV, RECURRENT, KEYS, VALUES = "conv", "recurrent", "k", "v"


@attrs.frozen
class LayerWeights:
    """One decoder layer: its norms (HF `input_layernorm`, `post_attention_layernorm`), mixer and ffn."""

    input_norm: torch.Tensor                        # [E]
    mixer: GdnWeights | AttentionWeights            # linear_attn.* or self_attn.*
    post_norm: torch.Tensor                         # [E]
    ffn: MlpWeights | MoeWeights                    # mlp.*


@attrs.frozen
class Weights:
    """Every tensor of the model, in the model's dtype and on its device."""

    embed: torch.Tensor                 # [V, E]       model.embed_tokens.weight
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor                  # [E]          model.norm.weight
    lm_head: torch.Tensor               # [V, E]       lm_head.weight (the embedding itself when tied)


def prepared(mixer: GdnWeights | AttentionWeights) -> GdnWeights | AttentionWeights:
    """A layer's mixer as the steps read it: input projections stacked, a GDN gate's per-layer factors computed."""
    mixer = fuse_mixer(mixer)
    return with_gate_terms(mixer) if isinstance(mixer, GdnWeights) else mixer


class QwenModel:
    """A loaded Qwen3.5 checkpoint; `forward(plan, kv)` is the FamilyModel entry the engine calls."""

    def __init__(self, config: QwenConfig, weights: Weights, shard: Shard = SINGLE) -> None:
        self.config = config                                                   # this rank's (QwenConfig.on_rank)
        self.shard = shard
        self.weights = attrs.evolve(weights, layers=tuple(attrs.evolve(layer, mixer=prepared(layer.mixer))
                                                          for layer in weights.layers))
        self.vocab_size = config.vocab_size
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.inv_freq = inverse_frequencies(config.rotary_dim, config.rope_theta, self.device)   # [R/2] float32

    @torch.no_grad()
    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Run one step; float32 logits [plan.logit_rows, V]: each stream's logit rows (its last when it
        samples, all with every_row), in order.

        On CUDA every stream's rows go through each layer together (batched.py); on the CPU each stream runs
        alone, the reference."""
        if self.device.type == "cuda":
            from tensorfold_qwen.batched import batched_forward

            return batched_forward(self, plan, kv)
        picked = []
        for step in plan.streams:
            x = self.hidden(step, kv)                                          # [T, E]
            picked += share_logits(step, x, self.logits)
        if not picked:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return torch.cat(picked)                                               # [logit_rows, V]

    @torch.no_grad()
    def decode(self, batch: DecodeBatch, kv: KvStore) -> torch.Tensor:
        """One token for each row of `batch`, tensors only (no host sync: a CUDA graph captures it); float32
        logits [B, V]. Needs a paged store."""
        from tensorfold_qwen.decode import decode

        return decode(self, batch, kv)

    @torch.no_grad()
    def forward_all(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Like forward, but float32 logits for every row of every stream, in plan order: [plan.rows, V].

        For tests against a reference (every position's logits); the engine calls `forward`.
        """
        return torch.cat([self.logits(self.hidden(step, kv)) for step in plan.streams])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: [N, E] -> float32 [N, V]."""
        return F.linear(rms_norm(x, self.weights.norm, self.config.rms_norm_eps), self.weights.lm_head).float()

    def hidden(self, step: StreamStep, kv: KvStore) -> torch.Tensor:
        """One stream's rows through every layer, writing its states: [T, E] before the final norm."""
        eps = self.config.rms_norm_eps
        tokens = torch.tensor(step.tokens, dtype=torch.long, device=self.device)          # [T]
        positions = torch.arange(step.start, step.end, device=self.device)                # [T] absolute
        cos, sin = rope_tables(positions, self.inv_freq, self.dtype)                      # [T, 1, R] each
        x = self.weights.embed[tokens]                                                    # [T, E]
        for index, layer in enumerate(self.weights.layers):
            h = rms_norm(x, layer.input_norm, eps)
            if isinstance(layer.mixer, GdnWeights):
                conv = kv.fixed(index, CONV, step.slot)                                   # [C, K-1]
                state = kv.fixed(index, RECURRENT, step.slot)                             # [NV, DK, DV] float32
                mixed = gated_delta_net(layer.mixer, self.config, h, step.start, conv, state)
            else:
                mixed = gated_attention(layer.mixer, self.config, h, cos, sin, index, step, kv)
            x = x + self.shard.reduce(mixed)                                             # row-parallel: summed
            h = rms_norm(x, layer.post_norm, eps)
            out = moe(layer.ffn, h) if isinstance(layer.ffn, MoeWeights) else swiglu(layer.ffn, h)
            x = x + self.shard.reduce(out)
        return x
