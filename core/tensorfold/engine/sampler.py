"""Token sampling for a whole step: one pass over its [B, V] logits on their device, one copy of B ids back.

    greedy     temperature 0: the argmax of the logits (ties: the lowest id, as torch.argmax)
    sampled    the argmax of x + Gumbel noise over the kept tokens, x = (logits - max) / temperature in float64:
               exactly a draw from softmax(x) over them; the noise is counter-based (engine/noise.py), keyed by the
               request's seed and the token's index, so a row's token depends on its logits, parameters, seed and
               index alone, never on the other rows or the batch size; an unseeded request draws a seed at admission
    the rule   every filter keeps the most likely token, so any parameters form a distribution: each keeps
               x >= a threshold per row; top_k the k largest (ties kept), top_p the smallest most-likely-first set
               whose mass reaches top_p, read on what top_k kept (at least the first token, so a top_p that rounds
               to 0 samples the most likely one, as vLLM and HF do; ties with its last kept), min_p the tokens of at
               least min_p (at most 1) times the top probability; a temperature so small that x overflows sends
               the other tokens to -inf (the same limit), one so large makes x all but 0
    adjusted   before anything else, a request's logit_bias is added to its row and, while its token number is
               below min_tokens, its stop tokens are set to -inf (vLLM's order), then the tokens its grammar does
               not allow are set to -inf (`Allowed`, engine/grammar.py); with none of these in a step, nothing is
               copied, and only the rows with a grammar are unpacked and masked
    refused    logits holding NaN or +inf, or all -inf (a masked row), come back as -1: the engine fails that
               request alone (`refused` says why); -inf for some tokens is a mask and is sampled around
Every operation is per row: elementwise, or a reduction along V that each row does alone (argmax, sort, cumsum,
gather, a count of booleans); none is a float sum whose order follows the batch (torch splits a lone row's sum
across threads), which tests/core/engine/test_sampler_batch.py checks at several batch sizes.
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Sequence

import attrs
import torch

from tensorfold.engine import noise
from tensorfold.engine.api import Sampling
from tensorfold.engine.grammar import mask_words
from tensorfold.engine.penalties import Penalties, penalize

TOP_K_OFF_ABOVE = 1 << 31  # a top_k this large keeps every token of any vocabulary


class NonFiniteLogits(ValueError):
    """The model's logits for one stream cannot be sampled from; the message says what they hold."""


@attrs.frozen
class Allowed:
    """The sampled rows of a step that a grammar constrains: their index among the rows, and their allowed-token
    bitmasks, filled on the host (pinned for a CUDA step, so their copy does not wait for the device's queue)."""

    index: tuple[int, ...]
    bits: torch.Tensor  # int32 [len(index), mask_words(V)]

    @classmethod
    def empty(cls, index: Sequence[int], vocab: int, device: torch.device) -> Allowed:
        """Rows to fill, one per index, for logits of `vocab` tokens on `device`."""
        bits = torch.zeros((len(index), mask_words(vocab)), dtype=torch.int32, pin_memory=device.type == "cuda")
        return cls(tuple(index), bits)


