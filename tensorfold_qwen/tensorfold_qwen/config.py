"""The Qwen3.5 config record: what the forward needs from config.json, read once, and what the family refuses.

Four HF model types share one text model:

    qwen3_5, qwen3_5_moe               the VL container: text fields under `text_config`, weights under
                                       `model.language_model.*` (vision `model.visual.*` and `mtp.*` are skipped)
    qwen3_5_text, qwen3_5_moe_text     text only: fields at the top level, weights under `model.layers.*`

The layer schedule is `layer_types` (`linear_attention` = Gated DeltaNet, `full_attention` = gated attention);
without it, layer i is full attention iff (i + 1) % full_attention_interval == 0 (default interval 4).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from tensorfold.shard import Shard

LINEAR = "linear_attention"
FULL = "full_attention"
DENSE_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
CONTAINER_TYPES = ("qwen3_5", "qwen3_5_moe")
MODEL_TYPES = DENSE_TYPES + MOE_TYPES
SERVED_DTYPES = ("auto", "float32", "bfloat16")

# QwenConfig fields tensor parallelism splits, each with what it counts (config.json names, for refusals).
RANK_SPLIT = {
    "heads": "attention heads (num_attention_heads)",
    "kv_heads": "KV heads (num_key_value_heads)",
    "k_heads": "GDN key heads (linear_num_key_heads)",
    "v_heads": "GDN value heads (linear_num_value_heads)",
    "intermediate_size": "MLP columns (intermediate_size)",
    "moe_intermediate_size": "experts' intermediate columns (moe_intermediate_size)",
    "shared_intermediate_size": "shared expert's intermediate columns (shared_expert_intermediate_size)",
}


def text_part(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields: `text_config` in the VL container, the config itself otherwise."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """rope_type, rope_theta and partial_rotary_factor, from `rope_parameters` (transformers 5), or the older
    `rope_scaling` + top-level `rope_theta` / `partial_rotary_factor`; HF's defaults are 10000 and 0.25."""
    text = text_part(config)
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", text.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return params


def layer_schedule(text: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's mixer: `layer_types` when given, else full attention every `full_attention_interval` layers."""
    given = text.get("layer_types")
    if given is not None:
        return tuple(given)
    interval = int(text.get("full_attention_interval", 4))
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers))


