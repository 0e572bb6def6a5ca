"""The (row, j) pairs of a routed-experts call grouped by expert: the value triton_moe's kernels read, and the
bound on its blocks that makes every launch size static."""

from __future__ import annotations

import attrs
import torch
import triton


@attrs.frozen
class Alignment:
    """The pairs grouped by expert on the device; every shape here is a static bound, none read from data."""

    expert: torch.Tensor          # [P] int32 (ordered: the caller's int64), pair t·k + j's expert (N where out of
                                  # range), j in expert order
    weight: torch.Tensor          # [P] the weights' dtype (x's, or float32 for a float32 sum), the pair's
                                  # routing weight
    row_pair: torch.Tensor        # [blocks · BLOCK_M] int32, the pair at each padded row (P where none)
    block_expert: torch.Tensor    # [blocks] int32 (or `expert` itself, one block per pair), the expert of each
                                  # block (N where unused)


def blocks_bound(P: int, N: int, block_m: int) -> int:
    """Blocks enough for any routing: P pairs plus at most BLOCK_M − 1 padding rows per used expert."""
    return triton.cdiv(P + min(N, P) * (block_m - 1), block_m)
