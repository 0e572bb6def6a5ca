"""HF checkpoint names -> the Nemotron-H model's weights; every name is checked before a tensor is read.

The published checkpoints, and HF's `save_pretrained`, name the model `backbone.*` and store each expert on its own
(`mixer.experts.{e}.up_proj.weight` [FE, W], `down_proj.weight` [W, FE]); HF transformers holds them in memory as
`model.*` with the experts stacked (`mixer.experts.up_proj` [NE, FE, W], `mixer.experts.down_proj` [NE, W, FE]).
Both spellings and both expert forms are accepted (one expert form for the whole checkpoint). The multi-token
prediction head (`mtp.*`) is skipped, as HF skips it. `lm_head.weight` is always read: HF's NemotronHForCausalLM
ties nothing, whatever `tie_word_embeddings` says. This file is the only place that knows these names (parallel.py
matches them by pattern to cut them across ranks).

The router (`gate.weight`, `gate.e_score_correction_bias`) stays float32 in every model dtype, as HF keeps it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch

from tensorfold.checkpoint import Checkpoint, check_tensor_names, expected_tensors
from tensorfold.shard import SINGLE, Shard
from tensorfold_nemotron.attention import AttentionWeights
from tensorfold_nemotron.config import ATTENTION, MAMBA, MOE, NemotronConfig
from tensorfold_nemotron.mamba import MambaWeights
from tensorfold_nemotron.mlp import MlpWeights, MoeWeights
from tensorfold_nemotron.model import LayerWeights, Mixer, NemotronModel, Weights
from tensorfold_nemotron.parallel import STACKED

log = logging.getLogger(__name__)

PREFIX, IN_MEMORY = "backbone.", "model."
SKIPPED = ("mtp.",)                               # the MTP head: not part of the served model
PER_EXPERT = re.compile(r"\.mixer\.experts\.\d+\.")
FUSED = re.compile(r"\.mixer\.experts\.(up_proj|down_proj)$")
FLOAT32 = re.compile(r"\.mixer\.gate\.(weight|e_score_correction_bias)$")

Get = Callable[[str], torch.Tensor]


def mamba_shapes(c: NemotronConfig) -> dict[str, tuple[int, ...]]:
    """A Mamba2 layer's tensors, under `backbone.layers.{i}.mixer.`."""
    E, inner, MH = c.hidden_size, c.mamba_inner, c.mamba_heads
    shapes = {"in_proj.weight": (inner + c.conv_dim + MH, E), "conv1d.weight": (c.conv_dim, 1, c.conv_kernel),
              "dt_bias": (MH,), "A_log": (MH,), "D": (MH,), "norm.weight": (inner,), "out_proj.weight": (E, inner)}
    if c.conv_bias:
        shapes["conv1d.bias"] = (c.conv_dim,)
    return shapes


def attention_shapes(c: NemotronConfig) -> dict[str, tuple[int, ...]]:
    """An attention layer's tensors, under `backbone.layers.{i}.mixer.`."""
    E, H, KV, D = c.hidden_size, c.heads, c.kv_heads, c.head_dim
    return {"q_proj.weight": (H * D, E), "k_proj.weight": (KV * D, E), "v_proj.weight": (KV * D, E),
            "o_proj.weight": (E, H * D)}


def mlp_shapes(c: NemotronConfig, prefix: str, inner: int, width: int | None = None) -> dict[str, tuple[int, ...]]:
    """A relu² MLP's tensors under `prefix`, reading and writing `width` (the hidden size by default)."""
    width = width or c.hidden_size
    return {f"{prefix}up_proj.weight": (inner, width), f"{prefix}down_proj.weight": (width, inner)}


