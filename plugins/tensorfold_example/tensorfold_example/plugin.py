"""The example family's hook implementations: everything the core asks of a family, answered once at startup.

Registered by the entry point `example = "tensorfold_example.plugin"` in group `tensorfold` (pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tensorfold.chat.api import ChatFormat
from tensorfold.chat.tools import tool_parser
from tensorfold.checkpoint import Checkpoint
from tensorfold.hookspecs import hookimpl
from tensorfold.image import ImageFormat
from tensorfold.layout import LayerLayout, Layout, RowState, dtype_name
from tensorfold.settings import Settings
from tensorfold.shard import Shard, TensorParallel
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights
from tensorfold_example import load as loader
from tensorfold_example.model import ExampleConfig, ExampleModel, rope_parameters

IMAGE_FORMAT = "example-gqa"
IMAGE_VERSION = 1          # bump when the meaning of the kept rows changes (e.g. keys stored before RoPE)

TINY_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "dtype": "float32",
}


# ---------------------------------------------------------------- what the family serves

@hookimpl
def family_model_types() -> Sequence[str]:
    return ["qwen3"]


@hookimpl
def family_request_starts_switch() -> str:
    return "TF_EXAMPLE_REQUEST_STARTS"


# ---------------------------------------------------------------- checkpoints and the model

@hookimpl
def family_load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, shard: Shard) -> ExampleModel:
    return loader.load(checkpoint, dtype, device, shard=shard)


@hookimpl
def family_tensor_parallel(config: Mapping[str, Any]) -> TensorParallel:
    return loader.tensor_parallel(ExampleConfig.from_dict(config))


@hookimpl
def family_make_tiny(directory: Path, seed: int) -> None:
    directory = Path(directory)
    config = write_tiny_config(directory, TINY_CONFIG)
    write_tiny_weights(directory, loader.expected_shapes(ExampleConfig.from_dict(config)), draw, seed)


def draw(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """One deterministic float32 weight: matrices N(0, 1/fan_in), norm weights 1 + 0.1 N(0, 1), biases 0.1 N(0, 1).

    Unit-variance activations keep the tiny model's logits far from flat, so greedy decoding is not a coin toss.
    """
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if len(shape) == 2:
        return noise * shape[1] ** -0.5
    if name.endswith(".bias"):
        return noise * 0.1
    return 1.0 + noise * 0.1


# ---------------------------------------------------------------- memory and kept states

@hookimpl
def family_kv_layout(config: Mapping[str, Any], dtype: torch.dtype) -> Layout:
    c = ExampleConfig.from_dict(config)
    name = dtype_name(dtype)
    rows = [RowState("k", (c.kv_heads, c.head_dim), name),     # keys after k_norm and RoPE
            RowState("v", (c.kv_heads, c.head_dim), name)]
    return Layout([LayerLayout(kind="attention", rows=rows) for _ in range(c.layers)])


@hookimpl
def family_state_image(config: Mapping[str, Any], layout: Layout) -> ImageFormat:
    return ImageFormat.of_layout(IMAGE_FORMAT, IMAGE_VERSION, layout)


@hookimpl
def family_identity(config: Mapping[str, Any], dtype: torch.dtype) -> Mapping[str, str]:
    c = ExampleConfig.from_dict(config)
    return {
        "format": f"{IMAGE_FORMAT}/{IMAGE_VERSION}",
        "dtype": dtype_name(dtype),
        "layers": str(c.layers),
        "heads": str(c.heads),
        "kv_heads": str(c.kv_heads),
        "head_dim": str(c.head_dim),
        "rope": f"default theta={c.rope_theta!r}",
        "keys": "post k_norm, post RoPE",
    }


# ---------------------------------------------------------------- chat replies

@hookimpl
def family_chat_format(config: Mapping[str, Any]) -> ChatFormat:
    """Qwen3's tool calls (hermes JSON); no think markers, as the tiny checkpoint's ChatML template opens none.
    A real Qwen3 checkpoint writes `<think>`…`</think>` itself: a copy of this family for one would declare them."""
    return ChatFormat(tool_parser=tool_parser("hermes"))


# ---------------------------------------------------------------- refusals

@hookimpl
def family_refusals(config: Mapping[str, Any], settings: Settings) -> Sequence[str]:
    try:
        c = ExampleConfig.from_dict(config)
    except (ValueError, TypeError) as err:
        return [f"the example family cannot read config.json: {err}"]
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    found = []
    if text.get("use_sliding_window"):
        found.append("config.json sets use_sliding_window: true; the example family attends over the whole context "
                     "and has no sliding-window attention")
    layer_types = text.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        found.append(f"config.json layer_types holds {sorted(set(layer_types) - {'full_attention'})}; the example "
                     "family serves full_attention layers only")
    rope = rope_parameters(config)
    if rope["rope_type"] != "default":
        found.append(f"config.json rope_parameters.rope_type is {rope['rope_type']!r}; the example family "
                     "implements default RoPE only")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        found.append("config.json rope_parameters.partial_rotary_factor is not 1; the example family rotates "
                     "the whole head")
    if text.get("hidden_act", "silu") != "silu":
        found.append(f"config.json hidden_act is {text['hidden_act']!r}; the example family's MLP is SwiGLU (silu)")
    if settings.context > c.max_positions:
        found.append(f"--context {settings.context} exceeds the checkpoint's max_position_embeddings "
                     f"{c.max_positions} (config.json); lower --context to at most {c.max_positions}")
    return found
