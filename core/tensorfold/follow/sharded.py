"""A checkpoint as one rank reads it: every tensor cut by the family's TensorParallel rules."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.shard import Shard, TensorParallel


class ShardedCheckpoint(Checkpoint):
    """The same config and names; `tensor` and `tensors` give this rank's slice of each of the base's tensors (the base
    a directory's Checkpoint, or any reader with its `config`, `names`, `tensor` and `tensors`)."""

    def __init__(self, base: Checkpoint, parallel: TensorParallel, shard: Shard) -> None:
        self.__dict__.update(base.__dict__)
        self.base = base
        self.parallel = parallel
        self.shard = shard

    def names(self) -> list[str]:
        return self.base.names()

    def tensor(self, name: str) -> torch.Tensor:
        """This rank's slice of one tensor."""
        return self.parallel.part(name, self.base.tensor(name), self.shard.rank, self.shard.world)

    def tensors(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slice of every tensor, in the base's order."""
        for name, tensor in self.base.tensors(progress):
            yield name, self.parallel.part(name, tensor, self.shard.rank, self.shard.world)

    def elements(self, name: str, shape: tuple[int, ...]) -> int:
        """The elements of this rank's slice (every rank's is the same size); a tensor no rule matches counts
        whole (loading it is refused by name)."""
        rule = self.parallel.rule(name)
        cut = rule is not None and self.shard.world > 1 and rule.dim(torch.empty(shape, device="meta")) is not None
        return math.prod(shape) // (self.shard.world if cut else 1)
