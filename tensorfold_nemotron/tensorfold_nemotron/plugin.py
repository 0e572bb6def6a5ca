"""The nemotron family's hook implementations: everything the core asks of a family, answered once at startup.

Registered by the entry point `nemotron = "tensorfold_nemotron.plugin"` in group `tensorfold` (pyproject.toml). The
model itself (`load.py`) is imported only when `family_load` is called, so listing families and planning memory
never import the forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tensorfold.chat.api import ChatFormat
from tensorfold.chat.tools import tool_parser
from tensorfold.hookspecs import hookimpl
from tensorfold.image import ImageFormat
from tensorfold.kernels.moe import TILES
from tensorfold.kernels.ssd import CHUNK
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState, dtype_name
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights
from tensorfold_nemotron.config import ATTENTION, MAMBA, MODEL_TYPES, SERVED_DTYPES, NemotronConfig, unsupported

if TYPE_CHECKING:
    from tensorfold.checkpoint import Checkpoint
    from tensorfold.family import FamilyModel
    from tensorfold.settings import Settings
    from tensorfold.shard import Shard, TensorParallel

IMAGE_FORMAT = "nemotron_h-hybrid"
IMAGE_VERSION = 1          # bump when the meaning of a kept state changes (e.g. the SSM state's layout)
CONV, SSM, KEYS, VALUES = "conv", "ssm", "k", "v"       # the state names (model.py uses the same)
KIND = {MAMBA: "mamba", ATTENTION: "attention"}          # Layout kinds; mlp and moe keep their HF names

TINY_CONFIG: dict[str, Any] = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "layers_block_type": ["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],   # M E * M -
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    # attention: GQA, no RoPE
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attention_bias": False,
    # Mamba2: 4 heads x 16, 2 groups of B/C, state 16
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "use_conv_bias": True,
    "mamba_hidden_act": "silu",
    "time_step_limit": [0.0, math.inf],
    "chunk_size": 128,
    "use_bias": False,
    # relu² MLP and MoE: 8 experts in 2 routing groups, 1 group kept, top 2, a shared expert
    "intermediate_size": 128,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 64,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "dtype": "float32",
}


# ---------------------------------------------------------------- what the family serves

@hookimpl
def family_model_types() -> Sequence[str]:
    return list(MODEL_TYPES)


@hookimpl
def family_request_starts_switch() -> str:
    return "TF_NEMOTRON_REQUEST_STARTS"


# ---------------------------------------------------------------- checkpoints and the model

@hookimpl
def family_load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, shard: Shard) -> FamilyModel:
    from tensorfold_nemotron import load

    return load.load(checkpoint, dtype, device, shard=shard)


@hookimpl
def family_tensor_parallel(config: Mapping[str, Any]) -> TensorParallel:
    from tensorfold_nemotron.parallel import tensor_parallel

    return tensor_parallel(NemotronConfig.from_dict(config))


@hookimpl
def family_make_tiny(directory: Path, seed: int) -> None:
    write_tiny(Path(directory), seed)


def write_tiny(directory: Path, seed: int, **changes: Any) -> None:
    """A tiny deterministic Nemotron-H checkpoint in the published layout (`backbone.*`, experts one by one),
    without transformers; `changes` replace config fields (None drops one)."""
    from tensorfold_nemotron.load import expected_shapes

    config = write_tiny_config(directory, TINY_CONFIG, **changes)
    write_tiny_weights(directory, expected_shapes(NemotronConfig.from_dict(config)), draw, seed)


def draw(name: str, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """One deterministic float32 weight, drawn so activations stay at unit scale and the SSM state carries far:

    matrices N(0, 1/fan_in) (fan_in the last dim; the stacked experts alike); norms 1 + 0.1·N(0, 1); the router's
    correction bias and other vectors 0.1·N(0, 1). The SSM parameters have their own draws: A_log = log U(0.5, 2);
    dt_bias = softplus⁻¹(dt0), dt0 log-uniform in [0.002, 0.02], so with the projected dt of about ±1 added, dt·|A|
    is about 0.0004 .. 0.1 and a head keeps between about 90% and 99.9% of its state per token (HF's init, A up to
    MH and dt up to 0.1, forgets within a few tokens); D = U(0, 0.1), so the skip does not drown the scan; the
    depthwise conv taps N(0, 1/K) over its K taps.
    """
    shape = tuple(shape)
    if name.endswith("A_log"):
        return (0.5 + 1.5 * torch.rand(shape, generator=generator)).log()
    if name.endswith("dt_bias"):
        dt0 = (math.log(0.002) + (math.log(0.02) - math.log(0.002)) * torch.rand(shape, generator=generator)).exp()
        return dt0 + torch.log(-torch.expm1(-dt0))
    if name.endswith(".D"):
        return 0.1 * torch.rand(shape, generator=generator)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if len(shape) >= 2:                                # matrices, and the conv [C, 1, K] over its K taps
        return noise * shape[-1] ** -0.5
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return 1.0 + 0.1 * noise
    return 0.1 * noise


# ---------------------------------------------------------------- memory and kept states

@hookimpl
def family_kv_layout(config: Mapping[str, Any], dtype: torch.dtype) -> Layout:
    c = NemotronConfig.from_dict(config)
    act = dtype_name(dtype)
    layers = []
    for kind in c.layer_types:
        if kind == MAMBA:
            layers.append(LayerLayout(kind="mamba", fixed=[
                FixedState(CONV, (c.conv_dim, c.conv_kernel - 1), act),           # the last K-1 inputs of [x|B|C]
                FixedState(SSM, (c.mamba_heads, c.mamba_head_dim, c.state_size), "float32")]))   # HF's layout
        elif kind == ATTENTION:
            layers.append(LayerLayout(kind="attention", rows=[RowState(KEYS, (c.kv_heads, c.head_dim), act),
                                                              RowState(VALUES, (c.kv_heads, c.head_dim), act)]))
        else:
            layers.append(LayerLayout(kind=kind))                                  # mlp, moe: no state
    return Layout(layers)


@hookimpl
def family_state_image(config: Mapping[str, Any], layout: Layout) -> ImageFormat:
    return ImageFormat.of_layout(IMAGE_FORMAT, IMAGE_VERSION, layout)


@hookimpl
def family_identity(config: Mapping[str, Any], dtype: torch.dtype) -> Mapping[str, str]:
    c = NemotronConfig.from_dict(config)
    act = dtype_name(dtype)
    low, high = c.dt_limit
    return {
        "format": f"{IMAGE_FORMAT}/{IMAGE_VERSION}",
        "dtype": act,
        "schedule": c.schedule,
        "attention": f"heads={c.heads} kv_heads={c.kv_heads} head_dim={c.head_dim}",
        "keys": "as projected: no RoPE, no norm",
        "mamba": (f"heads={c.mamba_heads}x{c.mamba_head_dim} groups={c.n_groups} state={c.state_size} "
                  f"conv={c.conv_kernel} conv_bias={c.conv_bias}"),
        "mamba_state": f"ssm float32 [heads, head_dim, state]; conv tail {act} (last {c.conv_kernel - 1} inputs)",
        "mamba_algorithm": f"SSD chunked {CHUNK} on the absolute grid; 1-token steps recurrent",
        "dt_policy": f"softplus(dt + dt_bias) clamped to [{low!r}, {high!r}] in every path",
        **({"experts": f"relu2 experts through the kernels' routed_experts ({TILES})"} if "E" in c.schedule else {}),
    }


# ---------------------------------------------------------------- chat replies

@hookimpl
def family_chat_format(config: Mapping[str, Any]) -> ChatFormat:
    """Nemotron's replies: `<TOOLCALL>` JSON lists (Nemotron-H, Nano v2) or XML blocks (Nemotron-3), both read by
    the `nemotron` parser, and `<think>` blocks, which Nemotron-3's template opens with thinking on (the tiny
    checkpoint's ChatML opens none, so its replies are content)."""
    return ChatFormat(tool_parser=tool_parser("nemotron"), think_start="<think>", think_end="</think>")


# ---------------------------------------------------------------- refusals

@hookimpl
def family_refusals(config: Mapping[str, Any], settings: Settings) -> Sequence[str]:
    try:
        c = NemotronConfig.from_dict(config)
        found = unsupported(config)
    except (ValueError, TypeError) as err:
        return [f"the nemotron family cannot read config.json: {err}"]
    if settings.dtype not in SERVED_DTYPES:
        found.append(f"--dtype {settings.dtype} is not served by the nemotron family: use bfloat16 or float32 "
                     "(or auto); the SSM decay and gated norms are not checked in other dtypes")
    if settings.context > c.max_positions:
        found.append(f"--context {settings.context} exceeds the checkpoint's max_position_embeddings "
                     f"{c.max_positions} (config.json); lower --context to at most {c.max_positions}")
    return found
