"""One rank's model and Layout: the family's own at TP=1, its part of both at TP=N."""

from __future__ import annotations

import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.family import Family, FamilyModel
from tensorfold.follow.sharded import ShardedCheckpoint
from tensorfold.layout import Layout
from tensorfold.shard import Shard


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


def load_rank(family: Family, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
              shard: Shard) -> tuple[FamilyModel, Layout]:
    """This rank's model (built from its slices of the checkpoint) and its Layout."""
    layout = rank_layout(family, checkpoint, dtype, shard.world)
    if shard.world == 1:
        return family.load(checkpoint, dtype, device), layout
    parallel = family.tensor_parallel(checkpoint.config)
    return family.load(ShardedCheckpoint(checkpoint, parallel, shard), dtype, device, shard), layout
