"""Conformance checks any family runs in its own tests, with its own tiny-checkpoint maker.

Each check raises AssertionError with the numbers when the family breaks a contract, and returns what it
measured so a test can print it. The kit drives the family exactly as the engine does: StepPlans on the
absolute grid, memory through a KvStore (poisoned, so a read of an unwritten row shows up as NaN). `every_row` and
`greedy` drive a bare model the same way, for comparing it with a reference such as HF transformers.

A run compared only with itself proves nothing about a state that is wrong the same way every time (a conv tail
never updated, a float32 state rounded to bf16 between steps): resumed and fresh agree, both wrong. So every run the
resume checks (and the engine gates) take as the truth is itself held to a reference: the family's `oracle`
(every position's logits of a token sequence, e.g. HF transformers) when it gives one, else a one-shot pass
(the whole prompt in one step, then the same tokens fed one per step), within `tolerance`.
"""

from __future__ import annotations

import itertools
import unittest.mock
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Protocol

import attrs
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.engine.grid import grid_cuts
from tensorfold.family import Declarations, Family, FamilyModel
from tensorfold.image import StateImage, put_back, read_out
from tensorfold.kv import KvStore, PagedStore, WindowStore
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.settings import Settings

Oracle = Callable[[Sequence[int]], torch.Tensor]   # tokens -> float32 logits of every position [len(tokens), V]
# max-abs |Δlogit| a run may differ from its reference by when no tolerance is given, by the model's dtype; a dtype
# not named compares only when given a tolerance (bf16 chunking rounds differently, by a family's own measure)
REFERENCE_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-4}