def tie_word_embeddings(config: Mapping[str, Any]) -> bool:
    """The container's own flag wins (its class, Qwen3_5ForConditionalGeneration, reads the top level)."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text_part(config).get("tie_word_embeddings", False))


@attrs.frozen
class QwenConfig:
    """Everything the forward reads. Shapes: E hidden, H/KV/D attention heads, kv heads and head_dim,
    NK/NV GDN key/value heads of DK/DV dims, K the conv kernel."""

    model_type: str
    vocab_size: int
    hidden_size: int              # E
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_positions: int
    # gated attention
    heads: int                    # H
    kv_heads: int                 # KV
    head_dim: int                 # D
    rotary_dim: int               # the first rotary_dim of D are rotated (partial_rotary_factor · D)
    rope_theta: float
    # Gated DeltaNet
    k_heads: int                  # NK
    v_heads: int                  # NV
    k_dim: int                    # DK
    v_dim: int                    # DV
    conv_kernel: int              # K
    # MLP: dense (intermediate_size) or MoE (experts > 0)
    intermediate_size: int = 0
    experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN conv: [q (NK·DK) | k (NK·DK) | v (NV·DV)]."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def schedule(self) -> str:
        """The layer schedule in one word: G for a Gated DeltaNet layer, A for an attention layer."""
        return "".join("A" if kind == FULL else "G" for kind in self.layer_types)

    def on_rank(self, shard: Shard) -> QwenConfig:
        """This rank's config (parallel.py): its share of the attention heads and KV heads, of the GDN key and value
        heads (so of the conv channels), and of the MLP's, each expert's and the shared expert's columns."""
        if shard.world == 1:
            return self
        return attrs.evolve(self, **{field: shard.split(count, what) for field, what, count in self.rank_counts()})

    def rank_counts(self) -> list[tuple[str, str, int]]:
        """(field, what it counts, count) for every count tensor parallelism splits (a dense model has no experts'
        columns, a MoE no dense MLP columns: those are left out)."""
        return [(field, what, getattr(self, field)) for field, what in RANK_SPLIT.items() if getattr(self, field)]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> QwenConfig:
        """Build from an HF config dict; a missing or inconsistent field raises ValueError naming it."""
        text = text_part(config)
        model_type = str(config.get("model_type", "qwen3_5_text"))

        def need(field: str) -> Any:
            if text.get(field) is None:
                raise ValueError(f"config.json has no {field!r}, which the qwen family needs")
            return text[field]

        layers = int(need("num_hidden_layers"))
        schedule = layer_schedule(text, layers)
        if len(schedule) != layers or not layers:
            raise ValueError(f"config.json layer_types names {len(schedule)} mixers for num_hidden_layers {layers}")
        if set(schedule) - {LINEAR, FULL}:
            raise ValueError(f"config.json layer_types holds {sorted(set(schedule) - {LINEAR, FULL})}; the qwen "
                             f"family serves {LINEAR} and {FULL} layers only")
        head_dim = int(need("head_dim"))           # HF's class default is 256, not hidden_size // heads
        rope = rope_parameters(config)
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            layer_types=schedule,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=tie_word_embeddings(config),
            max_positions=int(text.get("max_position_embeddings", 32768)),
            heads=int(need("num_attention_heads")),
            kv_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            rotary_dim=int(head_dim * float(rope["partial_rotary_factor"])),
            rope_theta=float(rope["rope_theta"]),
            k_heads=int(need("linear_num_key_heads")),
            v_heads=int(need("linear_num_value_heads")),
            k_dim=int(need("linear_key_head_dim")),
            v_dim=int(need("linear_value_head_dim")),
            conv_kernel=int(need("linear_conv_kernel_dim")),
        )
        if model_type in MOE_TYPES:
            fields.update(experts=int(need("num_experts")), top_k=int(need("num_experts_per_tok")),
                          moe_intermediate_size=int(need("moe_intermediate_size")),
                          shared_intermediate_size=int(need("shared_expert_intermediate_size")))
        else:
            fields.update(intermediate_size=int(need("intermediate_size")))
        built = cls(**fields)
        problems = built.inconsistencies()
        if problems:
            raise ValueError("; ".join(problems))
        return built

    def inconsistencies(self) -> list[str]:
        """Fields that contradict each other (config.json names in the sentences)."""
        counts = {"num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                  "linear_num_key_heads": self.k_heads, "linear_num_value_heads": self.v_heads,
                  "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        found = [f"config.json {name} is {value}; it must be at least 1" for name, value in counts.items() if value < 1]
        if found:
            return found
        if self.heads % self.kv_heads:
            found.append(f"num_attention_heads {self.heads} is not a multiple of num_key_value_heads {self.kv_heads}")
        if self.v_heads % self.k_heads:
            found.append(f"linear_num_value_heads {self.v_heads} is not a multiple of linear_num_key_heads "
                         f"{self.k_heads}")
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            found.append(f"rope_parameters.partial_rotary_factor gives {self.rotary_dim} rotary dims of head_dim "
                         f"{self.head_dim}; it must be an even number between 2 and head_dim")
        if self.conv_kernel < 2:
            found.append(f"linear_conv_kernel_dim {self.conv_kernel} must be at least 2")
        if self.moe and not 0 < self.top_k <= self.experts:
            found.append(f"num_experts_per_tok {self.top_k} must be between 1 and num_experts {self.experts}")
        return found


# ---------------------------------------------------------------- what the family refuses

def unsupported(config: Mapping[str, Any]) -> list[str]:
    """Config fields this family does not implement, each as a sentence naming the field and what would work."""
    text = text_part(config)
    rope = rope_parameters(config)
    checks = [
        (rope["rope_type"] == "default",
         (f"config.json rope_parameters.rope_type is {rope['rope_type']!r}; the qwen family implements default "
          "(partial, rotate-half) RoPE only")),
        (text.get("hidden_act", "silu") == "silu",
         f"config.json hidden_act is {text.get('hidden_act')!r}; the qwen family's MLPs are SwiGLU (silu)"),
        (not text.get("attention_bias", False),
         "config.json sets attention_bias: true; the qwen family's attention projections have no biases"),
        (text.get("attn_output_gate", True),
         "config.json sets attn_output_gate: false; the qwen family implements gated attention only"),
        (text.get("output_gate_type", "swish") == "swish",
         f"config.json output_gate_type is {text.get('output_gate_type')!r}; the GDN output gate is silu (swish)"),
        (text.get("mamba_ssm_dtype", "float32") == "float32",
         (f"config.json mamba_ssm_dtype is {text.get('mamba_ssm_dtype')!r}; the qwen family keeps the GDN state "
          "in float32")),
        (text.get("norm_topk_prob", True),
         "config.json sets norm_topk_prob: false; the qwen family renormalises the top-k router weights"),
        (not text.get("mlp_only_layers") and int(text.get("decoder_sparse_step", 1)) == 1,
         "config.json sets mlp_only_layers or decoder_sparse_step; the qwen family's MoE runs in every layer"),
        (not (config.get("quantization_config") or text.get("quantization_config")),
         "config.json has a quantization_config; the qwen family serves unquantized (bf16/fp32) weights only"),
    ]
    return [sentence for ok, sentence in checks if not ok]
