"""A running stream: its request, what it holds, and how far it has got."""

from __future__ import annotations

import attrs
import torch

from tensorfold.engine.api import Request
from tensorfold.engine.sampler import SampleRow
from tensorfold.memory import Claim


@attrs.define
class Stream:
    """One admitted request; `position` is the rows fed so far, `pending` the token to feed next in decode,
    `cuts` where its prefill is cut (cuts.py, planned once at admission), `cached` the prompt rows it
    resumed from a kept state instead of prefilling, `sample_row` its sampling parameters and seed as the step's
    batched sampling reads them (engine/sampler.py), `keep_at` the cuts after which its state is kept, with the
    reasons (tiers/policy.py); `ended` once the engine has released it and sent its last event (never twice);
    `forks` the streams of its request's forks, each holding its claim, until its prefill ends (engine/forks.py)."""

    request: Request
    claim: Claim
    sample_row: SampleRow
    cuts: tuple[int, ...] = ()
    position: int = 0
    produced: int = 0
    pending: int | None = None
    cached: int = 0
    keep_at: dict[int, frozenset[str]] = attrs.field(factory=dict)
    ended: bool = False
    outputs: list[int] = attrs.field(factory=list)  # the tokens sampled so far (penalties read them)
    _distinct: torch.Tensor | None = None           # the prompt's distinct tokens, once a repetition penalty asks
    _counts: torch.Tensor | None = None             # float32 [V] counts of `outputs[:_counted]`, once a penalty asks
    _counted: int = 0
    forks: list[Stream] = attrs.field(factory=list)  # not running yet: they start where its prefill ends
    prompt_entries: list = attrs.field(factory=list)  # prompt logprobs so far (engine/prompt_logprobs.py)

    def prompt_distinct(self, device: torch.device) -> torch.Tensor:
        """The prompt's distinct token ids on `device` (for a repetition penalty), worked out and copied once."""
        if self._distinct is None or self._distinct.device != device:
            self._distinct = torch.tensor(sorted(set(self.request.prompt)), dtype=torch.int64, device=device)
        return self._distinct

    def output_counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        """How often each token is in the output so far, float32 [V] on `device`: kept there and brought up to date
        with the tokens sampled since the last call (one small copy a step, however long the output)."""
        if self._counts is None or self._counts.device != device:
            self._counts, self._counted = torch.zeros(vocab, dtype=torch.float32, device=device), 0
        new = self.outputs[self._counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.int64).to(device)
            self._counts.index_put_((ids,), torch.ones(len(new), dtype=torch.float32, device=device), accumulate=True)
            self._counted = len(self.outputs)
        return self._counts

    @property
    def prompt_len(self) -> int:
        """Rows of the prompt."""
        return len(self.request.prompt)

    @property
    def prefilling(self) -> bool:
        """Still feeding prompt rows."""
        return self.position < self.prompt_len
