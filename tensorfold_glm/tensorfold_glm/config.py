"""The GLM-5.3-Flash config record: what the forward needs from config.json, read once, and what the family refuses.

HF transformers names two model types (configuration_glm5_next.py):

    glm5_next        the container (Glm5NextForConditionalGeneration): text fields under `text_config`, or flat at
                     the top level (HF forwards a flat config's fields into text_config); weights
                     `model.language_model.*` + `lm_head.weight`, vision tower `model.visual.*` (skipped)
    glm5_next_text   the text model's own config (Glm5NextTextModel): fields at the top level

Every field has HF's Glm5NextTextConfig default. The per-layer schedules are derived as HF derives them:

    layer_types      "linear_attention" (KDA) or "indexed_attention" (MLA + DSA; "full_attention" is an alias);
                     default: layer i is KDA iff i % 4 != 3
    mlp_layer_types  "dense" or "sparse" (MoE); default: min(3, layers) dense, then sparse
    indexer_types    "full" (the layer runs its own DSA indexer) or "shared" (it reuses the previous layer's top-k),
                     indexed by global layer number; from `index_topk_pattern` ("FSSF…" or a list) if given, else
                     layer i is full iff max(i - offset + 1, 0) % freq == 0 (index_topk_freq 1,
                     index_skip_topk_offset 2): all full by default

The schedule in one word: L a KDA layer, I an MLA layer with its own indexer, S an MLA layer sharing the previous
layer's selection (`LLLILLLI…` for the default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

LINEAR = "linear_attention"
INDEXED = "indexed_attention"
FULL_ALIAS = "full_attention"          # HF rewrites it to indexed_attention
DENSE, SPARSE = "dense", "sparse"
FULL_INDEXER, SHARED_INDEXER = "full", "shared"
CONTAINER_TYPE, TEXT_TYPE = "glm5_next", "glm5_next_text"
MODEL_TYPES = (CONTAINER_TYPE, TEXT_TYPE)
SERVED_DTYPES = ("auto", "float32", "bfloat16")

# KvStore state names (plugin.family_kv_layout declares them; the layers read and write them)
KDA_KIND, MLA_KIND = "kda", "mla"
CONV = "conv"                  # KDA fixed [3·H·DK, K-1] act: the last K-1 conv inputs of [q | k | v]
RECURRENT = "recurrent"        # KDA fixed [H, DK, DV] float32
LATENT = "latent"              # MLA row [kv_lora_rank] act: the normalised latent
POOLED_KEY = "pooled_key"      # full indexer row [index_head_dim] act, every index_kpool tokens
POOL_TAIL = "pool_tail"        # full indexer fixed [kpool-1, 2, index_head_dim] act: raw keys [:, 0], gates [:, 1]
SELECT_BYTES = 256 << 20       # a prefill step's DSA scores ([rows, index heads, pools] float32) per block of rows

# Glm5NextTextConfig's class defaults, for every field read here (transformers 5.24)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "swiglu_limit": 10.0, "linear_head_dim": 128,
    "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20, "index_kpool": 16, "index_kpool_always_select_tail": True,
}


def text_part(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields: `text_config` when nested, the config itself when flat."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def tie_word_embeddings(config: Mapping[str, Any]) -> bool:
    """The container's own flag wins (Glm5NextForConditionalGeneration reads the top level; a flat config's
    tie_word_embeddings is a container field that HF does not forward into text_config)."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text_part(config).get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"]))


def _get(text: Mapping[str, Any], field: str, default: Any = None) -> Any:
    """A field, or its default when absent or null."""
    value = text.get(field)
    return (DEFAULTS.get(field) if default is None else default) if value is None else value