def moe_shapes(c: NemotronConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """A MoE layer's tensors: router and its bias, experts (per expert, or stacked), shared expert, latent."""
    E, NE, FE, W = c.hidden_size, c.experts, c.moe_intermediate_size, c.expert_width
    shapes = {"gate.weight": (NE, E), "gate.e_score_correction_bias": (NE,)}
    shapes.update(mlp_shapes(c, "shared_experts.", c.shared_intermediate_size))
    if c.latent_size:
        shapes.update({"fc1_latent_proj.weight": (c.latent_size, E), "fc2_latent_proj.weight": (E, c.latent_size)})
    if fused:
        shapes.update({"experts.up_proj": (NE, FE, W), "experts.down_proj": (NE, W, FE)})
    else:
        for e in range(NE):
            shapes.update(mlp_shapes(c, f"experts.{e}.", FE, W))
    return shapes


def mixer_shapes(c: NemotronConfig, kind: str, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """One layer's mixer tensors by its kind, under `backbone.layers.{i}.mixer.`."""
    if kind == MAMBA:
        return mamba_shapes(c)
    if kind == ATTENTION:
        return attention_shapes(c)
    if kind == MOE:
        return moe_shapes(c, fused)
    return mlp_shapes(c, "", c.intermediate_size)


def expected_shapes(c: NemotronConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold (the `backbone.` spelling) and its shape; `fused`: the experts
    stacked, as HF holds them in memory."""
    E = c.hidden_size
    shapes = {f"{PREFIX}embeddings.weight": (c.vocab_size, E), f"{PREFIX}norm_f.weight": (E,)}
    for i, kind in enumerate(c.layer_types):
        shapes[f"{PREFIX}layers.{i}.norm.weight"] = (E,)
        shapes.update({f"{PREFIX}layers.{i}.mixer.{name}": shape
                       for name, shape in mixer_shapes(c, kind, fused).items()})
    shapes["lm_head.weight"] = (c.vocab_size, E)          # never tied (HF's NemotronHForCausalLM ties nothing)
    return shapes


def canonical(name: str) -> str:
    """A checkpoint name in the `backbone.` spelling: `model.x` -> `backbone.x`."""
    return PREFIX + name[len(IN_MEMORY):] if name.startswith(IN_MEMORY) else name


def skipped(name: str, config: NemotronConfig) -> bool:
    """Tensors that are in the checkpoint but not the served model: the MTP head."""
    return name.startswith(SKIPPED)


def fused_experts(names: list[str], config: NemotronConfig) -> bool:
    """Whether the checkpoint holds its experts stacked rather than per expert; ValueError when it holds both."""
    kept = [canonical(name) for name in names if not skipped(canonical(name), config)]
    per = [name for name in kept if PER_EXPERT.search(name)]
    fused = [name for name in kept if FUSED.search(name)]
    if per and fused:
        raise ValueError(f"the checkpoint mixes the two expert forms: {len(fused)} stacked tensors (e.g. {fused[0]}) "
                         f"and {len(per)} per-expert tensors (e.g. {per[0]}); every layer's experts must be either "
                         "mixer.experts.up_proj + mixer.experts.down_proj or mixer.experts.{e}.{up,down}_proj.weight")
    return bool(fused)


def check_names(names: list[str], config: NemotronConfig, fused: bool = False) -> int:
    """Raise ValueError naming every missing, unexpected or doubled tensor; return how many are skipped."""

    def expert_form(missing: list[str]) -> str | None:
        if not any(".mixer.experts." in name for name in missing):
            return None
        return (f"experts are read in the {'stacked' if fused else 'per-expert'} form this checkpoint uses: "
                + ("mixer.experts.up_proj [NE, FE, W] and mixer.experts.down_proj [NE, W, FE] per layer" if fused
                   else "mixer.experts.{e}.up_proj.weight and down_proj.weight for every e < n_routed_experts"))

    return check_tensor_names(names, expected_shapes(config, fused), canonical, lambda key: skipped(key, config),
                              model=f"nemotron_h {config.schedule}", explain_missing=expert_form)


def load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, progress: bool = True,
         shard: Shard = SINGLE) -> NemotronModel:
    """Read every weight once, shard by shard, into `dtype` on `device` (the router in float32), and build the
    model (this rank's part of it: the checkpoint a rank reads yields its slices, parallel.py)."""
    config = NemotronConfig.from_dict(checkpoint.config).on_rank(shard)
    names = checkpoint.names()
    fused = fused_experts(names, config)
    skips = check_names(names, config, fused)
    if skips:
        log.info("skipped %d tensors the served model does not use (the MTP head mtp.*)", skips)
    shapes = expected_shapes(config, fused)
    if fused:
        shapes.update(stacked_whole(shapes, shard))
    found = {key: own_columns(key, tensor, shard).to(device=device,
                                                     dtype=torch.float32 if FLOAT32.search(key) else dtype).contiguous()
             for key, tensor in expected_tensors(checkpoint, shapes, canonical, progress)}
    return NemotronModel(config, build_weights(config, found), shard)


def stacked_whole(shapes: dict[str, tuple[int, ...]], shard: Shard) -> dict[str, tuple[int, ...]]:
    """The stacked experts' shapes as a rank reads them: whole (parallel.py replicates them; `own_columns` cuts)."""
    whole = {}
    for key, shape in shapes.items():
        found = FUSED.search(key)
        if found:
            dims = list(shape)
            dims[STACKED[found.group(1)]] *= shard.world
            whole[key] = tuple(dims)
    return whole


def own_columns(key: str, tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """A stacked expert tensor cut to this rank's intermediate columns (the rank's own tensors pass unchanged)."""
    found = FUSED.search(key)
    if found is None or shard.world == 1:
        return tensor
    return tensor.chunk(shard.world, STACKED[found.group(1)])[shard.rank]


def build_weights(config: NemotronConfig, found: dict[str, torch.Tensor]) -> Weights:
    """Arrange tensors named as in `expected_shapes` (either expert form) into the model's records, each taken out
    of `found` as it is used."""
    layers = []
    for i, kind in enumerate(config.layer_types):
        def get(name: str, i: int = i) -> torch.Tensor:
            return found.pop(f"{PREFIX}layers.{i}.mixer.{name}")

        layers.append(LayerWeights(norm=found.pop(f"{PREFIX}layers.{i}.norm.weight"),
                                   mixer=mixer_weights(config, kind, get)))
    return Weights(embed=found[f"{PREFIX}embeddings.weight"], layers=tuple(layers),
                   norm=found[f"{PREFIX}norm_f.weight"], lm_head=found["lm_head.weight"])


def mixer_weights(config: NemotronConfig, kind: str, get: Get) -> Mixer:
    """One layer's mixer record from its tensors (`get` takes one out by its name under `mixer.`)."""
    if kind == MAMBA:
        return MambaWeights(in_proj=get("in_proj.weight"), conv=get("conv1d.weight").squeeze(1).contiguous(),
                            conv_bias=get("conv1d.bias") if config.conv_bias else None, dt_bias=get("dt_bias"),
                            A_log=get("A_log"), D=get("D"), norm=get("norm.weight"), out_proj=get("out_proj.weight"))
    if kind == ATTENTION:
        return AttentionWeights(*(get(f"{name}.weight") for name in ("q_proj", "k_proj", "v_proj", "o_proj")))
    if kind == MOE:
        return moe_weights(config, get)
    return MlpWeights(get("up_proj.weight"), get("down_proj.weight"))


def stacked(config: NemotronConfig, get: Get, name: str) -> torch.Tensor:
    """Per-expert tensors `experts.{e}.{name}.weight` into one [NE, ...] tensor, each copied in as it is taken."""
    first = get(f"experts.0.{name}.weight")
    out = first.new_empty((config.experts, *first.shape))
    out[0] = first
    for e in range(1, config.experts):
        out[e] = get(f"experts.{e}.{name}.weight")
    return out


def moe_weights(config: NemotronConfig, get: Get) -> MoeWeights:
    """A MoE layer's record, its experts stacked whichever form the checkpoint holds them in."""
    try:
        up, down = get("experts.up_proj"), get("experts.down_proj")
    except KeyError:
        up, down = stacked(config, get, "up_proj"), stacked(config, get, "down_proj")
    latent = config.latent_size > 0
    return MoeWeights(router=get("gate.weight"), correction=get("gate.e_score_correction_bias"), up=up, down=down,
                      shared=MlpWeights(get("shared_experts.up_proj.weight"), get("shared_experts.down_proj.weight")),
                      latent_in=get("fc1_latent_proj.weight") if latent else None,
                      latent_out=get("fc2_latent_proj.weight") if latent else None)