@attrs.frozen
class SampleRow:
    """One stream's sampling parameters as the batched pass reads them, resolved once at admission."""

    temperature: float
    top_p: float
    log_min_p: float  # log(min(min_p, 1)); -inf when min_p is off
    top_k: int        # 0: off
    root: int         # the seed's root word (engine/noise.py), as int64
    bias: tuple[tuple[int, float], ...] = ()  # logit_bias: (token id, added), each id once
    min_tokens: int = 0
    stops: tuple[int, ...] = ()  # the stop tokens min_tokens holds back
    penalties: tuple[float, float, float] = (1.0, 0.0, 0.0)  # repetition, frequency, presence (penalties.py)
    logprobs: int | None = None  # top logprobs to return with each token (None: no logprobs)

    @classmethod
    def of(cls, sampling: Sampling, unseeded: random.Random | None = None) -> SampleRow:
        """The row for a request: its parameters checked, its seed turned into its root. A request without one
        draws it from `unseeded` (serve's --seed) or, without that, from the OS."""
        check(sampling)
        if sampling.seed is not None:
            seed = sampling.seed
        else:
            seed = unseeded.getrandbits(64) if unseeded is not None else secrets.randbits(64)
        min_p = min(sampling.min_p, 1.0)
        return cls(temperature=sampling.temperature, top_p=sampling.top_p,
                   log_min_p=math.log(min_p) if min_p > 0 else -math.inf,
                   top_k=min(max(sampling.top_k, 0), TOP_K_OFF_ABOVE), root=noise.root(seed),
                   bias=tuple(sampling.logit_bias), min_tokens=max(sampling.min_tokens, 0),
                   stops=tuple(sampling.stop_token_ids),
                   penalties=(sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty),
                   logprobs=sampling.logprobs)

    def adjustments(self, counter: int) -> list[tuple[int, float, bool]]:
        """(token, value, added) for this row at token number `counter`: its bias (added), then its stop tokens
        set to -inf (not added) while counter < min_tokens."""
        held = [(token, -math.inf, False) for token in self.stops] if counter < self.min_tokens else []
        return [(token, value, True) for token, value in self.bias] + held

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on: its token depends on the output so far."""
        return self.penalties != (1.0, 0.0, 0.0)

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax, no draw."""
        return self.temperature == 0.0

    @property
    def sorts(self) -> bool:
        """Whether a filter needs the row sorted (top_k or top_p)."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def values(self) -> tuple[float, float, float, float]:
        """The float parameters in the order the pass unpacks them."""
        return (self.temperature, self.top_p, self.log_min_p, float(self.top_k))


class Sampler:
    """Draws every sampling row of a step at once; holds only the per-vocabulary counters it reuses."""

    def __init__(self) -> None:
        self._positions: dict[tuple[torch.device, int], torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow], counters: Sequence[int],
               allowed: Allowed | None = None, penalties: Penalties | None = None) -> list[int]:
        """Token ids for logits [B, V], row i drawn with rows[i] as its token number counters[i] and, for the rows
        `allowed` names, among the tokens its mask allows; -1 for a row whose logits hold NaN or +inf, or only -inf
        once adjusted. One device->host copy (and small host->device copies of the sampled rows' parameters when
        any row samples, and of the masks when any row has one)."""
        return self.draw(logits, rows, counters, allowed, penalties).tolist()

    def draw(self, logits: torch.Tensor, rows: Sequence[SampleRow], counters: Sequence[int],
             allowed: Allowed | None = None, penalties: Penalties | None = None) -> torch.Tensor:
        """`sample`'s ids left on the logits' device, int64 [B]: nothing waits for the device, so the step loop
        can prepare the next step while this one runs (engine/ahead.py)."""
        logits = adjusted(logits, rows, counters, allowed, penalties)
        best = logits.argmax(dim=-1)
        top = logits.gather(1, best[:, None]).squeeze(1)
        drawn = [i for i, row in enumerate(rows) if not row.greedy]
        if drawn:
            packed = self._pack([rows[i] for i in drawn], [counters[i] for i in drawn], drawn, logits.device)
            index = packed[:, 5]
            whole = len(drawn) == len(rows)
            subset = logits if whole else logits.index_select(0, index)
            picked = self._draw(subset, top if whole else top.index_select(0, index), packed,
                                any(rows[i].sorts for i in drawn))
            best = picked if whole else best.index_copy(0, index, picked)
        return torch.where(torch.isfinite(top), best, -1)

    def _pack(self, rows: Sequence[SampleRow], counters: Sequence[int], index: Sequence[int],
              device: torch.device) -> torch.Tensor:
        """The sampled rows' parameters as int64 [R, 6]: 4 float64 words, the noise key, the row in the step."""
        pinned = device.type == "cuda"  # a pinned source copies without waiting for the device's queue
        host = torch.empty((len(rows), 6), dtype=torch.int64, pin_memory=pinned)
        host[:, :4] = torch.tensor([row.values for row in rows], dtype=torch.float64).view(torch.int64)
        host[:, 4] = noise.keys(torch.tensor([row.root for row in rows], dtype=torch.int64),
                                torch.tensor(counters, dtype=torch.int64))
        host[:, 5] = torch.tensor(index, dtype=torch.int64)
        return host.to(device, non_blocking=pinned)

    def _draw(self, logits: torch.Tensor, top: torch.Tensor, packed: torch.Tensor, sorts: bool) -> torch.Tensor:
        """Each row's token: the argmax of its kept x plus its Gumbel noise."""
        x = filtered(logits, top, packed[:, :4].view(torch.float64), sorts)
        x.add_(noise.gumbel(packed[:, 4], self._at(logits.shape[1], logits.device)))
        return x.argmax(dim=-1)

    def _at(self, vocab: int, device: torch.device) -> torch.Tensor:
        at = self._positions.get((device, vocab))
        if at is None:
            at = self._positions[(device, vocab)] = noise.positions(vocab, device)
        return at


