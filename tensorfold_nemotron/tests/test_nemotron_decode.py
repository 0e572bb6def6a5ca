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

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import decode_engine, kit
from tensorfold.testing.decode_engine import check_engine_with_decode, fixed_states
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
    """Each prompt (slot -> length) through `forward` alone; each stream's greedy first token."""
    return decode_engine.prefill(subject, store, {slot: tokens(n, slot) for slot, n in prompts.items()})


def row_states(store, slot: int, end: int) -> list[torch.Tensor]:
    return [store.rows(i, spec.name, slot, end) for i, layer in enumerate(store.layout.layers) for spec in layer.rows]


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
    position = dict(PROMPTS)
    worst = decode_engine.padded_steps(subject, reference, decoded, token, position, STEPS, CONTEXT,
                                       subject.model.forward, exact_tokens=dtype == torch.float32)
    assert worst <= TOLERANCE[dtype]
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
    got, expected, _, _ = decode_engine.runner_covers_decode_steps(subject, tokens(5, 0), CONTEXT, PAGE_ROWS,
                                                                   subject.model.forward)
    assert float((got - expected).abs().max()) <= TOLERANCE[torch.float32]


# ---------------------------------------------------------------- the engine


def test_an_engine_with_decode_gives_the_tokens_of_one_without(subjects):
    """Greedy and seeded requests through a CPU Engine: the decode runner (eager), with and without steps launched
    ahead, gives every token and finish reason the family's forward alone gives."""
    check_engine_with_decode(subjects["tiny", torch.float32], tokens, CONTEXT, PAGE_ROWS)
