"""The Nemotron-H config record: what the forward needs from config.json, read once, and what the family refuses.

One HF model type, `nemotron_h` (`NemotronHForCausalLM`): Nemotron-H (dense, Mamba2 + attention + relu² MLP) and
Nemotron-3 (Mamba2 + attention + MoE). Each layer has one mixer, named by the schedule:

    layers_block_type (alias layer_types)    linear_attention = Mamba2, full_attention = attention, mlp, moe
                                             (legacy names mamba, attention as HF remaps them)
    hybrid_override_pattern (legacy)         one letter a layer: M Mamba2, * attention, - MLP, E MoE

Older configs spell some Mamba fields `mamba_*` (mamba_n_groups, mamba_d_conv, mamba_dt_limit, ...); they are read
as HF's NemotronHConfig reads them.

The dt policy: dt = softplus(dt_raw + dt_bias) clamped to the config's `time_step_limit` in every path (prefill and
decode alike). HF clamps to (time_step_min, inf) in its multi-token path and not at all in its one-token path; the
family does not copy that split (docs/families/nemotron.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from tensorfold.shard import Shard

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
KINDS = (MAMBA, ATTENTION, MLP, MOE)
LEGACY = {"mamba": MAMBA, "attention": ATTENTION}
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LETTER = {kind: letter for letter, kind in PATTERN.items()}
MODEL_TYPES = ("nemotron_h",)
SERVED_DTYPES = ("auto", "float32", "bfloat16")
# config.json's legacy spellings of the Mamba fields (HF's NemotronHConfig.__post_init__ reads them the same way)
ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_limit": "mamba_dt_limit",
           "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size"}


def value_of(config: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """A field by its name, else by its legacy `mamba_*` spelling, else `default`."""
    if config.get(name) is not None:
        return config[name]
    legacy = ALIASES.get(name)
    if legacy is not None and config.get(legacy) is not None:
        return config[legacy]
    return default


def layer_schedule(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Each layer's mixer: `layers_block_type` / `layer_types` when given, else `hybrid_override_pattern`."""
    given = config.get("layers_block_type") or config.get("layer_types")
    if given is not None:
        if isinstance(given, str) or not all(isinstance(kind, str) for kind in given):
            raise ValueError(f"config.json layers_block_type must be a list of names, got {given!r}")
        return tuple(LEGACY.get(kind, kind) for kind in given)
    pattern = config.get("hybrid_override_pattern")
    if pattern is None:
        raise ValueError("config.json has neither layers_block_type (layer_types) nor hybrid_override_pattern, "
                         "which the nemotron family needs for its layer schedule")
    unknown = sorted(set(str(pattern)) - set(PATTERN))
    if unknown:
        raise ValueError(f"config.json hybrid_override_pattern holds {unknown}; the letters are M (Mamba2), "
                         "* (attention), - (MLP) and E (MoE)")
    return tuple(PATTERN[letter] for letter in str(pattern))


def limit_value(value: Any) -> float:
    """One bound of time_step_limit: a number, a string like "Infinity", or HF's JSON form {"__float__": "..."}."""
    if isinstance(value, Mapping) and "__float__" in value:
        value = value["__float__"]
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"config.json time_step_limit holds {value!r}, which is not a number")
    try:
        return float(value)
    except ValueError as err:
        raise ValueError(f"config.json time_step_limit holds {value!r}, which is not a number") from err


def time_step_limit(config: Mapping[str, Any]) -> tuple[float, float]:
    """The (low, high) clamp of dt from `time_step_limit` (or `mamba_dt_limit`); HF's default is (0, inf)."""
    given = value_of(config, "time_step_limit", (0.0, math.inf))
    if isinstance(given, str | Mapping) or len(given) != 2:
        raise ValueError(f"config.json time_step_limit is {given!r}; it must be a pair [low, high]")
    return limit_value(given[0]), limit_value(given[1])