def adjusted(logits: torch.Tensor, rows: Sequence[SampleRow], counters: Sequence[int],
             allowed: Allowed | None = None, penalties: Penalties | None = None) -> torch.Tensor:
    """The logits with each row's logit_bias added, its held-back stop tokens at -inf and, for the rows `allowed`
    names, the tokens its grammar does not allow at -inf: a copy, made only when some row has any of these (small
    host->device copies of the entries and masks, split on the host: no device sync)."""
    entries = [(i, *entry) for i, (row, counter) in enumerate(zip(rows, counters, strict=True))
               for entry in row.adjustments(counter)]
    if not entries and allowed is None and penalties is None:
        return logits
    out = logits.clone()
    pinned = logits.device.type == "cuda"
    if entries:
        entries.sort(key=lambda entry: not entry[3])           # the added ones first
        split = sum(1 for entry in entries if entry[3])
        index = torch.tensor([(i, token) for i, token, _, _ in entries], dtype=torch.int64,
                             pin_memory=pinned).to(logits.device, non_blocking=pinned)
        values = torch.tensor([value for _, _, value, _ in entries], dtype=logits.dtype,
                              pin_memory=pinned).to(logits.device, non_blocking=pinned)
        out.index_put_((index[:split, 0], index[:split, 1]), values[:split], accumulate=True)
        out.index_put_((index[split:, 0], index[split:, 1]), values[split:])
    if penalties is not None:
        penalize(out, penalties)
    if allowed is not None:
        rows_at = torch.tensor(allowed.index, dtype=torch.int64, pin_memory=pinned).to(logits.device,
                                                                                       non_blocking=pinned)
        keep = unpacked(allowed.bits.to(logits.device, non_blocking=pinned), logits.shape[1])
        out.index_copy_(0, rows_at, torch.where(keep, out.index_select(0, rows_at), -math.inf))
    return out


def unpacked(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Allowed-token bitmasks int32 [R, mask_words(vocab)] as booleans [R, vocab], on their device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab].bool()


