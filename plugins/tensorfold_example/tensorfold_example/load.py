"""HF checkpoint names -> the example model's weights; every name is checked before a tensor is read.

The checkpoint's names are HF's (`model.layers.0.self_attn.q_proj.weight`, ...). A multimodal wrapper nests the
language model one level down (`model.language_model.layers.0...`); both spellings are accepted. The core never
reads these names: this file is the only place that knows them.
"""

from __future__ import annotations

import torch

from tensorfold.checkpoint import Checkpoint, check_tensor_names, expected_tensors
from tensorfold.shard import SINGLE, Shard, Split, StateSplit, TensorParallel
from tensorfold_example.model import ExampleConfig, ExampleModel, LayerWeights, Weights

NESTED = "model.language_model."
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # a buffer some older exports saved; recomputed, never read

# LayerWeights field -> the HF name under `model.layers.{i}.`
LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
BIAS_NAMES = {
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
}


def expected_shapes(c: ExampleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold (HF names, plain `model.` prefix) and its shape."""
    E, F, V, D = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    q, kv = c.heads * D, c.kv_heads * D
    layer = {
        "input_layernorm.weight": (E,),
        "self_attn.q_proj.weight": (q, E),
        "self_attn.k_proj.weight": (kv, E),
        "self_attn.v_proj.weight": (kv, E),
        "self_attn.o_proj.weight": (E, q),
        "self_attn.q_norm.weight": (D,),
        "self_attn.k_norm.weight": (D,),
        "post_attention_layernorm.weight": (E,),
        "mlp.gate_proj.weight": (F, E),
        "mlp.up_proj.weight": (F, E),
        "mlp.down_proj.weight": (E, F),
    }
    if c.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (E,)})
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,)}
    for i in range(c.layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, E)
    return shapes


def canonical(name: str) -> str:
    """A checkpoint name in the plain spelling: `model.language_model.x` -> `model.x`."""
    return "model." + name[len(NESTED):] if name.startswith(NESTED) else name


def ignored(key: str, config: ExampleConfig) -> bool:
    """Tensors the model does not read: an old rotary buffer, and an lm_head when the embedding is tied."""
    return key.endswith(IGNORED_SUFFIXES) or (key == "lm_head.weight" and config.tie_word_embeddings)


def check_names(names: list[str], config: ExampleConfig) -> int:
    """Raise ValueError naming every missing, unexpected or doubled tensor; return how many are ignored."""
    return check_tensor_names(names, expected_shapes(config), canonical, lambda key: ignored(key, config),
                              model="dense qwen3")


def tensor_parallel(c: ExampleConfig) -> TensorParallel:
    """Megatron's cuts: q/k/v and gate/up by output column (whole heads), o and down by input column (their outputs
    summed over ranks), the rest whole; keys and values split by KV head."""
    return TensorParallel(
        divides={"attention heads (num_attention_heads)": c.heads, "KV heads (num_key_value_heads)": c.kv_heads,
                 "MLP columns (intermediate_size)": c.intermediate_size},
        params=[Split("*.self_attn.[qkv]_proj.*", "column"), Split("*.mlp.gate_proj.weight", "column"),
                Split("*.mlp.up_proj.weight", "column"), Split("*.self_attn.o_proj.*", "row"),
                Split("*.mlp.down_proj.weight", "row"), Split("*", "replicated")],
        states=[StateSplit("k", 0), StateSplit("v", 0)])


def load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, progress: bool = True,
         shard: Shard = SINGLE) -> ExampleModel:
    """Read every weight once, shard by shard, into `dtype` on `device`, and build the model (this rank's part of
    it: the checkpoint a rank reads yields its slices, follow/sharded.py)."""
    config = ExampleConfig.from_dict(checkpoint.config).on_rank(shard)
    check_names(checkpoint.names(), config)
    shapes = expected_shapes(config)
    found = {key: tensor.to(device=device, dtype=dtype).contiguous()
             for key, tensor in expected_tensors(checkpoint, shapes, canonical, progress)}
    return ExampleModel(config, build_weights(config, found), shard)


def build_weights(config: ExampleConfig, found: dict[str, torch.Tensor]) -> Weights:
    """Arrange tensors named as in `expected_shapes` into the model's records."""
    layers = []
    for i in range(config.layers):
        prefix = f"model.layers.{i}."
        fields = {field: found[prefix + name] for field, name in LAYER_NAMES.items()}
        if config.attention_bias:
            fields.update({field: found[prefix + name] for field, name in BIAS_NAMES.items()})
        layers.append(LayerWeights(**fields))
    embed = found["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else found["lm_head.weight"]
    return Weights(embed=embed, layers=tuple(layers), norm=found["model.norm.weight"], lm_head=lm_head)
