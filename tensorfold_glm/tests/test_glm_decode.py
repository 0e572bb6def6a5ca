"""The tensor-only decode step (decode.py, mla_decode.py) on the CPU against the per-stream path (`hidden`, one
stream at a time: glm_decode_cases.per_stream, what `forward` runs for a chunk), on paged stores (and a window store:
one page per slot).

- A stream decoded in a batch of one: every state the per-stream path writes up to and including the first MLA
  layer's latent, pooled key and pool tail is the same bits, fp32 and bf16 (the same ops on the same shapes); the
  MLA attention takes its products in another order (kv_b absorbed into the query and the output, mla_decode.py), so
  the logits and every later state agree within TOLERANCE and STATE_TOLERANCE, and the fp32 greedy tokens are
  equal. In a batch padded to 8 (padding at the end and in between, streams in scrambled slot order) the same
  bounds hold for every state: on the CPU the GEMMs round a row by where it falls in the batch (FLIPS: where bf16
  rounding flips near-tied choices, only the bitwise part is checked).
- Padded rows (slot -1) write nothing: every idle slot's state and every page row but the live rows' new ones stay
  byte for byte.
- The DSA selection of a decode step is the per-stream path's, mask for mask, and from position 19 on it holds fewer
  keys than the context (4 pools of 4 kept of up to 9, plus the row's pool tail); the step reads only those keys'
  latents.
- Outside core's kernels (whose GPU paths have no host sync) the step reads nothing back: no .item(), .tolist(),
  nonzero or boolean mask.
- `forward` (and `forward_all`) run a step's one-token rows through the decode step: in a step mixing a prefill
  chunk with one-token rows (sampling, every_row, neither), those rows' logits and states are the bits of `decode`
  over the same rows alone (one batch of them all with `decode_together`, as on CUDA; one row a batch, the CPU's
  default), and the chunk's are the bits of `forward` over it alone.
- test_glm_decode_runner.py: the same step through the core's DecodeRunner and a real Engine.

Checkpoints: the embedded default (LLLI, DMMM: KDA, MLA with its own indexer, dense and MoE), the kit's twin with a
shared-indexer layer (LISLI) and an odd one (ILI, MLA first: index_kpool 1 with no pool tail, no always-selected
tail, group-limited routing without renormalisation, the softplus KDA gate).
"""

from __future__ import annotations

import unittest.mock
from functools import partial

import pytest
import torch
from glm_decode_cases import (
    CONTEXT,
    DTYPES,
    FLIPS,
    PAGE_ROWS,
    PROMPTS,
    SLOTS,
    STATE_TOLERANCE,
    STEPS,
    TOLERANCE,
    VARIANTS,
    batch_of,
    load_subjects,
    per_stream,
    prefill,
    same_bytes,
    tokens,
)

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.testing.decode_engine import padded_steps
from tensorfold_glm import decode as glm_decode
from tensorfold_glm import mla, mla_decode, mlp


@pytest.fixture(scope="module")
def subjects(tmp_path_factory):
    return load_subjects(tmp_path_factory.mktemp("glm-decode"), list(VARIANTS), list(DTYPES.values()))


def states(store, slot: int, end: int) -> list[tuple[int, str, torch.Tensor]]:
    """(layer, name, tensor) of every state of a slot: its fixed states, then its row states' entries [0, end)."""
    found = []
    for i, layer in enumerate(store.layout.layers):
        found += [(i, spec.name, store.fixed(i, spec.name, slot).clone()) for spec in layer.fixed]
        found += [(i, spec.name, store.rows(i, spec.name, slot, end)) for spec in layer.rows]
    return found


def first_mla(store) -> int:
    return next(i for i, layer in enumerate(store.layout.layers) if layer.kind == "mla")


