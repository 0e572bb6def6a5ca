"""The Nemotron-H model: one mixer per layer (Mamba2, attention, relu² MLP or MoE), one stream at a time.

    x = embed(tokens)
    per layer:  x = x + mixer(rms_norm(x))      by layers_block_type: mamba.py, attention.py, mlp.py
    logits = lm_head(rms_norm(x))               every rms_norm plain w·x̂ (norms.py)

At TP=N each rank holds its heads, groups and columns of every mixer (parallel.py), whose output is then a partial
sum: the ranks' parts are added in rank order (shard.reduce) before the residual add, once per layer.

Every stream of a StepPlan runs alone through every layer, with its own slot, so a stream's arithmetic never
depends on the others in the step. Everything a later step needs is in the KvStore: attention keys/values as
rows, the Mamba2 conv tail and SSM state as fixed states; MLP and MoE layers keep nothing.

Shapes in comments: T rows of this step, E hidden size, V vocab.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kv import KvStore
from tensorfold.plan import DecodeBatch, StepPlan, StreamStep, share_logits
from tensorfold.shard import SINGLE, Shard
from tensorfold_nemotron.attention import AttentionWeights, attention
from tensorfold_nemotron.config import NemotronConfig
from tensorfold_nemotron.decode import fused_norm
from tensorfold_nemotron.mamba import MambaWeights, mamba2
from tensorfold_nemotron.mlp import MlpWeights, MoeWeights, mlp, moe
from tensorfold_nemotron.norms import rms_norm

# Names of the states in the Layout (plugin.family_kv_layout) and the KvStore.
CONV, SSM, KEYS, VALUES = "conv", "ssm", "k", "v"

Mixer = MambaWeights | AttentionWeights | MlpWeights | MoeWeights


@attrs.frozen
class LayerWeights:
    """One block: its norm (HF `norm`) and its mixer (`mixer.*`)."""

    norm: torch.Tensor                  # [E]
    mixer: Mixer


@attrs.frozen
class Weights:
    """Every tensor of the model, in the model's dtype (the router in float32) and on its device."""

    embed: torch.Tensor                 # [V, E]       model.embeddings.weight
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor                  # [E]          model.norm_f.weight
    lm_head: torch.Tensor               # [V, E]       lm_head.weight (never tied)


class NemotronModel:
    """A loaded Nemotron-H checkpoint; `forward(plan, kv)` is the FamilyModel entry the engine calls."""

    def __init__(self, config: NemotronConfig, weights: Weights, shard: Shard = SINGLE) -> None:
        self.config = config                        # this rank's: its heads, groups and columns (config.on_rank)
        self.shard = shard
        self.weights = weights
        self.vocab_size = config.vocab_size
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device

    @torch.no_grad()
    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Run one step; float32 logits [plan.logit_rows, V], in plan order: each stream's last row when it samples,
        every row when it asks for every row (a prompt's logprobs)."""
        picked = []
        for step in plan.streams:
            x = self.hidden(step, kv)                                              # [T, E]
            picked += share_logits(step, x, self.logits)
        if not picked:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return torch.cat(picked)

    @torch.no_grad()
    def decode(self, batch: DecodeBatch, kv: KvStore) -> torch.Tensor:
        """One token for each row of `batch`, tensors only (no host sync: a CUDA graph captures it); float32
        logits [B, V]. Needs a store with row pages (paged, or a window store's one page per slot)."""
        from tensorfold_nemotron.decode import decode

        return decode(self, batch, kv)

    @torch.no_grad()
    def forward_all(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Float32 logits for every row of every stream, in plan order: [plan.rows, V] (for tests against a
        reference; the engine calls `forward`)."""
        return torch.cat([self.logits(self.hidden(step, kv)) for step in plan.streams])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: [N, E] -> float32 [N, V]."""
        return F.linear(rms_norm(x, self.weights.norm, self.config.eps), self.weights.lm_head).float()

    def hidden(self, step: StreamStep, kv: KvStore) -> torch.Tensor:
        """One stream's rows through every layer, writing its states: [T, E] before the final norm.

        Each block norm runs fused with the residual add before it (decode.fused_norm: norms.rms_norm's bits, one
        kernel on CUDA). A chunk of several rows takes the experts' prefill tiles, one row the decode step's."""
        c, layers = self.config, self.weights.layers
        tokens = torch.tensor(step.tokens, dtype=torch.long, device=self.device)      # [T]
        x = self.weights.embed[tokens]                                                # [T, E]
        h = fused_norm(x, layers[0].norm, c.eps)
        for index, layer in enumerate(layers):
            mixer = layer.mixer
            if isinstance(mixer, MambaWeights):
                out = mamba2(mixer, c, h, step.start, kv.fixed(index, CONV, step.slot),
                             kv.fixed(index, SSM, step.slot))
            elif isinstance(mixer, AttentionWeights):
                out = attention(mixer, c, h, index, step, kv)
            elif isinstance(mixer, MoeWeights):
                out = moe(mixer, c, h, kind="prefill" if len(step.tokens) > 1 else "decode")
            else:
                out = mlp(mixer, h)
            out = self.shard.reduce(out)                 # every mixer ends row-parallel: the ranks' parts, summed
            if index + 1 < len(layers):
                h, x = fused_norm(out, layers[index + 1].norm, c.eps, residual=x)      # x + out, normalised
            else:
                x = x + out
        return x
