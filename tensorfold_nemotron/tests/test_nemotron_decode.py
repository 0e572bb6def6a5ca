"""The tensor-only decode step (decode.py) on the CPU against the one-stream `forward`, on paged stores (and a
window store: one page per slot).

- A stream decoded in a batch of one gives forward's logits and writes forward's states and key/value rows, bit for
  bit (fp32 and bf16): the same ops on the same shapes.
- In a batch padded to 8 (padding at the end and in between, streams in scrambled slot order) the logits agree
  within TOLERANCE and the fp32 greedy tokens are equal: on the CPU, GEMMs and the vectorised softplus, sigmoid,
  silu and rsqrt round a row by where it falls in the batch (vector body or scalar tail), a few ulps. Padded rows
  (slot -1) write nothing: every idle slot's state and every page row but the live rows' stay byte for byte.
- Through the core's DecodeRunner (graphs=False) and a real Engine: the same tokens as the engine without `decode`.

Checkpoints: the embedded default (M E * M -: Mamba2, grouped-routing MoE, GQA, relu² MLP), a latent MoE with odd
widths (conv 3 without bias, 3 B/C groups, no renormalisation, attention first) and a Mamba2/MLP model without
attention.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tensorfold.engine.graphs import DecodeRunner
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import decode_engine, kit
from tensorfold.testing.decode_engine import check_engine_with_decode, fixed_states, same_bytes
from tensorfold_nemotron import plugin

CONTEXT, PAGE_ROWS, SLOTS, STEPS = 96, 16, 5, 8
batch_of = partial(decode_engine.batch_of, context=CONTEXT)
PROMPTS = {3: 30, 0: 9, 1: 17}             # slot -> prompt length; slot 2 and the last slot (4) stay idle
LATENT = dict(hidden_size=72, layers_block_type=["full_attention", "linear_attention", "moe", "linear_attention",
                                                 "mlp", "full_attention"],
              num_attention_heads=6, num_key_value_heads=2, head_dim=12, mamba_num_heads=6, mamba_head_dim=10,
              n_groups=3, ssm_state_size=12, conv_kernel=3, use_conv_bias=False, intermediate_size=100,
              n_routed_experts=6, num_experts_per_tok=3, n_group=1, topk_group=1, moe_intermediate_size=20,
              moe_shared_expert_intermediate_size=36, moe_latent_size=24, norm_topk_prob=False,
              routed_scaling_factor=1.5)
NO_ATTENTION = dict(layers_block_type=["linear_attention", "mlp", "linear_attention", "mlp"])
VARIANTS = {"tiny": {}, "latent": LATENT, "no-attention": NO_ATTENTION}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A padded batch against forward. fp32: a few ulps (measured up to 5.7e-6 on the logits, 2.1e-6 of a state's
# largest magnitude). bf16: the fp32 ulps vanish in bf16 rounding here (logits measured equal); the bounds allow one
# bf16 ulp of an activation carried to the logits, and of a state.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 0.1}
STATE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}     # max |Δ| / max |state|, per state


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module")
def family():
    return load_families(["nemotron"])["nemotron"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    found = {}
    for name, changes in VARIANTS.items():
        found[name] = tmp_path_factory.mktemp(f"nemotron-decode-{name}")
        plugin.write_tiny(found[name], seed=2, **changes)
    return found


@pytest.fixture(scope="module")
def subjects(family, checkpoints):
    return {(name, dtype): kit.load(family, checkpoints[name], dtype=dtype)
            for name in VARIANTS for dtype in DTYPES.values()}


def prefill(subject, store, prompts: dict[int, int]) -> dict[int, int]:
    """Each prompt through `forward` alone; each stream's greedy first token."""
    first = {}
    for slot, length in prompts.items():
        logits = subject.model.forward(StepPlan((StreamStep(slot, 0, tokens(length, slot)),)), store)
        first[slot] = int(logits[0].argmax())
    return first






def row_states(store, slot: int, end: int) -> list[torch.Tensor]:
    return [store.rows(i, spec.name, slot, end) for i, layer in enumerate(store.layout.layers) for spec in layer.rows]


def all_pages(store) -> list[torch.Tensor]:
    """Every row state's pages flat [pages · R, *shape], cloned."""
    return [store.row_pages(i, spec.name).flatten(0, 1).clone() for i, layer in enumerate(store.layout.layers)
            for spec in layer.rows]