def compare_states(reference, decoded, position: dict[int, int], dtype: torch.dtype, bitwise_up_to: int,
                   bounded: bool = True) -> dict[str, float]:
    """Every stream's states: bitwise in layers up to `bitwise_up_to`, after it within STATE_TOLERANCE of their
    scale (when `bounded`). Returns the worst relative difference per layer and state name."""
    worst: dict[str, float] = {}
    for slot in position:
        pairs = zip(states(reference, slot, position[slot]), states(decoded, slot, position[slot]), strict=True)
        for (layer, name, a), (_, _, b) in pairs:
            if layer <= bitwise_up_to:
                assert same_bytes(a, b), f"slot {slot} layer {layer} {name} differs from the per-stream path's"
                continue
            relative = float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-30))
            worst[f"{layer}.{name}"] = max(worst.get(f"{layer}.{name}", 0.0), relative)
            assert not bounded or relative <= STATE_TOLERANCE[dtype], f"slot {slot} layer {layer} {name}: {relative}"
    return worst


@pytest.mark.parametrize("page_rows", [PAGE_ROWS, None], ids=["paged", "window"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_batch_of_one_matches_forward(subjects, variant, dtype, page_rows):
    """Each stream alone in its batch, STEPS steps each (pools completing on the way): logits and states."""
    subject = subjects[variant, dtype]
    reference, decoded = (subject.store(SLOTS, CONTEXT, page_rows=page_rows) for _ in range(2))
    token = prefill(subject, reference, PROMPTS)
    assert prefill(subject, decoded, PROMPTS) == token
    position, worst = dict(PROMPTS), 0.0
    for _ in range(STEPS):
        for slot in PROMPTS:
            expected = per_stream(subject.model, StepPlan((StreamStep(slot, position[slot], (token[slot],)),)),
                                  reference)
            got = subject.model.decode(batch_of(decoded, [(slot, token[slot], position[slot])]), decoded)
            assert got.dtype == torch.float32 and got.shape == (1, subject.model.vocab_size)
            worst = max(worst, float((expected - got).abs().max()))
            if dtype == torch.float32:
                assert int(expected.argmax()) == int(got.argmax()), (slot, position[slot])
            token[slot] = int(expected[0].argmax())
            position[slot] += 1
    flips = (variant, dtype) in FLIPS
    relative = compare_states(reference, decoded, position, dtype, bitwise_up_to=first_mla(reference),
                              bounded=not flips)
    print(f"\n[glm decode {variant} {dtype}] batch of one vs per-stream: max |Δlogit| {worst:.2e}; states after the "
          f"first MLA, max |Δ| / max |state| {max(relative.values(), default=0.0):.1e}")
    assert flips or worst <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_padded_batch_matches_forward_and_pads_write_nothing(subjects, variant, dtype):
    """Three streams in a batch of 8 with padding between them, STEPS steps, each fed the per-stream path's greedy:
    logits and states within the bounds; the idle slots (the last one is where a slot of -1 would land) and every
    page row but the streams' new ones unchanged."""
    subject = subjects[variant, dtype]
    reference, decoded = (subject.store(SLOTS, CONTEXT, page_rows=PAGE_ROWS) for _ in range(2))
    token = prefill(subject, reference, PROMPTS)
    prefill(subject, decoded, PROMPTS)
    position = dict(PROMPTS)
    worst = padded_steps(subject, reference, decoded, token, position, STEPS, CONTEXT,
                         partial(per_stream, subject.model), exact_tokens=dtype == torch.float32)
    flips = (variant, dtype) in FLIPS
    relative = compare_states(reference, decoded, position, dtype, bitwise_up_to=-1, bounded=not flips)
    print(f"\n[glm decode {variant} {dtype}] padded batch vs per-stream: max |Δlogit| {worst:.2e}; states, max |Δ| / "
          f"max |state| {max(relative.values(), default=0.0):.1e}")
    assert flips or worst <= TOLERANCE[dtype]


def test_the_selection_is_forwards_and_drops_keys(subjects, monkeypatch):
    """Streams at positions 9..37 decoded together: each full MLA layer's picked keys are the mask the per-stream
    path builds for the same token, and past the indexer's top-k (16 keys) fewer than the context; the step reads a
    fixed width of 4 pools of 4 and 3 tail places per row, whatever the context."""
    subject = subjects["shared", torch.float32]
    reference, decoded = (subject.store(SLOTS, CONTEXT, page_rows=PAGE_ROWS) for _ in range(2))
    token = prefill(subject, reference, PROMPTS)
    prefill(subject, decoded, PROMPTS)
    seen: dict[str, list] = {"forward": [], "decode": []}

    def recording(kind, inner):
        def record(*args, **kwargs):
            found = inner(*args, **kwargs)
            seen[kind].append(found)
            return found
        return record

    monkeypatch.setattr(mla, "index_step", recording("forward", mla.index_step))
    monkeypatch.setattr(mla_decode, "index_step", recording("decode", mla_decode.index_step))
    slots = list(PROMPTS)
    position, sparse = dict(PROMPTS), 0
    for _ in range(STEPS):
        seen["forward"].clear()
        seen["decode"].clear()
        for slot in slots:   # one stream at a time: its full layers' masks in layer order, stream by stream
            per_stream(subject.model, StepPlan((StreamStep(slot, position[slot], (token[slot],)),)), reference)
        subject.model.decode(batch_of(decoded, [(s, token[s], position[s]) for s in slots]), decoded)
        full_layers = len(seen["decode"])
        assert full_layers == 2 and len(seen["forward"]) == full_layers * len(slots)
        for n, slot in enumerate(slots):
            end = position[slot] + 1
            for layer in range(full_layers):
                picked = seen["decode"][layer]
                assert picked.keys.shape == (len(slots), 16 + 3)
                want = seen["forward"][n * full_layers + layer][0]                    # [end]
                got = picked.mask(CONTEXT)[n]                                         # [CONTEXT]
                assert torch.equal(got[:end], want) and not got[end:].any(), (slot, position[slot], layer)
                if end > 19:     # 4 pools of 4 and at most 3 tail keys
                    assert int(want.sum()) <= 16 + 3
                else:
                    assert int(want.sum()) == end
                sparse += int(want.sum()) < end
            token[slot] = position[slot] % 400 + 5
            position[slot] += 1
    assert sparse >= 2 * STEPS          # slot 3 (positions 30..37) is past the top-k in both full layers


class HostSync(AssertionError):
    """A host read-back outside core's kernels."""


def test_the_step_reads_nothing_back_outside_the_kernels(subjects):
    """Every torch call that reads device data back to the host (or sizes a result by it) raises, except inside
    core's kernels (the KDA step, the experts, the paged writes), whose naive CPU paths read slots and experts back
    and whose GPU paths do not: what a CUDA graph capture needs of the rest."""
    subject = subjects["tiny", torch.float32]
    store = subject.store(SLOTS, CONTEXT, page_rows=PAGE_ROWS)
    token = prefill(subject, store, PROMPTS)
    batch = batch_of(store, [(3, token[3], 30), None, (0, token[0], 9), None])
    inside = [0]

    def forbid(name, original):
        def checked(*args, **kwargs):
            if not inside[0]:
                raise HostSync(name)
            return original(*args, **kwargs)
        return checked

    def checked_getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if not inside[0] and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise HostSync("boolean mask indexing")
        return getitem(self, index)

    def kernel(original):
        def call(*args, **kwargs):
            inside[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] -= 1
        return call

    getitem = torch.Tensor.__getitem__
    methods = ("item", "tolist", "nonzero", "unique", "bincount", "masked_select", "__bool__", "__int__",
               "__float__", "__index__")
    patches = [unittest.mock.patch.object(torch.Tensor, name, forbid(name, getattr(torch.Tensor, name)))
               for name in methods]
    patches += [unittest.mock.patch.object(torch, name, forbid(name, getattr(torch, name)))
                for name in ("nonzero", "unique", "bincount", "masked_select", "repeat_interleave", "argwhere")]
    patches.append(unittest.mock.patch.object(torch.Tensor, "__getitem__", checked_getitem))
    patches += [unittest.mock.patch.object(module, name, kernel(getattr(module, name)))
                for module, name in ((glm_decode, "recurrent_kda_step"), (glm_decode, "write_rows"),
                                     (mla_decode, "write_rows"), (mlp, "kernel_experts"))]
    for patch in patches:
        patch.start()
    try:
        with pytest.raises(HostSync):      # the guard is live: a read-back outside the kernels raises
            torch.arange(3).tolist()
        out = subject.model.decode(batch, store)
    finally:
        for patch in patches:
            patch.stop()
    assert out.shape == (4, subject.model.vocab_size) and torch.isfinite(out[[0, 2]]).all()


# ------------------------------------------------------- forward's one-token rows go through the decode step

MIXED_STEPS, CHUNK = 3, 6


def mixed_plan(token: dict[int, int], position: dict[int, int], step: int) -> StepPlan:
    """One-token rows of slots 1 (sampling), 0 (every_row, not sampling: its one row) and 2 (neither: no logit row)
    around slot 3's prefill chunk of CHUNK tokens."""
    return StepPlan((StreamStep(1, position[1], (token[1],)),
                     StreamStep(3, position[3], tokens(CHUNK, step)),
                     StreamStep(0, position[0], (token[0],), sample=False, every_row=True),
                     StreamStep(2, position[2], (token[2],), sample=False)))


@pytest.mark.parametrize("entry", ["forward", "forward_all"])
@pytest.mark.parametrize("together", [False, True], ids=["one-a-batch", "together"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_mixed_steps_one_token_rows_are_the_decode_steps(subjects, variant, dtype, together, entry):
    """MIXED_STEPS steps mixing slot 3's prefill chunks with one-token rows of three other streams, through
    `forward` (or `forward_all`), against a twin store that runs the one-token rows through `decode` alone (one
    DecodeBatch of them all with `decode_together`, as on CUDA; one row a batch otherwise, the CPU's default) and
    the chunks through `forward` alone: every logit row and every state of every stream the same bits."""
    subject = subjects[variant, dtype]
    model = subject.model
    assert model.decode_together is False and model.decode is not None       # the CPU default
    mixed, alone = (subject.store(SLOTS, CONTEXT, page_rows=PAGE_ROWS) for _ in range(2))
    prompts = {**PROMPTS, 2: 12}
    token = prefill(subject, mixed, prompts)
    assert prefill(subject, alone, prompts) == token
    position, singles = dict(prompts), (1, 0, 2)
    run = getattr(model, entry)
    model.decode_together = together
    try:
        for step in range(MIXED_STEPS):
            plan = mixed_plan(token, position, step)
            got = run(plan, mixed)
            rows = [[(s, token[s], position[s]) for s in singles]] if together else \
                [[(s, token[s], position[s])] for s in singles]
            decoded = torch.cat([model.decode(batch_of(alone, group), alone) for group in rows])   # slots 1, 0, 2
            chunk = run(StepPlan((plan.streams[1],)), alone)
            if entry == "forward":
                expected = torch.cat((decoded[:1], chunk, decoded[1:2]))
            else:
                expected = torch.cat((decoded[:1], chunk, decoded[1:]))
            assert got.shape == expected.shape == (plan.logit_rows if entry == "forward" else plan.rows,
                                                   model.vocab_size)
            assert same_bytes(got, expected), f"step {step}: differs by {float((got - expected).abs().max()):.3e}"
            for slot in singles:
                token[slot] = int(decoded[singles.index(slot)].argmax())
                position[slot] += 1
            position[3] += CHUNK
    finally:
        model.decode_together = False
    for slot in (*singles, 3):
        pairs = zip(states(mixed, slot, position[slot]), states(alone, slot, position[slot]), strict=True)
        assert all(same_bytes(a, b) for (_, _, a), (_, _, b) in pairs), f"slot {slot}'s states differ"
