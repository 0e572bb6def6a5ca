"""Prompt logprobs (Sampling.prompt_logprobs; the completions API's `echo` with `logprobs`): a share with
`every_row` gets every row's logits back from the forward; row p scores the prompt token at p + 1. A stream gathers
its entries chunk by chunk and its request gets them in one PromptEvent when its prefill ends, before its first
token. The step's draw then sees only the sampled rows, as in a step without them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorfold.engine.api import PromptEvent
from tensorfold.engine.sampler import logprobs_of
from tensorfold.plan import StepPlan, StreamStep

ROWS_AT_ONCE = 256  # rows scored per log_softmax (in float64: rows × vocab × 8 bytes at a time)
Entry = tuple[int, float | None, tuple[tuple[int, float], ...]]


def sampled_rows(plan: StepPlan) -> list[int]:
    """The logit row of each share that samples (its last), among the forward's plan.logit_rows."""
    rows, at = [], 0
    for share in plan.streams:
        at += share.logit_rows
        if share.sample:
            rows.append(at - 1)
    return rows


def first_rows(plan: StepPlan) -> list[int]:
    """Each share's first logit row among the forward's (meaningful for those with every_row)."""
    rows, at = [], 0
    for share in plan.streams:
        rows.append(at)
        at += share.logit_rows
    return rows


def entries_of(logits: torch.Tensor, first: int, share: StreamStep, prompt: Sequence[int], top: int) -> list[Entry]:
    """The entries this share scores: the prompt tokens at [start + 1, min(end + 1, prompt length)), each from the
    row before it, with its `top` most likely tokens."""
    targets = list(prompt[share.start + 1:min(share.end + 1, len(prompt))])
    found: list[Entry] = []
    for at in range(0, len(targets), ROWS_AT_ONCE):
        tokens = targets[at:at + ROWS_AT_ONCE]
        rows = range(first + at, first + at + len(tokens))
        scored = logprobs_of(logits, list(rows), tokens, [top] * len(tokens))
        found += [(token, logprob, best) for token, (logprob, best) in zip(tokens, scored, strict=True)]
    return found


def prompt_event(prompt: Sequence[int], entries: list[Entry]) -> PromptEvent:
    """The whole prompt's entries: its first token (no logprob), then those gathered."""
    return PromptEvent(((prompt[0], None, ()), *entries))