def flat_row(store, slot: int, position: int) -> int:
    table = store.host_table(slot)
    return table[position // PAGE_ROWS] * PAGE_ROWS + position % PAGE_ROWS


@pytest.mark.parametrize("page_rows", [PAGE_ROWS, None], ids=["paged", "window"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_batch_of_one_is_forward_bit_for_bit(subjects, variant, dtype, page_rows):
    """Each stream alone in its batch: logits, greedy tokens, conv tails, SSM states and key/value rows equal; on
    pages, and on a window store (one page per slot)."""
    subject = subjects[variant, dtype]
    reference, decoded = (subject.store(SLOTS, CONTEXT, page_rows=page_rows) for _ in range(2))
    token = prefill(subject, reference, PROMPTS)
    assert prefill(subject, decoded, PROMPTS) == token
    position = dict(PROMPTS)
    for _ in range(STEPS):
        for slot in PROMPTS:
            expected = subject.model.forward(StepPlan((StreamStep(slot, position[slot], (token[slot],)),)), reference)
            got = subject.model.decode(batch_of(decoded, [(slot, token[slot], position[slot])]), decoded)
            assert got.dtype == torch.float32 and got.shape == (1, subject.model.vocab_size)
            assert torch.equal(expected, got), (slot, position[slot])
            token[slot] = int(expected[0].argmax())
            position[slot] += 1
    for slot in PROMPTS:
        assert all(torch.equal(a, b) for a, b in zip(fixed_states(reference, slot), fixed_states(decoded, slot),
                                                     strict=True))
        assert all(torch.equal(a, b) for a, b in zip(row_states(reference, slot, position[slot]),
                                                     row_states(decoded, slot, position[slot]), strict=True))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_padded_batch_matches_forward_and_pads_write_nothing(subjects, variant, dtype):
    """Three streams in a batch of 8 with padding between them, STEPS steps, each fed forward's greedy token:
    logits within TOLERANCE (fp32: the same greedy tokens), states within STATE_TOLERANCE of their scale; the idle
    slots (the last one is where a slot of -1 would land) and every page row but the streams' new ones unchanged."""
    subject = subjects[variant, dtype]
    reference, decoded = (subject.store(SLOTS, CONTEXT, page_rows=PAGE_ROWS) for _ in range(2))
    token = prefill(subject, reference, PROMPTS)
    prefill(subject, decoded, PROMPTS)
    idle = (2, SLOTS - 1)
    for slot in idle:   # something a stray write would change
        for i, layer in enumerate(decoded.layout.layers):
            for spec in layer.fixed:
                decoded.fixed(i, spec.name, slot).copy_(torch.randn(decoded.fixed(i, spec.name, slot).shape))
    kept = {slot: fixed_states(decoded, slot) for slot in idle}
    order = [3, None, 0, 1, None, None, None, None]
    position, worst = dict(PROMPTS), 0.0
    for _ in range(STEPS):
        live = [slot for slot in order if slot is not None]
        expected = subject.model.forward(
            StepPlan(tuple(StreamStep(slot, position[slot], (token[slot],)) for slot in live)), reference)
        pages = all_pages(decoded)
        got = subject.model.decode(
            batch_of(decoded, [None if s is None else (s, token[s], position[s]) for s in order]), decoded)
        got = got[[i for i, slot in enumerate(order) if slot is not None]]
        assert got.shape == expected.shape
        worst = max(worst, float((expected - got).abs().max()))
        if dtype == torch.float32:
            assert torch.equal(expected.argmax(-1), got.argmax(-1))
        written = [flat_row(decoded, slot, position[slot]) for slot in live]
        for before, after in zip(pages, all_pages(decoded), strict=True):
            untouched = torch.ones(before.shape[0], dtype=torch.bool)
            untouched[written] = False
            assert same_bytes(before[untouched], after[untouched]), "a padded row wrote a page row"
        for i, slot in enumerate(live):
            token[slot] = int(expected[i].argmax())
            position[slot] += 1
    assert worst <= TOLERANCE[dtype]
    for slot in idle:
        assert all(same_bytes(a, b) for a, b in zip(kept[slot], fixed_states(decoded, slot), strict=True)), \
            f"a padded row wrote idle slot {slot}'s state"
    states = {}
    for slot in PROMPTS:
        pairs = zip(fixed_states(reference, slot) + row_states(reference, slot, position[slot]),
                    fixed_states(decoded, slot) + row_states(decoded, slot, position[slot]), strict=True)
        for n, (a, b) in enumerate(pairs):
            states[n] = max(states.get(n, 0.0), float((a.float() - b.float()).abs().max() / a.float().abs().max()))
    print(f"\n[nemotron decode {variant} {dtype}] padded batch vs forward: max |Δlogit| {worst:.2e}; states, "
          "max |Δ| / max |state|: " + " ".join(f"{v:.1e}" for v in states.values()))
    assert max(states.values()) <= STATE_TOLERANCE[dtype]


def test_the_runner_takes_decode_steps_and_falls_back_otherwise(subjects):
    subject = subjects["tiny", torch.float32]
    store = subject.store(3, CONTEXT, page_rows=PAGE_ROWS)
    runner = DecodeRunner(subject.model, store, sizes=(1, 2), context=CONTEXT, graphs=False)
    chunk = StepPlan((StreamStep(0, 0, tokens(5, 0)),))
    first_token = StepPlan((StreamStep(1, 0, (7,)),))
    too_many = StepPlan(tuple(StreamStep(s, 5, (7,)) for s in range(3)))
    decode = StepPlan((StreamStep(0, 5, (9,)),))
    assert not runner.covers(chunk, store) and not runner.covers(first_token, store)
    assert not runner.covers(too_many, store)
    assert not runner.covers(decode, subject.store(3, CONTEXT, page_rows=PAGE_ROWS))
    reference = subject.store(3, CONTEXT, page_rows=PAGE_ROWS)
    for kv in (store, reference):
        subject.model.forward(chunk, kv)
    assert runner.covers(decode, store)
    got, expected = runner.forward(decode, store), subject.model.forward(decode, reference)
    assert got.shape == (1, subject.model.vocab_size)
    assert float((got - expected).abs().max()) <= TOLERANCE[torch.float32]


# ---------------------------------------------------------------- the engine


def test_an_engine_with_decode_gives_the_tokens_of_one_without(subjects):
    """Greedy and seeded requests through a CPU Engine: the decode runner (eager), with and without steps launched
    ahead, gives every token and finish reason the family's forward alone gives."""
    check_engine_with_decode(subjects["tiny", torch.float32], tokens, CONTEXT, PAGE_ROWS)
