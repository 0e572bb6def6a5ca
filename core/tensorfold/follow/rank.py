"""One rank's model and Layout: the family's own at TP=1, its part of both at TP=N."""

from __future__ import annotations

import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.family import Family, FamilyModel
from tensorfold.follow.sharded import ShardedCheckpoint
from tensorfold.layout import Layout
from tensorfold.shard import Shard


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Where rank `rank` runs: the CPU for every rank, or one CUDA device each, counted from the one given."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def rank_layout(family: Family, checkpoint: Checkpoint, dtype: torch.dtype, world: int) -> Layout:
    """The Layout one rank holds: the family's, with every state split by head cut to 1/world."""
    layout = family.declare(checkpoint.config, dtype).layout
    if world == 1:
        return layout
    parallel = family.tensor_parallel(checkpoint.config)
    if parallel is None:
        raise family.fail("declares no family_tensor_parallel: it serves at --tensor-parallel-size 1 only")
    try:
        return parallel.layout(layout, world)
    except ValueError as err:
        raise family.fail(f"family_tensor_parallel: {err}") from err


def rank_checkpoint(family: Family, checkpoint: Checkpoint, shard: Shard) -> Checkpoint:
    """The checkpoint as this rank reads it: its slice of every tensor (the whole one at TP=1)."""
    if shard.world == 1:
        return checkpoint
    return ShardedCheckpoint(checkpoint, family.tensor_parallel(checkpoint.config), shard)


def load_rank(family: Family, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
              shard: Shard) -> tuple[FamilyModel, Layout]:
    """This rank's model (built from its slices of the checkpoint) and its Layout."""
    layout = rank_layout(family, checkpoint, dtype, shard.world)
    if shard.world == 1:
        return family.load(checkpoint, dtype, device), layout
    return family.load(rank_checkpoint(family, checkpoint, shard), dtype, device, shard), layout
