"""The example family's model: dense Qwen3 (plain GQA attention), one stream at a time, read top to bottom.

    x = embed(tokens)
    per layer:  x = x + attention(rms_norm(x))      q/k get a per-head RMSNorm, then RoPE; keys/values go to the KvStore
                x = x + mlp(rms_norm(x))            down(silu(gate(x)) * up(x))
    logits = lm_head(rms_norm(x))                   lm_head may be the embedding (tie_word_embeddings)

Shapes in comments: T rows of this step, S = start + T keys visible to the last row, H query heads,
KV key/value heads, D head_dim, E hidden size, F intermediate size, V vocab.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kv import KvStore
from tensorfold.plan import StepPlan, StreamStep, share_logits
from tensorfold.shard import SINGLE, Shard

# ---------------------------------------------------------------- the config record

def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (a multimodal wrapper nests it under `text_config`)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE settings: transformers 5 writes `rope_parameters`, older configs `rope_scaling` and `rope_theta`."""
    config = _text_config(config)
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


@attrs.frozen
class ExampleConfig:
    """What the forward needs from config.json, read once and checked."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool

    def on_rank(self, shard: Shard) -> ExampleConfig:
        """This rank's config: its share of the query heads, KV heads and MLP columns (the rest is whole)."""
        if shard.world == 1:
            return self
        return attrs.evolve(self, heads=shard.split(self.heads, "num_attention_heads"),
                            kv_heads=shard.split(self.kv_heads, "num_key_value_heads"),
                            intermediate_size=shard.split(self.intermediate_size, "intermediate_size"))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ExampleConfig:
        """Build from an HF config dict; a missing or inconsistent field raises ValueError naming it."""
        text = _text_config(config)

        def need(field: str) -> Any:
            if text.get(field) is None:
                raise ValueError(f"config.json has no {field!r}, which the example family needs")
            return text[field]

        heads = int(need("num_attention_heads"))
        kv_heads = int(text.get("num_key_value_heads") or heads)
        hidden = int(need("hidden_size"))
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            layers=int(need("num_hidden_layers")),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_parameters(config)["rope_theta"]),
            max_positions=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(tie),
            attention_bias=bool(text.get("attention_bias", False)),
        )


# ---------------------------------------------------------------- the weights

@attrs.frozen
class LayerWeights:
    """One decoder layer's tensors (HF names in comments, under `model.layers.{i}.`)."""

    input_norm: torch.Tensor            # [E]          input_layernorm.weight
    q_proj: torch.Tensor                # [H*D, E]     self_attn.q_proj.weight
    k_proj: torch.Tensor                # [KV*D, E]    self_attn.k_proj.weight
    v_proj: torch.Tensor                # [KV*D, E]    self_attn.v_proj.weight
    o_proj: torch.Tensor                # [E, H*D]     self_attn.o_proj.weight
    q_norm: torch.Tensor                # [D]          self_attn.q_norm.weight
    k_norm: torch.Tensor                # [D]          self_attn.k_norm.weight
    post_attention_norm: torch.Tensor   # [E]          post_attention_layernorm.weight
    gate_proj: torch.Tensor             # [F, E]       mlp.gate_proj.weight
    up_proj: torch.Tensor               # [F, E]       mlp.up_proj.weight
    down_proj: torch.Tensor             # [E, F]       mlp.down_proj.weight
    q_bias: torch.Tensor | None = None  # [H*D]        self_attn.q_proj.bias   (attention_bias only)
    k_bias: torch.Tensor | None = None  # [KV*D]       self_attn.k_proj.bias
    v_bias: torch.Tensor | None = None  # [KV*D]       self_attn.v_proj.bias
    o_bias: torch.Tensor | None = None  # [E]          self_attn.o_proj.bias


@attrs.frozen
class Weights:
    """Every tensor of the model, in the model's dtype and on its device."""

    embed: torch.Tensor                 # [V, E]       model.embed_tokens.weight
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor                  # [E]          model.norm.weight
    lm_head: torch.Tensor               # [V, E]       lm_head.weight (the embedding itself when tied)


# ---------------------------------------------------------------- the pieces

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in float32, back to x's dtype, then times the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for absolute positions [T] -> two [T, 1, D] tables (angles in float32, then cast)."""
    angles = positions.float()[:, None] * inv_freq[None, :]          # [T, D/2]
    angles = torch.cat((angles, angles), dim=-1)                      # [T, D]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the full head: x*cos + (-x2, x1)*sin. x: [T, heads, D]."""
    x1, x2 = x.chunk(2, dim=-1)                                       # [T, heads, D/2] each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---------------------------------------------------------------- the model