@attrs.frozen
class NemotronConfig:
    """Everything the forward reads. Shapes: E hidden; attention H/KV heads of D; Mamba2 MH heads of P dims,
    G groups of B/C with state N, conv kernel K; MLP F; MoE NE experts of FE, top k, latent L (0: none)."""

    vocab_size: int
    hidden_size: int              # E
    layer_types: tuple[str, ...]
    eps: float                    # layer_norm_epsilon: every RMSNorm, the gated one included
    max_positions: int
    # attention (GQA, no RoPE)
    heads: int = 0                # H
    kv_heads: int = 0             # KV
    head_dim: int = 0             # D
    # Mamba2
    mamba_heads: int = 0          # MH
    mamba_head_dim: int = 0       # P
    n_groups: int = 0             # G
    state_size: int = 0           # N
    conv_kernel: int = 0          # K
    conv_bias: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)
    # MLP (relu²)
    intermediate_size: int = 0    # F
    # MoE
    experts: int = 0              # NE
    top_k: int = 0
    moe_intermediate_size: int = 0            # FE
    shared_intermediate_size: int = 0
    latent_size: int = 0          # L; 0: the experts read the hidden state itself
    n_group: int = 1              # routing groups
    topk_group: int = 1           # groups kept per token
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def schedule(self) -> str:
        """The schedule in HF's legacy letters (M Mamba2, * attention, - MLP, E MoE)."""
        return "".join(LETTER[kind] for kind in self.layer_types)

    @property
    def mamba_inner(self) -> int:
        """Mamba2's inner width I = MH·P (x and z each)."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the Mamba2 conv: [x (I) | B (G·N) | C (G·N)]."""
        return self.mamba_inner + 2 * self.n_groups * self.state_size

    @property
    def expert_width(self) -> int:
        """What the routed experts read and write: the latent when there is one, else the hidden state."""
        return self.latent_size or self.hidden_size

    def on_rank(self, shard: Shard) -> NemotronConfig:
        """This rank's config: its share of the attention and KV heads, Mamba2 heads and B/C groups, MLP, expert
        and shared-expert columns (parallel.py); the experts, router, latent and widths stay whole."""
        if shard.world == 1:
            return self
        cuts = {"heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "mamba_heads": "mamba_num_heads",
                "n_groups": "n_groups", "intermediate_size": "intermediate_size",
                "moe_intermediate_size": "moe_intermediate_size",
                "shared_intermediate_size": "moe_shared_expert_intermediate_size"}
        return attrs.evolve(self, **{field: shard.split(getattr(self, field), name) for field, name in cuts.items()})

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> NemotronConfig:
        """Build from an HF config dict; a missing or inconsistent field raises ValueError naming it."""

        def need(name: str) -> Any:
            value = value_of(config, name)
            if value is None:
                raise ValueError(f"config.json has no {name!r}, which the nemotron family needs")
            return value

        schedule = layer_schedule(config)
        unknown = sorted(set(schedule) - set(KINDS))
        if unknown or not schedule:
            raise ValueError(f"config.json layers_block_type holds {unknown or 'no layers'}; the nemotron family "
                             f"serves {', '.join(KINDS)} layers")
        fields: dict[str, Any] = dict(
            vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")), layer_types=schedule,
            eps=float(config.get("layer_norm_epsilon", 1e-5)),
            max_positions=int(config.get("max_position_embeddings", 4096)))
        if ATTENTION in schedule:
            fields.update(heads=int(need("num_attention_heads")),
                          kv_heads=int(config.get("num_key_value_heads") or need("num_attention_heads")),
                          head_dim=int(need("head_dim")))
        if MAMBA in schedule:
            fields.update(mamba_heads=int(need("mamba_num_heads")), mamba_head_dim=int(need("mamba_head_dim")),
                          n_groups=int(need("n_groups")), state_size=int(need("ssm_state_size")),
                          conv_kernel=int(need("conv_kernel")), conv_bias=bool(value_of(config, "use_conv_bias", True)),
                          dt_limit=time_step_limit(config))
        if MLP in schedule:
            fields.update(intermediate_size=int(need("intermediate_size")))
        if MOE in schedule:
            fields.update(experts=int(need("n_routed_experts")), top_k=int(need("num_experts_per_tok")),
                          moe_intermediate_size=int(need("moe_intermediate_size")),
                          shared_intermediate_size=int(need("moe_shared_expert_intermediate_size")),
                          latent_size=int(config.get("moe_latent_size") or 0),
                          n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                          norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                          routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))
        built = cls(**fields)
        problems = built.inconsistencies()
        if problems:
            raise ValueError("; ".join(problems))
        return built

    def inconsistencies(self) -> list[str]:
        """Fields that contradict each other (config.json names in the sentences)."""
        counts = {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        if ATTENTION in self.layer_types:
            counts.update(num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim)
        if MAMBA in self.layer_types:
            counts.update(mamba_num_heads=self.mamba_heads, mamba_head_dim=self.mamba_head_dim,
                          n_groups=self.n_groups, ssm_state_size=self.state_size)
        if MLP in self.layer_types:
            counts.update(intermediate_size=self.intermediate_size)
        if MOE in self.layer_types:
            counts.update(n_routed_experts=self.experts, num_experts_per_tok=self.top_k,
                          moe_intermediate_size=self.moe_intermediate_size,
                          moe_shared_expert_intermediate_size=self.shared_intermediate_size)
        found = [f"config.json {name} is {value}; it must be at least 1" for name, value in counts.items() if value < 1]
        if found:
            return found
        if ATTENTION in self.layer_types and self.heads % self.kv_heads:
            found.append(f"num_attention_heads {self.heads} is not a multiple of num_key_value_heads {self.kv_heads}")
        if MAMBA in self.layer_types:
            if self.mamba_heads % self.n_groups:
                found.append(f"mamba_num_heads {self.mamba_heads} is not a multiple of n_groups {self.n_groups}")
            if self.conv_kernel < 2:
                found.append(f"conv_kernel {self.conv_kernel} must be at least 2")
        if MOE in self.layer_types:
            found += self.routing_inconsistencies()
        return found

    def routing_inconsistencies(self) -> list[str]:
        """The grouped top-k router's fields that cannot route (HF's router would fail or pick nothing)."""
        found = []
        if self.n_group < 1 or self.experts % self.n_group:
            return [f"n_routed_experts {self.experts} is not a multiple of n_group {self.n_group}"]
        if self.experts // self.n_group < 2:
            found.append(f"n_group {self.n_group} leaves fewer than 2 experts per group (n_routed_experts "
                         f"{self.experts}); a group's score is the sum of its top 2")
        if not 1 <= self.topk_group <= self.n_group:
            found.append(f"topk_group {self.topk_group} must be between 1 and n_group {self.n_group}")
        elif not 1 <= self.top_k <= self.topk_group * (self.experts // self.n_group):
            found.append(f"num_experts_per_tok {self.top_k} must be between 1 and the {self.topk_group} kept groups' "
                         f"{self.topk_group * (self.experts // self.n_group)} experts")
        return found


# ---------------------------------------------------------------- what the family refuses

def limit_problem(config: Mapping[str, Any]) -> str | None:
    """Why the dt policy cannot be honoured for this config's time_step_limit, or None."""
    try:
        low, high = time_step_limit(config)
    except ValueError as err:
        return str(err)
    if math.isnan(low) or math.isnan(high) or not math.isfinite(low) or low < 0 or high <= low:
        return (f"config.json time_step_limit is [{low}, {high}]; the nemotron family clamps dt = softplus(...) to "
                "it in every path and needs 0 <= low < high (low finite; high may be Infinity)")
    return None


def unsupported(config: Mapping[str, Any]) -> list[str]:
    """Config fields this family does not implement, each as a sentence naming the field and what would work."""
    schedule = set(layer_schedule(config)) if ("layers_block_type" in config or "layer_types" in config
                                               or "hybrid_override_pattern" in config) else set()
    checks = [
        (config.get("mamba_hidden_act", "silu") == "silu",
         f"config.json mamba_hidden_act is {config.get('mamba_hidden_act')!r}; the Mamba2 conv activation is silu"),
        (config.get("mlp_hidden_act", "relu2") == "relu2",
         f"config.json mlp_hidden_act is {config.get('mlp_hidden_act')!r}; the nemotron family's MLPs and experts "
         "are relu2 (squared ReLU)"),
        (not config.get("use_bias", False),
         "config.json sets use_bias: true; the nemotron family's Mamba2 in_proj and out_proj have no biases"),
        (not config.get("mlp_bias", False),
         "config.json sets mlp_bias: true; the nemotron family's MLPs, experts and latent projections have no biases"),
        (not config.get("attention_bias", False),
         "config.json sets attention_bias: true; the nemotron family's attention projections have no biases"),
        (config.get("sliding_window") is None,
         f"config.json sets sliding_window {config.get('sliding_window')}; the nemotron family's attention is full"),
        (not config.get("residual_in_fp32", False),
         "config.json sets residual_in_fp32: true; the nemotron family keeps the residual in the model's dtype "
         "(as HF transformers does)"),
        (MOE not in schedule or config.get("n_shared_experts") in (None, 1),
         f"config.json n_shared_experts is {config.get('n_shared_experts')}; the nemotron family's MoE has exactly "
         "one shared expert (as HF transformers builds it)"),
        (config.get("mamba_ssm_cache_dtype", "float32") in (None, "float32"),
         f"config.json mamba_ssm_cache_dtype is {config.get('mamba_ssm_cache_dtype')!r}; the nemotron family keeps "
         "the SSM state in float32"),
        (not config.get("quantization_config"),
         "config.json has a quantization_config; the nemotron family serves unquantized (bf16/fp32) weights only"),
    ]
    found = [sentence for ok, sentence in checks if not ok]
    if MAMBA in schedule:
        problem = limit_problem(config)
        if problem:
            found.append(problem)
    return found