def layer_schedule(text: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """HF's layer_types: as given with full_attention renamed indexed_attention, else KDA iff i % 4 != 3."""
    given = text.get("layer_types")
    if given is None:
        return tuple(LINEAR if i % 4 != 3 else INDEXED for i in range(layers))
    return tuple(INDEXED if kind == FULL_ALIAS else kind for kind in given)


def mlp_schedule(text: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """HF's mlp_layer_types: as given, else min(3, layers) dense then sparse."""
    given = text.get("mlp_layer_types")
    if given is None:
        return (DENSE,) * min(3, layers) + (SPARSE,) * (layers - 3)
    return tuple(given)


def indexer_schedule(text: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """HF's indexer_types: as given; else from index_topk_pattern (a string of F/S, or a list taken as it is);
    else full iff max(i - index_skip_topk_offset + 1, 0) % max(index_topk_freq, 1) == 0."""
    given = text.get("indexer_types")
    if given is not None:
        return tuple(given)
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            letters = {"F": FULL_INDEXER, "S": SHARED_INDEXER}
            unknown = sorted(set(pattern) - set(letters))
            if unknown:
                raise ValueError(f"config.json index_topk_pattern {pattern!r} holds {unknown}; HF reads F and S only")
            return tuple(letters[c] for c in pattern)
        return tuple(pattern)
    freq = max(int(_get(text, "index_topk_freq", 1)), 1)
    offset = int(_get(text, "index_skip_topk_offset", 2))
    return tuple(FULL_INDEXER if max(i - offset + 1, 0) % freq == 0 else SHARED_INDEXER for i in range(layers))


def linear_fields(text: Mapping[str, Any]) -> dict[str, Any]:
    """The KDA fields, with HF's `linear_attn_config` dict (the original checkpoints' spelling) overriding them."""
    out = {name: _get(text, name) for name in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")}
    out["linear_lower_bound"] = text.get("linear_lower_bound", DEFAULTS["linear_lower_bound"])   # null: softplus
    given = text.get("linear_attn_config")
    if isinstance(given, Mapping):
        out["linear_head_dim"] = given.get("head_dim", out["linear_head_dim"])
        out["linear_num_heads"] = given.get("num_heads", out["linear_num_heads"])
        out["linear_conv_kernel_dim"] = given.get("short_conv_kernel_size", out["linear_conv_kernel_dim"])
        out["linear_lower_bound"] = given.get("gate_lower_bound", out["linear_lower_bound"])
        if given.get("safe_gate", True) and out["linear_lower_bound"] is None:
            out["linear_lower_bound"] = -5.0
    return out


@attrs.frozen
class GlmConfig:
    """Everything the forward reads, under HF's field names. Shapes: E hidden, KDA H heads of D dims (keys and
    values alike) and conv kernel K; MLA heads, ranks Q (q_lora) and R (kv_lora); indexer NI heads of DI dims."""

    model_type: str
    vocab_size: int
    hidden_size: int                          # E
    layer_types: tuple[str, ...]              # linear_attention | indexed_attention, one per layer
    mlp_layer_types: tuple[str, ...]          # dense | sparse
    indexer_types: tuple[str, ...]            # full | shared, by global layer number (read for MLA layers only)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    swiglu_limit: float                       # SwiGLU clamp: gate <= L, -L <= up <= L
    # KDA
    linear_num_heads: int                     # H
    linear_head_dim: int                      # D
    linear_conv_kernel_dim: int               # K
    linear_lower_bound: float | None          # g = lb·sigmoid(exp(A_log)·(f + dt_bias)); None: -exp(A_log)·softplus
    # MLA (NoPE)
    num_attention_heads: int
    q_lora_rank: int                          # Q
    kv_lora_rank: int                         # R
    qk_nope_head_dim: int
    qk_rope_head_dim: int                     # 0: served; other values are refused
    v_head_dim: int
    # DSA indexer
    index_topk: int
    index_head_dim: int                       # DI
    index_n_heads: int                        # NI
    index_kpool: int
    index_kpool_always_select_tail: bool
    # MLP and MoE
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    # mHC
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def kda_conv_dim(self) -> int:
        """Channels of the KDA conv: [q | k | v], each H·D."""
        return 3 * self.linear_num_heads * self.linear_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def hc_mixes(self) -> int:
        """Rows of each hc_*_fn: pre (m) + post (m) + comb (m·m)."""
        return (2 + self.hc_mult) * self.hc_mult

    def indexer(self, layer: int) -> str | None:
        """An MLA layer's indexer (full or shared); None for a KDA layer."""
        return None if self.layer_types[layer] == LINEAR else self.indexer_types[layer]

    @property
    def schedule(self) -> str:
        """The mixers in one word: L KDA, I MLA with its own indexer, S MLA sharing the previous selection."""
        return "".join("L" if kind == LINEAR else "S" if self.indexer_types[i] == SHARED_INDEXER else "I"
                       for i, kind in enumerate(self.layer_types))

    @property
    def mlp_schedule(self) -> str:
        """The feed-forwards in one word: D dense, M MoE."""
        return "".join("M" if kind == SPARSE else "D" for kind in self.mlp_layer_types)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> GlmConfig:
        """Build from an HF config dict (flat or nested); a field HF could not build a model from raises
        ValueError naming it."""
        text = text_part(config)
        layers = int(_get(text, "num_hidden_layers"))
        heads = int(_get(text, "num_attention_heads"))
        fields: dict[str, Any] = dict(
            model_type=str(config.get("model_type", CONTAINER_TYPE)),
            vocab_size=int(_get(text, "vocab_size")),
            hidden_size=int(_get(text, "hidden_size")),
            layer_types=layer_schedule(text, layers),
            mlp_layer_types=mlp_schedule(text, layers),
            indexer_types=indexer_schedule(text, layers),
            rms_norm_eps=float(_get(text, "rms_norm_eps")),
            tie_word_embeddings=tie_word_embeddings(config),
            max_position_embeddings=int(_get(text, "max_position_embeddings")),
            swiglu_limit=float(_get(text, "swiglu_limit")),
            num_attention_heads=heads,
            index_kpool_always_select_tail=bool(_get(text, "index_kpool_always_select_tail")),
            norm_topk_prob=bool(_get(text, "norm_topk_prob")),
            routed_scaling_factor=float(_get(text, "routed_scaling_factor")),
            hc_eps=float(_get(text, "hc_eps")),
        )
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "index_topk", "index_head_dim", "index_n_heads", "index_kpool", "intermediate_size",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                     "n_group", "topk_group", "hc_mult", "hc_sinkhorn_iters"):
            fields[name] = int(_get(text, name))
        linear = linear_fields(text)
        fields.update(linear_num_heads=int(linear["linear_num_heads"]), linear_head_dim=int(linear["linear_head_dim"]),
                      linear_conv_kernel_dim=int(linear["linear_conv_kernel_dim"]),
                      linear_lower_bound=None if linear["linear_lower_bound"] is None
                      else float(linear["linear_lower_bound"]))
        built = cls(**fields)
        kv_heads = text.get("num_key_value_heads")
        problems = built.inconsistencies(layers, heads if kv_heads is None else int(kv_heads))
        if problems:
            raise ValueError("; ".join(problems))
        return built

    def inconsistencies(self, layers: int, kv_heads: int) -> list[str]:
        """Fields that contradict each other or that HF's config validation rejects (config.json names)."""
        counts = {"num_hidden_layers": layers, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                  "num_attention_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
                  "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                  "v_head_dim": self.v_head_dim, "linear_num_heads": self.linear_num_heads,
                  "linear_head_dim": self.linear_head_dim, "index_head_dim": self.index_head_dim,
                  "index_n_heads": self.index_n_heads, "index_kpool": self.index_kpool, "hc_mult": self.hc_mult,
                  "hc_sinkhorn_iters": self.hc_sinkhorn_iters}
        found = [f"config.json {name} is {value}; it must be at least 1" for name, value in counts.items() if value < 1]
        if found:
            return found
        for name, given, allowed in (("layer_types", self.layer_types, (LINEAR, INDEXED)),
                                     ("mlp_layer_types", self.mlp_layer_types, (DENSE, SPARSE)),
                                     ("indexer_types", self.indexer_types, (FULL_INDEXER, SHARED_INDEXER))):
            if len(given) != layers:
                found.append(f"config.json {name} names {len(given)} layers for num_hidden_layers {layers}")
            if set(given) - set(allowed):
                found.append(f"config.json {name} holds {sorted(set(given) - set(allowed))}; the glm family reads "
                             f"{' and '.join(allowed)} only")
        if kv_heads != self.num_attention_heads:
            found.append(f"config.json num_key_value_heads {kv_heads} differs from num_attention_heads "
                         f"{self.num_attention_heads}; HF's GLM-5.3-Flash MLA needs them equal")
        if self.index_topk % self.index_kpool or self.index_topk < 1:
            found.append(f"config.json index_topk {self.index_topk} must be a positive multiple of index_kpool "
                         f"{self.index_kpool}")
        if self.linear_conv_kernel_dim < 2:
            found.append(f"config.json linear_conv_kernel_dim {self.linear_conv_kernel_dim} must be at least 2")
        if SPARSE in self.mlp_layer_types:
            found += self._moe_inconsistencies()
        elif DENSE in self.mlp_layer_types and self.intermediate_size < 1:
            found.append(f"config.json intermediate_size {self.intermediate_size} must be at least 1")
        return found

    def _moe_inconsistencies(self) -> list[str]:
        N, groups = self.n_routed_experts, self.n_group
        if N < 1 or self.moe_intermediate_size < 1:
            return [f"config.json n_routed_experts {N} and moe_intermediate_size {self.moe_intermediate_size} must "
                    "be at least 1 when mlp_layer_types has sparse layers"]
        found = []
        if not 0 < self.num_experts_per_tok <= N:
            found.append(f"config.json num_experts_per_tok {self.num_experts_per_tok} must be between 1 and "
                         f"n_routed_experts {N}")
        if groups < 1 or N % groups or N // groups < 2:
            found.append(f"config.json n_group {groups} must divide n_routed_experts {N} into groups of at least "
                         "2 experts (HF scores a group by its two best experts)")
        elif not 0 < self.topk_group <= groups:
            found.append(f"config.json topk_group {self.topk_group} must be between 1 and n_group {groups}")
        return found


# ---------------------------------------------------------------- what the family refuses

def unsupported(config: Mapping[str, Any]) -> list[str]:
    """Config fields HF can hold but this family does not serve, each as a sentence naming the field."""
    text = text_part(config)
    found = []
    rope = int(_get(text, "qk_rope_head_dim"))
    if rope != 0:
        found.append(f"config.json qk_rope_head_dim is {rope}; GLM-5.3-Flash's MLA is NoPE and the glm family serves "
                     "qk_rope_head_dim 0 only (HF's own config validation refuses it too)")
    if _get(text, "hidden_act") != "silu":
        found.append(f"config.json hidden_act is {text.get('hidden_act')!r}; the glm family's MLPs and KDA conv use "
                     "silu")
    if _get(text, "attention_bias"):
        found.append("config.json sets attention_bias: true; the glm family's MLA projections have no biases")
    if int(_get(text, "n_shared_experts")) < 1:
        found.append(f"config.json n_shared_experts is {text.get('n_shared_experts')}; the glm family's MoE layers "
                     "need at least one shared expert")
    if config.get("quantization_config") or text.get("quantization_config"):
        found.append("config.json has a quantization_config; the glm family serves unquantized (bf16/fp32) "
                     "weights only")
    try:
        layers = int(_get(text, "num_hidden_layers"))
        kinds, indexers = layer_schedule(text, layers), indexer_schedule(text, layers)
    except (ValueError, TypeError):
        return found                  # from_dict names the fault
    for i, kind in enumerate(kinds[:len(indexers)]):
        if kind == LINEAR or indexers[i] != SHARED_INDEXER:
            continue
        if i == 0:
            before = "no layer"
        elif kinds[i - 1] == LINEAR:
            before = "a KDA layer"
        elif indexers[i - 1] == SHARED_INDEXER:
            before = "another shared layer"
        else:
            continue                  # right after an MLA layer with its own indexer: served
        found.append(f"config.json indexer_types makes MLA layer {i} shared, but it follows {before}: a shared "
                     "layer reuses the top-k of the layer right before it, which must be an MLA layer with its own "
                     "indexer (HF cannot run this config either: it raises 'Shared DSA layers require top-k indices "
                     f"from a previous full indexer layer'); give layer {i} a full indexer (indexer_types, or "
                     "index_topk_pattern / index_topk_freq / index_skip_topk_offset)")
    return found