class ExampleModel:
    """A loaded Qwen3 checkpoint; `forward(plan, kv)` is the FamilyModel entry the engine calls."""

    def __init__(self, config: ExampleConfig, weights: Weights, shard: Shard = SINGLE) -> None:
        self.config = config                                          # this rank's: its heads, its MLP columns
        self.shard = shard
        self.weights = weights
        self.vocab_size = config.vocab_size
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.scale = config.head_dim ** -0.5
        self.groups = config.heads // config.kv_heads                # query heads per kv head
        steps = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=self.device)
        self.inv_freq = 1.0 / (config.rope_theta ** (steps / config.head_dim))  # [D/2], float32

    @torch.no_grad()
    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Run one step; float32 logits [plan.logit_rows, V]: each stream's logit rows (its last when it
        samples, all with every_row), in order."""
        picked = []
        for step in plan.streams:
            x = self.hidden(step, kv)                                 # [T, E]
            picked += share_logits(step, x, self.logits)
        if not picked:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return torch.cat(picked)                                      # [logit_rows, V]

    @torch.no_grad()
    def forward_all(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Like forward, but float32 logits for every row of every stream, in plan order: [plan.rows, V].

        For tests against a reference (every position's logits); the engine calls `forward`.
        """
        return torch.cat([self.logits(self.hidden(step, kv)) for step in plan.streams])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: [N, E] -> float32 [N, V]."""
        x = rms_norm(x, self.weights.norm, self.config.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()

    def hidden(self, step: StreamStep, kv: KvStore) -> torch.Tensor:
        """One stream's rows through every layer, writing its keys/values at [start, end): [T, E] before the final norm.

        Only this stream's tensors and its own slot are touched, so another stream in the plan never changes
        this one's arithmetic.
        """
        eps = self.config.rms_norm_eps
        tokens = torch.tensor(step.tokens, dtype=torch.long, device=self.device)          # [T]
        positions = torch.arange(step.start, step.end, device=self.device)                # [T] absolute
        cos, sin = rope_tables(positions, self.inv_freq, self.dtype)                      # [T, 1, D] each
        x = self.weights.embed[tokens]                                                    # [T, E]
        for index, layer in enumerate(self.weights.layers):
            x = x + self.attention(index, layer, rms_norm(x, layer.input_norm, eps), cos, sin, step, kv)
            x = x + self.mlp(layer, rms_norm(x, layer.post_attention_norm, eps))
        return x

    def attention(self, index: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  step: StreamStep, kv: KvStore) -> torch.Tensor:
        """Causal GQA attention of this step's rows over the stream's keys [0, end): [T, E] -> [T, E]."""
        c = self.config
        T = x.shape[0]
        q = F.linear(x, layer.q_proj, layer.q_bias).view(T, c.heads, c.head_dim)          # [T, H, D]
        k = F.linear(x, layer.k_proj, layer.k_bias).view(T, c.kv_heads, c.head_dim)       # [T, KV, D]
        v = F.linear(x, layer.v_proj, layer.v_bias).view(T, c.kv_heads, c.head_dim)       # [T, KV, D]
        q = apply_rope(rms_norm(q, layer.q_norm, c.rms_norm_eps), cos, sin)              # per-head norm, then RoPE
        k = apply_rope(rms_norm(k, layer.k_norm, c.rms_norm_eps), cos, sin)

        # The KvStore holds keys post-norm post-RoPE: write this step's rows, read the whole window back.
        kv.write_rows(index, "k", step.slot, step.start, k)
        kv.write_rows(index, "v", step.slot, step.start, v)
        keys = kv.rows(index, "k", step.slot, step.end)                                  # [S, KV, D]
        values = kv.rows(index, "v", step.slot, step.end)                                # [S, KV, D]
        # GQA: query head h reads kv head h // groups.
        keys = keys.repeat_interleave(self.groups, dim=1)                                 # [S, H, D]
        values = values.repeat_interleave(self.groups, dim=1)                             # [S, H, D]

        scores = torch.einsum("thd,shd->hts", q, keys) * self.scale                       # [H, T, S]
        key_positions = torch.arange(step.end, device=self.device)                        # [S]
        query_positions = torch.arange(step.start, step.end, device=self.device)          # [T]
        visible = key_positions[None, :] <= query_positions[:, None]                      # [T, S]: causal
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)                         # [H, T, S]
        out = torch.einsum("hts,shd->thd", probs, values)                                 # [T, H, D]
        out = out.reshape(T, c.heads * c.head_dim)                                        # [T, H*D]
        if self.shard.world == 1:
            return F.linear(out, layer.o_proj, layer.o_bias)                              # [T, E]
        out = self.shard.reduce(F.linear(out, layer.o_proj))      # row-parallel: every rank's heads, in rank order
        return out if layer.o_bias is None else out + layer.o_bias

    def mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: [T, E] -> [T, F] -> [T, E] (F this rank's columns; the down projection summed over ranks)."""
        return self.shard.reduce(F.linear(F.silu(F.linear(x, layer.gate_proj)) * F.linear(x, layer.up_proj),
                                          layer.down_proj))
