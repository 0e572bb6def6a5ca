"""The hook specs a model family answers: TensorFold's public plugin API (documented in docs/hooks.md).

Every hook is called once per family at startup, with keyword arguments; an implementation may take fewer
arguments than its spec. Each returns one answer (`firstresult`). None of them runs in the step loop. Every hook
is required but those in OPTIONAL, which have a documented default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from tensorfold.chat.api import ChatFormat
    from tensorfold.checkpoint import Checkpoint
    from tensorfold.family import FamilyModel
    from tensorfold.image import ImageFormat
    from tensorfold.layout import Layout
    from tensorfold.settings import Settings
    from tensorfold.shard import Shard, TensorParallel

PROJECT = "tensorfold"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
# a family may leave these out (docs/hooks.md gives each one's default)
OPTIONAL = ("family_chat_format", "family_tensor_parallel")


# ---------------------------------------------------------------- what the family serves

@hookspec(firstresult=True)
def family_model_types() -> Sequence[str]:
    """The HF `model_type` values this family serves, so a checkpoint finds its family."""


# ---------------------------------------------------------------- checkpoints and the model

@hookspec(firstresult=True)
def family_load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, shard: Shard) -> FamilyModel:
    """Build the model from an HF-format checkpoint, so the core never reads a family's weight names; with a
    `shard` of world N the checkpoint yields this rank's slices and the model reduces its row-parallel outputs."""


@hookspec(firstresult=True)
def family_make_tiny(directory: Path, seed: int) -> None:
    """Write a small deterministic HF-format checkpoint (config, weights, tokenizer), for the embedded default."""


# ---------------------------------------------------------------- memory and kept states

@hookspec(firstresult=True)
def family_kv_layout(config: Mapping[str, Any], dtype: torch.dtype) -> Layout:
    """Every layer's row and fixed states, so the core can price and hold a stream's memory."""


@hookspec(firstresult=True)
def family_state_image(config: Mapping[str, Any], layout: Layout) -> ImageFormat:
    """How a kept state becomes bytes: its format name and version, its own part, its rows by position."""


@hookspec(firstresult=True)
def family_identity(config: Mapping[str, Any], dtype: torch.dtype) -> Mapping[str, str]:
    """The facts that must match for a kept state to be valid (cache format, dtypes, schedule)."""


@hookspec(firstresult=True)
def family_request_starts_switch() -> str:
    """The name of the TF_* switch that turns cutting at request starts on or off for this family."""


@hookspec(firstresult=True)
def family_tensor_parallel(config: Mapping[str, Any]) -> TensorParallel:
    """Which tensors are column-, row-parallel or replicated, which states split by head, and what must divide the
    world, so the core can cut the checkpoint and the Layout per rank (optional: without it, TP=1 only)."""


# ---------------------------------------------------------------- refusals

@hookspec(firstresult=True)
def family_refusals(config: Mapping[str, Any], settings: Settings) -> Sequence[str]:
    """What this family cannot serve with these settings, each as a sentence naming the flag or field."""


# ---------------------------------------------------------------- chat replies

@hookspec(firstresult=True)
def family_chat_format(config: Mapping[str, Any]) -> ChatFormat:
    """The think markers and tool-call parser of the family's replies, so the server splits reasoning and calls
    the way the model was trained to write them (optional: hermes without think markers)."""