@attrs.frozen
class Subject:
    """A family loaded on one checkpoint, ready to be driven."""

    family: Family
    checkpoint: Checkpoint
    declarations: Declarations
    model: FamilyModel
    dtype: torch.dtype
    device: torch.device

    def store(self, slots: int, capacity: int, page_rows: int | None = None) -> KvStore:
        """Fresh poisoned memory for `slots` streams of `capacity` rows: one window each, or pages of `page_rows`
        rows handed out in a scrambled order (so a family that assumes contiguous pages shows up)."""
        layout = self.declarations.layout
        if page_rows is None:
            return WindowStore(layout, slots, capacity, self.device, poison=True)
        per_slot = -(-capacity // page_rows)
        store = PagedStore(layout, slots, slots * per_slot, page_rows, self.device, poison=True)
        order = torch.randperm(slots * per_slot, generator=torch.Generator().manual_seed(slots * per_slot)).tolist()
        store.fill(order)
        for slot in range(slots):
            store.bind(slot, order[slot * per_slot: (slot + 1) * per_slot])
        return store


def load(family: Family, directory: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Subject:
    """Load a family on a checkpoint directory as the server would."""
    checkpoint = Checkpoint(directory)
    declarations = family.declare(checkpoint.config, dtype)
    model = family.load(checkpoint, dtype, torch.device(device))
    return Subject(family, checkpoint, declarations, model, dtype, torch.device(device))


def load_as_for_triton(family: Family, directory: Path, loader: ModuleType, dtype: torch.dtype = torch.float32
                       ) -> Subject:
    """`load` with the family's loader module told that Triton runs (its `use_triton` stood in): the weight layout
    a GPU load builds, checked on this device."""
    with unittest.mock.patch.object(loader, "use_triton", lambda tensor: True):
        return load(family, directory, dtype)


def prefill(subject: Subject, kv: KvStore, slot: int, tokens: Sequence[int], start: int, end: int,
            cuts: Sequence[int] | int) -> torch.Tensor:
    """Run rows [start, end) in pieces (a grid chunk size, or explicit cut positions); return the last logits."""
    bounds = list(grid_cuts(start, end, cuts)) if isinstance(cuts, int) else _pieces(start, end, cuts)
    logits = None
    for a, b in bounds:
        kv_step = StepPlan((StreamStep(slot, a, tuple(tokens[a:b]), sample=True),))
        logits = subject.model.forward(kv_step, kv)
    assert logits is not None, f"nothing to prefill in [{start}, {end})"
    return logits[0]


def decode(subject: Subject, kv: KvStore, slot: int, logits: torch.Tensor, position: int,
           steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode `steps` tokens from `logits` at `position`; return the tokens and every step's logits."""
    tokens, seen = [], [logits]
    for _ in range(steps):
        token = int(torch.argmax(logits))
        tokens.append(token)
        logits = subject.model.forward(StepPlan((StreamStep(slot, position, (token,)),)), kv)[0]
        seen.append(logits)
        position += 1
    return tokens, seen


def _pieces(start: int, end: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    points = [start] + [c for c in sorted(cuts) if start < c < end] + [end]
    return list(itertools.pairwise(points))


class EveryRowModel(FamilyModel, Protocol):
    """A model that also offers `forward_all(plan, kv)`: float32 logits for every row, for tests against a
    reference (the engine calls only `forward`)."""

    def forward_all(self, plan: StepPlan, kv: KvStore) -> torch.Tensor: ...


def every_row(model: EveryRowModel, kv: KvStore, tokens: Sequence[int], cuts: Sequence[int],
              slot: int = 0) -> torch.Tensor:
    """Logits of every position, the prompt run in pieces cut at `cuts`: [len(tokens), V]."""
    points = [0, *cuts, len(tokens)]
    pieces = [model.forward_all(StepPlan([StreamStep(slot, a, tokens[a:b])]), kv)
              for a, b in itertools.pairwise(points)]
    return torch.cat(pieces)


def greedy(model: FamilyModel, kv: KvStore, tokens: Sequence[int], steps: int, slot: int = 0) -> list[int]:
    """Prefill in one step, then decode one token per step, as the engine would: the `steps` greedy tokens."""
    logits = model.forward(StepPlan([StreamStep(slot, 0, tokens)]), kv)
    out: list[int] = []
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = model.forward(StepPlan([StreamStep(slot, len(tokens) + len(out) - 1, [out[-1]])]), kv)
    return out


class Recording:
    """A family model that keeps each sampled row's logits as it serves (one stream at a time), so an engine's
    reply can be held to a reference (`check_reference`); everything else is the model's own."""

    def __init__(self, inner: FamilyModel) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.rows: list[torch.Tensor] = []

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        out = self.inner.forward(plan, kv)
        row = 0
        for share in plan.streams:
            rows = getattr(share, "logit_rows", int(share.sample))
            if share.sample:
                self.rows.append(out[row + rows - 1].detach().float().cpu().clone())
            row += rows
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def reference_logits(subject: Subject, tokens: Sequence[int], fed: Sequence[int],
                     oracle: Oracle | None = None) -> torch.Tensor:
    """The logits of positions len(tokens) - 1 .. len(tokens) - 1 + len(fed) when `fed` follows the prompt:
    [len(fed) + 1, V] from the oracle, or from a one-shot pass (the prompt in one step, then `fed` one per step)."""
    if oracle is not None:
        every = oracle([*tokens, *fed]).float().cpu()
        assert every.shape[0] == len(tokens) + len(fed), (
            f"the oracle gave {every.shape[0]} rows for {len(tokens) + len(fed)} tokens")
        return every[len(tokens) - 1:]
    kv = subject.store(1, len(tokens) + len(fed) + 1)
    rows = [prefill(subject, kv, 0, tokens, 0, len(tokens), [])]
    for position, token in enumerate(fed, start=len(tokens)):
        rows.append(subject.model.forward(StepPlan((StreamStep(0, position, (token,)),)), kv)[0])
    return torch.stack(rows).float().cpu()


def check_reference(subject: Subject, tokens: Sequence[int], fed: Sequence[int], logits: torch.Tensor | Sequence,
                    oracle: Oracle | None = None, tolerance: float | None = None,
                    what: str = "the run") -> float | None:
    """A run's logits (after the prompt, then after each of `fed`) are the reference's within `tolerance`
    (default REFERENCE_TOLERANCE by dtype). Returns the largest difference, None when there is no tolerance."""
    if tolerance is None:
        tolerance = REFERENCE_TOLERANCE.get(subject.dtype)
    if tolerance is None:
        return None
    got = torch.stack(list(logits)) if not isinstance(logits, torch.Tensor) else logits
    got = got.float().cpu()
    want = reference_logits(subject, tokens, fed, oracle)
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} logits, the reference has {tuple(want.shape)}"
    gaps = (got - want).abs().amax(dim=-1)
    worst = float(gaps.max())
    if not worst <= tolerance:
        first = int((~(gaps <= tolerance)).nonzero()[0])
        source = "the oracle" if oracle is not None else "a one-shot pass"
        raise AssertionError(f"{what}: logits differ from {source} by {worst:.3e} > {tolerance:.1e}, first at "
                             f"position {len(tokens) - 1 + first} (a state kept wrong the same way on both sides?)")
    return worst


def check_declarations(family: Family, directory: Path, dtype: torch.dtype = torch.float32) -> Declarations:
    """The family's declarations are valid for its checkpoint, and its default settings are not refused."""
    checkpoint = Checkpoint(directory)
    assert checkpoint.model_type in family.model_types, (
        f"{family.name} does not serve its own checkpoint's model_type {checkpoint.model_type!r}")
    found = family.declare(checkpoint.config, dtype)
    assert found.layout.fixed_bytes + found.layout.bytes_per_token > 0, "the Layout declares no memory at all"
    assert found.identity, "family_identity declares no facts"
    refusals = family.refusals(checkpoint.config, Settings(family=family.name, context=256))
    assert refusals == [], f"the family refuses its own tiny checkpoint: {refusals}"
    return found


def check_resume_bitwise(subject: Subject, tokens: Sequence[int], at: int, chunk: int, steps: int = 8,
                         oracle: Oracle | None = None, tolerance: float | None = None) -> int:
    """State read out at `at` → image bytes → put back in another slot → continue is bit-identical to not
    stopping; the restored state's image is byte-equal to the kept one; and the run that did not stop is the
    reference's (`check_reference`: the oracle, else a one-shot pass). Returns the image's size in bytes."""
    assert 0 < at < len(tokens), f"at={at} must fall inside the {len(tokens)}-token prompt"
    capacity = len(tokens) + steps + 1
    kv = subject.store(2, capacity)
    fmt = subject.declarations.image
    prefill(subject, kv, 0, tokens, 0, at, chunk)
    kept = read_out(kv, 0, at, fmt)
    data = kept.to_bytes()
    put_back(kv, 1, StateImage.from_bytes(data), fmt)
    restored = read_out(kv, 1, at, fmt)
    assert restored.to_bytes() == data, "the restored state's image differs from the kept one"
    runs = []
    for slot in (0, 1):
        logits = prefill(subject, kv, slot, tokens, at, len(tokens), chunk)
        runs.append(decode(subject, kv, slot, logits, len(tokens), steps))
    (fresh_tokens, fresh_logits), (resumed_tokens, resumed_logits) = runs
    assert resumed_tokens == fresh_tokens, f"resumed tokens {resumed_tokens} != fresh {fresh_tokens}"
    for step, (a, b) in enumerate(zip(fresh_logits, resumed_logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: resumed logits differ from fresh by {(a - b).abs().max():.3e}"
    check_reference(subject, tokens, fresh_tokens, fresh_logits, oracle, tolerance,
                    f"the run kept at {at} (chunks of {chunk})")
    layout = subject.declarations.layout
    assert len(kept.own) + len(kept.rows) == layout.stream_bytes(at), (
        f"kept bytes {len(kept.own) + len(kept.rows)} != Layout's {layout.stream_bytes(at)} at {at} rows")
    return len(data)


def check_chunked(subject: Subject, tokens: Sequence[int], cuts: Sequence[int], tolerance: float,
                  steps: int = 8, oracle: Oracle | None = None) -> float:
    """Prefill cut at `cuts` vs one shot: final logits within `tolerance` (max-abs) and the same greedy tokens;
    with an `oracle`, the one-shot run is its within `tolerance` too. Returns the largest difference seen."""
    kv = subject.store(2, len(tokens) + steps + 1)
    one = prefill(subject, kv, 0, tokens, 0, len(tokens), [])
    cut = prefill(subject, kv, 1, tokens, 0, len(tokens), cuts)
    one_tokens, one_logits = decode(subject, kv, 0, one, len(tokens), steps)
    cut_tokens, cut_logits = decode(subject, kv, 1, cut, len(tokens), steps)
    worst = max(float((a - b).abs().max()) for a, b in zip(one_logits, cut_logits, strict=True))
    assert torch.isfinite(one).all(), "one-shot logits are not finite"
    assert worst <= tolerance, f"chunked vs one-shot differ by {worst:.3e} > {tolerance:.1e}"
    assert cut_tokens == one_tokens, f"chunked tokens {cut_tokens} != one-shot {one_tokens}"
    if oracle is not None:
        check_reference(subject, tokens, one_tokens, one_logits, oracle, tolerance, "the one-shot run")
    return worst


def check_paged(subject: Subject, tokens: Sequence[int], page_rows: int, chunk: int, steps: int = 8) -> None:
    """Rows in scrambled pages give bit-identical logits to one contiguous window."""
    capacity = len(tokens) + steps + 1
    runs = []
    for store in (subject.store(1, capacity), subject.store(1, capacity, page_rows=page_rows)):
        logits = prefill(subject, store, 0, tokens, 0, len(tokens), chunk)
        runs.append(decode(subject, store, 0, logits, len(tokens), steps))
    (window_tokens, window_logits), (paged_tokens, paged_logits) = runs
    assert paged_tokens == window_tokens, f"paged tokens {paged_tokens} != window {window_tokens}"
    for step, (a, b) in enumerate(zip(window_logits, paged_logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: paged logits differ from window by {(a - b).abs().max():.3e}"


def check_batch_invariance(subject: Subject, tokens: Sequence[int], sizes: Sequence[int] = (1, 2, 4, 8, 16),
                           page_rows: int = 16) -> None:
    """One stream's logits are bitwise the same alone and inside steps of 1..16 streams at varied positions,
    some decoding one row, some prefilling a chunk."""
    largest = max(sizes)
    capacity = len(tokens) + 2
    starts = [(7 * i + 3) % (len(tokens) - 9) + 1 for i in range(largest)]
    for size in sizes:
        alone, batched = (subject.store(largest, capacity, page_rows=page_rows) for _ in range(2))
        for store in (alone, batched):
            for slot in range(size):
                prefill(subject, store, slot, tokens, 0, starts[slot], [])
        target = StreamStep(0, starts[0], tuple(tokens[starts[0]: starts[0] + 1]), sample=True)
        others = [StreamStep(slot, starts[slot], tuple(tokens[starts[slot]: starts[slot] + 1 + (slot % 3) * 4]),
                             sample=slot % 2 == 0) for slot in range(1, size)]
        half = len(others) // 2
        plan = StepPlan((*others[:half], target, *others[half:]))
        solo = subject.model.forward(StepPlan((target,)), alone)[0]
        row = sum(1 for share in others[:half] if share.sample)
        mixed = subject.model.forward(plan, batched)[row]
        assert torch.equal(solo, mixed), (
            f"with {size} streams in the step, stream 0's logits differ from alone by {(solo - mixed).abs().max():.3e}")
