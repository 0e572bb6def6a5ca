"""Repetition, frequency and presence penalties for the rows of a step that ask for them, in the batched pass.

    repetition  r: a token seen in the prompt or the output so far has its logit divided by r when positive,
                multiplied by r otherwise (vLLM's and HF's rule; 1 is off)
    frequency   f: minus f times the token's count in the output so far
    presence    p: minus p for a token the output holds at least once
Applied in that order (vLLM's), after logit_bias and min_tokens and before the grammar's mask; each row's arithmetic
is elementwise on its own logits and counts, so a penalised row never changes a neighbour and stays batch-invariant.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


@attrs.frozen
class Penalties:
    """The penalised rows of a step: their index among the drawn rows, their three values, each row's output counts
    (a [V] tensor a stream keeps up to date on the device, Stream.output_counts, or the output's token ids) and
    its prompt's distinct token ids (empty without a repetition penalty; a stream keeps them on the device once,
    Stream.prompt_distinct). A step costs O(rows × V) on the device, never O(tokens produced) on the host."""

    index: tuple[int, ...]
    values: tuple[tuple[float, float, float], ...]  # (repetition, frequency, presence) per row
    counts: tuple[torch.Tensor | Sequence[int], ...]  # per row: float32 [V] counts, or the output's ids
    prompts: tuple[torch.Tensor, ...]  # int64 [M_k] per row

    @classmethod
    def of(cls, index: Sequence[int], values: Sequence[tuple[float, float, float]],
           counts: Sequence[torch.Tensor | Sequence[int]], prompts: Sequence[Sequence[int] | torch.Tensor]
           ) -> Penalties:
        """From each penalised row's output counts (or ids) and its prompt's distinct tokens (empty without
        repetition)."""
        return cls(tuple(index), tuple(values), tuple(counts),
                   tuple(torch.as_tensor(ids, dtype=torch.int64) for ids in prompts))


def count_rows(counts: Sequence[torch.Tensor | Sequence[int]], vocab: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """[K, V] counts in `dtype`: a count tensor as it is, a list of ids counted here."""
    rows = [c.to(device, dtype) if isinstance(c, torch.Tensor) else
            torch.bincount(torch.as_tensor(list(c), dtype=torch.int64), minlength=vocab).to(device, dtype)
            for c in counts]
    return torch.stack(rows) if rows else torch.zeros(0, vocab, dtype=dtype, device=device)


def penalize(out: torch.Tensor, penalties: Penalties) -> None:
    """Apply the penalties to their rows of `out` [B, V], in place (out is the pass's own copy)."""
    device, pinned = out.device, out.device.type == "cuda"
    rows_at = torch.tensor(penalties.index, dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=pinned)
    values = torch.tensor(penalties.values, dtype=out.dtype, pin_memory=pinned).to(device, non_blocking=pinned)
    sub = out.index_select(0, rows_at)
    counts = count_rows(penalties.counts, out.shape[1], out.dtype, device)
    if any(repetition != 1.0 for repetition, _, _ in penalties.values):
        seen = counts > 0
        for k, ids in enumerate(penalties.prompts):
            if ids.numel():
                seen[k, ids.to(device, non_blocking=pinned)] = True
        repetition = values[:, 0:1]
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - values[:, 1:2] * counts - values[:, 2:3] * (counts > 0).to(out.dtype)
    out.index_copy_(0, rows_at, sub)
