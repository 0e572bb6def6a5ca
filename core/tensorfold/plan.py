"""The frozen step plan: everything a family's forward receives for one step, built by the scheduler."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch


@attrs.frozen
class StreamStep:
    """One stream's share of a step: its tokens at absolute positions [start, start + len(tokens)). With `sample`
    the forward returns its last row's logits; with `every_row`, every row's (a prompt's logprobs), the last being
    the one sampled from when it samples."""

    slot: int
    start: int
    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    sample: bool = True
    every_row: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a StreamStep needs at least one token")
        if self.start < 0 or self.slot < 0:
            raise ValueError(f"start {self.start} and slot {self.slot} must be >= 0")

    @property
    def end(self) -> int:
        """The absolute position after this step's last row."""
        return self.start + len(self.tokens)

    @property
    def logit_rows(self) -> int:
        """Logit rows the forward returns for this share: all its rows, its last, or none."""
        return len(self.tokens) if self.every_row else int(self.sample)


def share_logits(share: StreamStep, hidden: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]
                 ) -> list[torch.Tensor]:
    """A share's logit rows from its hidden rows [T, E], as a per-stream forward returns them: none, its last row,
    or with every_row the rows before the last, then the last apart, so the sampled row is computed as it is
    without every_row (bitwise)."""
    picked = []
    if share.every_row and len(share.tokens) > 1:
        picked.append(logits(hidden[:-1]))
    if share.every_row or share.sample:
        picked.append(logits(hidden[-1:]))
    return picked


@attrs.frozen
class StepPlan:
    """The streams of one step; the forward returns each share's logit rows (StreamStep.logit_rows), in this order."""

    streams: tuple[StreamStep, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        slots = [s.slot for s in self.streams]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a step holds one share per slot, got slots {slots}")

    @property
    def rows(self) -> int:
        """Token rows in this step."""
        return sum(len(s.tokens) for s in self.streams)

    @property
    def sampled(self) -> int:
        """How many streams sample."""
        return sum(1 for s in self.streams if s.sample)

    @property
    def logit_rows(self) -> int:
        """How many logit rows the forward returns: `sampled` unless a share asks for every row."""
        return sum(s.logit_rows for s in self.streams)

    @property
    def every_row(self) -> bool:
        """Whether a share asks for every row's logits."""
        return any(s.every_row for s in self.streams)


@attrs.frozen
class DecodeBatch:
    """One token for each of B streams as device tensors: what a family's optional `decode` takes, so a decode
    step needs no host sync and a CUDA graph can capture it. A row with slot -1 is padding (a captured batch
    larger than the streams in it): the family writes no state for it and its logits are never read."""

    tokens: torch.Tensor        # [B] int64
    positions: torch.Tensor     # [B] int64, the absolute position of each token
    slots: torch.Tensor         # [B] int64, -1 for a padded row
    tables: torch.Tensor        # [B, W] int32 page tables (any valid page id past a stream's pages and for pads)

    @property
    def live(self) -> torch.Tensor:
        """[B] bool: the rows that belong to a stream."""
        return self.slots >= 0

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int32: keys each row attends to (position + 1), 0 for a padded row."""
        return torch.where(self.live, self.positions + 1, 0).to(torch.int32)