def scaled(logits: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """x = (logits - max) / temperature per row, float64: the top token's x is 0, none overflows to NaN."""
    return (logits.double() - top.double()[:, None]) / temperature[:, None]


def filtered(logits: torch.Tensor, top: torch.Tensor, params: torch.Tensor, sorts: bool) -> torch.Tensor:
    """x per row with the tokens the filters drop at -inf, float64 [R, V]; params float64 [R, 4] are
    SampleRow.values (temperature > 0); `sorts` when any row has top_k or top_p."""
    temperature, top_p, log_min_p, top_k = params.unbind(1)
    x = scaled(logits, top, temperature)
    threshold = log_min_p
    if sorts:
        threshold = torch.maximum(threshold, _cut(logits, top, temperature, top_p, top_k))
    return x.masked_fill_(x < threshold[:, None], -math.inf)


def _cut(logits: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
         top_k: torch.Tensor) -> torch.Tensor:
    """The smallest x that top_k and top_p keep, per row [R] (the top token's x, 0, at most)."""
    ordered = scaled(logits.sort(dim=-1, descending=True).values, top, temperature)
    vocab = ordered.shape[1]
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    kth = ordered.gather(1, (k - 1)[:, None])
    mass = ordered.exp().masked_fill_(ordered < kth, 0.0)
    total = mass.cumsum(dim=-1)
    before = mass  # the mass strictly before each position, in the same buffer
    before[:, 1:] = total[:, :-1]
    before[:, 0] = 0.0
    inside = (before < top_p[:, None] * total[:, -1:]).sum(dim=-1).clamp_(min=1)
    edge = ordered.gather(1, (inside - 1)[:, None]).squeeze(1)
    edge = torch.where(top_p < 1.0, edge, -math.inf)
    return torch.maximum(kth.squeeze(1), edge)


def probabilities(logits: torch.Tensor, row: SampleRow, counter: int = 0,
                  bits: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution one row of logits [V] is drawn from at token number `counter`, among the tokens the
    bitmask `bits` [mask_words(V)] allows if given, float64 [V] (the pass never forms it; tests read the rule
    here). Greedy: all on the argmax."""
    allowed = None if bits is None else Allowed((0,), bits[None])
    logits = adjusted(logits[None], [row], [counter], allowed)[0]
    if row.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    rows = logits[None]
    top = rows.amax(dim=-1)
    params = torch.tensor([row.values], dtype=torch.float64, device=logits.device)
    return torch.softmax(filtered(rows, top, params, row.sorts), dim=-1)[0]


def refused(logits: torch.Tensor, constrained: bool = False) -> NonFiniteLogits:
    """Why a row the pass gave -1 cannot be sampled, as the error that fails its request (reads the row back);
    `constrained`: the row had a grammar's mask, which with finite logits is what left nothing to sample."""
    top = float(logits.max())
    if constrained and bool(torch.isfinite(logits).all()):
        return NonFiniteLogits("no token the grammar allows can be sampled (logit_bias or min_tokens hold back "
                               "every one)")
    if math.isnan(top):
        what = f"NaN for {int(torch.isnan(logits).sum())} of {logits.numel()} tokens"
    elif top > 0:
        what = f"+inf for {int(torch.isposinf(logits).sum())} of {logits.numel()} tokens"
    else:
        what = f"-inf for all {logits.numel()} tokens"
    return NonFiniteLogits(f"the model's logits hold {what}")


def check(sampling: Sampling) -> None:
    """Parameters no rule can read (the server refuses them first; this guards other callers): ValueError."""
    for name in ("temperature", "top_p", "min_p"):
        value = getattr(sampling, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"sampling {name} must be a finite number of at least 0, got {value!r}")


def logprobs_of(logits: torch.Tensor, index: Sequence[int], tokens: Sequence[int],
                tops: Sequence[int]) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """For rows `index` of the model's raw logits [B, V]: the log-probability of each row's sampled token and its
    `tops[k]` most likely tokens (id, logprob), best first; one device->host copy. vLLM's default (raw_logprobs):
    before bias, penalties, masks and temperature."""
    rows_at = torch.tensor(index, dtype=torch.int64, device=logits.device)
    lp = logits.index_select(0, rows_at).double().log_softmax(dim=-1)
    chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device).clamp_min(0)
    picked = lp.gather(1, chosen[:, None]).squeeze(1)
    k = max(tops)
    best = lp.topk(k, dim=-1) if k > 0 else None
    host = picked.tolist()
    if best is None:
        return [(value, ()) for value in host]
    values, ids = best.values.tolist(), best.indices.tolist()
    return [(host[r], tuple(zip(ids[r][:tops[r]], values[r][:tops[r]], strict=True))) for r in range(len(index))]
