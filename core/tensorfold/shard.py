"""Tensor parallelism as a family declares it (`family_tensor_parallel`) and as its model sees it (a Shard).

    TensorParallel  which checkpoint tensors are column-parallel (split along their output dim 0), row-parallel
                    (split along their input dim 1, the output summed across ranks) or replicated; which Layout
                    states split by head (and along which dim), every other state being whole on every rank; and
                    the counts that must divide the world (heads, KV heads, experts), named for refusals
    Shard           one rank's place in the world, handed to `family_load`: the family sizes its model by it and
                    calls `reduce` on each row-parallel output

A row-parallel output is summed in rank order (every rank gathers every part, then adds them 0, 1, …, N-1), never
by a collective whose order depends on the transport, so every rank holds the same bits and TP=N is the same run
to run (docs/architecture.md, "Tensor parallelism").
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

import attrs
import torch

from tensorfold.layout import LayerLayout, Layout

KINDS = ("column", "row", "replicated")


class RankLost(RuntimeError):
    """A rank of the tensor-parallel world stopped answering (died, or a collective timed out): the server stops."""


@attrs.frozen
class Split:
    """How checkpoint tensors whose name matches `pattern` (fnmatch, `*` crosses dots) are cut across ranks.

    `parts` names the sizes of a fused tensor's pieces along the cut dim (q, k, v stacked, say): each piece is cut
    on its own and the rank's slices are joined again, so every rank gets its heads of every piece. `axis` moves
    the cut off a Linear's own dims for a stacked tensor (experts fused as [N, 2F, E]: column along 1, row along
    -1); a 1-D tensor under a row rule stays whole either way."""

    pattern: str
    kind: str
    parts: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    axis: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Split {self.pattern!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def dim(self, tensor: torch.Tensor) -> int | None:
        """The dim this rule cuts `tensor` along, None when it is replicated (a row-parallel bias is whole)."""
        if self.kind == "replicated" or (self.kind == "row" and tensor.dim() < 2):
            return None
        if self.axis is not None:
            return self.axis % tensor.dim()
        return 0 if self.kind == "column" else 1


@attrs.frozen
class StateSplit:
    """A Layout state (row or fixed, by name; `kind` limits it to layers of that kind) held by head: each rank
    holds 1/N of dim `dim` of its declared shape.

    `parts`, as in Split, names the pieces lying side by side along `dim` (a conv tail's q, k and v channels): each
    piece is cut on its own, so each rank holds its heads of every piece, which `part` gives from a whole state."""

    name: str
    dim: int
    kind: str | None = None
    parts: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def pieces(self, size: int, world: int) -> tuple[int, ...] | None:
        """The pieces of a dim of `size`, None when they do not add up to it or one does not split in `world`."""
        parts = self.parts or (size,)
        return None if sum(parts) != size or any(p % world for p in parts) else parts

    def part(self, state: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s slice of a whole state (one stream's, of its declared shape); ValueError when it does not
        split."""
        parts = self.pieces(state.shape[self.dim], world)
        if parts is None:
            raise ValueError(f"state {self.name!r} of shape {tuple(state.shape)} (parts {list(self.parts)}) does "
                             f"not split in {world} along dim {self.dim}")
        return torch.cat([piece.chunk(world, self.dim)[rank] for piece in state.split(list(parts), self.dim)],
                         self.dim)


@attrs.frozen
class TensorParallel:
    """A family's answer to `family_tensor_parallel`: its tensors' and states' cuts and what must divide the world."""

    divides: Mapping[str, int] = attrs.field(converter=dict)   # "attention heads (num_attention_heads)" -> 16
    params: tuple[Split, ...] = attrs.field(converter=tuple)   # first match wins; a tensor matching none is refused
    states: tuple[StateSplit, ...] = attrs.field(default=(), converter=tuple)

    def refusals(self, world: int) -> list[str]:
        """One sentence per count `world` does not divide."""
        return [f"--tensor-parallel-size {world} does not divide the {what}, {count}"
                for what, count in self.divides.items() if count % world]

    def rule(self, name: str) -> Split | None:
        """The first rule whose pattern matches a checkpoint tensor's name."""
        return next((rule for rule in self.params if fnmatchcase(name, rule.pattern)), None)

    def part(self, name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s slice of a checkpoint tensor; ValueError naming the tensor when no rule or no cut fits."""
        rule = self.rule(name)
        if rule is None:
            raise ValueError(f"tensor {name} matches no rule of family_tensor_parallel: say whether it is column, "
                             "row or replicated")
        dim = rule.dim(tensor)
        if dim is None or world == 1:
            return tensor
        parts = rule.parts or (tensor.shape[dim],)
        if sum(parts) != tensor.shape[dim] or any(p % world for p in parts):
            raise ValueError(f"tensor {name} of shape {tuple(tensor.shape)} ({rule.kind}, parts {list(parts)}) "
                             f"does not split in {world} along dim {dim}")
        pieces = [piece.chunk(world, dim)[rank] for piece in tensor.split(list(parts), dim)]
        return torch.cat(pieces, dim).contiguous()

    def layout(self, layout: Layout, world: int) -> Layout:
        """One rank's Layout: every state split by head holds 1/world of its head dim, the others are whole."""
        layers = []
        for index, layer in enumerate(layout.layers):
            rows = [attrs.evolve(s, shape=self._cut(s.name, s.shape, layer.kind, world, index)) for s in layer.rows]
            fixed = [attrs.evolve(s, shape=self._cut(s.name, s.shape, layer.kind, world, index)) for s in layer.fixed]
            layers.append(LayerLayout(kind=layer.kind, rows=rows, fixed=fixed))
        return Layout(layers)

    def _cut(self, name: str, shape: tuple[int, ...], kind: str, world: int, index: int) -> tuple[int, ...]:
        rule = next((s for s in self.states if s.name == name and s.kind in (None, kind)), None)
        if rule is None or world == 1:
            return tuple(shape)
        if not -len(shape) <= rule.dim < len(shape) or rule.pieces(shape[rule.dim], world) is None:
            pieces = f" (parts {list(rule.parts)})" if rule.parts else ""
            raise ValueError(f"layer {index} ({kind}) state {name!r} of shape {tuple(shape)}{pieces} does not split "
                             f"in {world} along dim {rule.dim}")
        cut = list(shape)
        cut[rule.dim] //= world
        return tuple(cut)


@attrs.frozen
class Shard:
    """One rank's place in a tensor-parallel world, handed to family_load; world 1 is the plain single process."""

    rank: int = 0
    world: int = 1
    group: Any = attrs.field(default=None, eq=False, repr=False)   # the torch.distributed group of the reductions

    def split(self, count: int, what: str) -> int:
        """This rank's share of `count` (heads, experts, columns); ValueError naming `what` when it does not divide."""
        if count % self.world:
            raise ValueError(f"the tensor-parallel world of {self.world} does not divide {what} {count}")
        return count // self.world

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel output, added in rank order so every rank gets the same bits."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        try:
            torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        except Exception as err:
            raise RankLost(f"rank {self.rank} of {self.world}: a row-parallel reduction failed, a rank is gone "
                           f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''})"
                           ) from err
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total


SINGLE = Shard()

