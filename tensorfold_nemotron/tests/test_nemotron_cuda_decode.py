"""Nemotron-H decode on a CUDA device through the core's graph runner, in bf16, at the tiny default shape (M E * M -)
and a mid-size MoE (hidden 1024, 8 layers M E M * E M E M, 32 experts top-6, Mamba2 16 heads x 64, 4 groups, state
128, GQA 8/2 x 128). Skipped without CUDA; run in device sessions (`pytest -m gpu`). Each test prints what it
measured (`-s`).

- graph replay against the eager one-stream `forward`, each step fed the forward's greedy token, in fp32 and bf16:
  logits within LOGIT_TOLERANCE; fp32: every greedy token equal; bf16: equal wherever the forward's top two are more
  than 2 · LOGIT_TOLERANCE apart and on at least AGREEMENT of all rows (random weights give flat logits: the top two
  of about a fifth of the rows lie within 0.06, a few bf16 ulps). Not bitwise: a one-token `forward` runs the
  conv's prefill kernel, dense attention and one-row GEMMs; the step runs the conv's update kernel (another
  summation order), the paged Triton decode (fp32 scores) and B-row GEMMs.
- concurrent == solo: each stream alone (the graph of 1) and among 6 streams padded to 8 give the same greedy
  tokens, each run following its own (as qwen's decode test holds it). Not bitwise: the decode kernels are batch
  invariant by construction, but cuBLAS picks another GEMM kernel for 1 row than for 8 at the mid-size widths
  (docs/families/nemotron.md).
- graph replay == eager decode, bit for bit; and the step syncs with the host nowhere
  (torch.cuda.set_sync_debug_mode("error")).
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.plan import DecodeBatch, StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_nemotron import plugin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

M, E, A = "linear_attention", "moe", "full_attention"
MID = dict(vocab_size=4096, hidden_size=1024, layers_block_type=[M, E, M, A, E, M, E, M],
           num_attention_heads=8, num_key_value_heads=2, head_dim=128,
           mamba_num_heads=16, mamba_head_dim=64, n_groups=4, ssm_state_size=128, conv_kernel=4,
           n_routed_experts=32, num_experts_per_tok=6, n_group=1, topk_group=1, moe_intermediate_size=256,
           moe_shared_expert_intermediate_size=512, routed_scaling_factor=2.5)
SHAPES = {"tiny": {}, "mid-moe": MID}
CONTEXT, PAGE_ROWS, SLOTS, STEPS = 256, 16, 8, 24
PROMPTS = [[(i * (17 + 6 * p) + 5 * p) % 500 + 3 for i in range(24 + 9 * p)] for p in range(SLOTS)]
# fp32: ulps through other summation orders; bf16: a few bf16 ulps of the activations carried to unit-scale logits
LOGIT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25}
MOE_BF16_TOLERANCE = 1.0    # bf16 with 32 experts: a routing near-tie picks another expert in one of the two paths
AGREEMENT = 0.75            # bf16: the share of rows whose greedy token must equal the forward's
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module", params=list(SHAPES))
def loaded(request, tmp_path_factory):
    """(shape name, {dtype: the model loaded on the GPU})."""
    directory = tmp_path_factory.mktemp(f"nemotron-cuda-decode-{request.param}")
    plugin.write_tiny(directory, seed=5, **SHAPES[request.param])
    family = load_families(["nemotron"])["nemotron"]
    return request.param, {dtype: kit.load(family, directory, dtype=dtype, device="cuda") for dtype in DTYPES.values()}


def prefill(subject, store, slots: list[int]) -> dict[int, int]:
    """Each slot's prompt through `forward` alone; the greedy first tokens."""
    first = {}
    for slot in slots:
        logits = subject.model.forward(StepPlan((StreamStep(slot, 0, tuple(PROMPTS[slot])),)), store)
        first[slot] = int(logits[0].argmax())
    return first


def runner_on(subject, graphs: bool):
    store = subject.store(SLOTS, CONTEXT, page_rows=PAGE_ROWS)
    runner = DecodeRunner(subject.model, store, batch_sizes(SLOTS), CONTEXT, graphs=graphs)
    runner.capture()
    return runner, store


def step_of(token: dict[int, int], position: dict[int, int], slots: list[int]) -> StepPlan:
    return StepPlan(tuple(StreamStep(s, position[s], (token[s],)) for s in slots))


def states(store, slot: int, end: int) -> list[torch.Tensor]:
    """A stream's fixed states and its key/value rows [0, end)."""
    layers = list(enumerate(store.layout.layers))
    return ([store.fixed(i, spec.name, slot).clone() for i, layer in layers for spec in layer.fixed]
            + [store.rows(i, spec.name, slot, end) for i, layer in layers for spec in layer.rows])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_graph_replay_gives_the_eager_forwards_greedy_tokens(loaded, dtype):
    shape, subject = loaded[0], loaded[1][dtype]
    tolerance = MOE_BF16_TOLERANCE if (shape, dtype) == ("mid-moe", torch.bfloat16) else LOGIT_TOLERANCE[dtype]
    slots = list(range(5))                                          # 5 streams: the graph of 8, 3 rows padded
    reference = subject.store(SLOTS, CONTEXT, page_rows=PAGE_ROWS)
    runner, store = runner_on(subject, graphs=True)
    token = prefill(subject, reference, slots)
    assert prefill(subject, store, slots) == token
    position = {s: len(PROMPTS[s]) for s in slots}
    worst, agree, rows = 0.0, 0, 0
    for _ in range(STEPS):
        plan = step_of(token, position, slots)
        expected = subject.model.forward(plan, reference)
        got = runner.forward(plan, store)
        worst = max(worst, float((expected - got).abs().max()))
        top = expected.topk(2, dim=-1).values
        same = expected.argmax(-1) == got.argmax(-1)
        clear = (top[:, 0] - top[:, 1]) > 2 * tolerance
        assert bool(same.all()) if dtype == torch.float32 else bool(same[clear].all())
        agree += int(same.sum())
        rows += len(slots)
        for i, s in enumerate(slots):
            token[s] = int(expected[i].argmax())
            position[s] += 1
    print(f"\n[nemotron cuda decode {shape} {dtype}] graph replay vs eager forward: max |Δlogit| {worst:.3e}, "
          f"greedy tokens agree on {agree}/{rows} rows")
    assert runner.replays == STEPS
    assert worst <= tolerance
    assert agree >= AGREEMENT * rows


def test_a_stream_alone_and_among_6_gives_the_same_tokens(loaded):
    """6 streams in one step (the graph of 8, 2 rows padded) vs each alone (the graph of 1), each run following its
    own greedy tokens: the same tokens, step after step."""
    shape, subject = loaded[0], loaded[1][torch.bfloat16]
    slots = list(range(6))
    (together, kv_together), (alone, kv_alone) = runner_on(subject, True), runner_on(subject, True)
    first = prefill(subject, kv_together, slots)
    assert prefill(subject, kv_alone, slots) == first
    tokens = {"together": dict(first), "alone": dict(first)}
    seen = {"together": {s: [] for s in slots}, "alone": {s: [] for s in slots}}
    position = {s: len(PROMPTS[s]) for s in slots}
    worst = 0.0
    for _ in range(12):
        batch = together.forward(step_of(tokens["together"], position, slots), kv_together)
        for i, s in enumerate(slots):
            one = alone.forward(step_of(tokens["alone"], position, [s]), kv_alone)
            worst = max(worst, float((one[0] - batch[i]).abs().max()))
            tokens["alone"][s] = int(one[0].argmax())
            tokens["together"][s] = int(batch[i].argmax())
            seen["alone"][s].append(tokens["alone"][s])
            seen["together"][s].append(tokens["together"][s])
            position[s] += 1
    print(f"\n[nemotron cuda decode {shape}] alone vs among 6: max |Δlogit| {worst:.3e}")
    assert seen["together"] == seen["alone"]


def test_graph_replay_equals_eager_decode(loaded):
    """The same steps by eager decode and by graph replay: logits and every state bit for bit."""
    subject = loaded[1][torch.bfloat16]
    slots = [0, 1, 2]
    (eager, kv_eager), (replay, kv_replay) = runner_on(subject, False), runner_on(subject, True)
    token = prefill(subject, kv_eager, slots)
    prefill(subject, kv_replay, slots)
    position = {s: len(PROMPTS[s]) for s in slots}
    for step in range(8):
        live = slots if step < 4 else slots[:2]                      # the graph of 4 (one row padded), then of 2
        plan = step_of(token, position, live)
        got, expected = replay.forward(plan, kv_replay), eager.forward(plan, kv_eager)
        assert torch.equal(got, expected)
        for i, s in enumerate(live):
            token[s] = int(expected[i].argmax())
            position[s] += 1
    assert replay.replays == 8 and eager.replays == 0
    for s in slots:
        assert all(torch.equal(a, b) for a, b in zip(states(kv_eager, s, position[s]),
                                                     states(kv_replay, s, position[s]), strict=True))


def test_the_decode_step_never_syncs(loaded):
    """A batch of 8 (3 streams, 5 rows padded) through `decode` under set_sync_debug_mode("error"), after a warm
    call that compiles the kernels."""
    subject = loaded[1][torch.bfloat16]
    slots = [2, 0, 5]
    store = subject.store(SLOTS, CONTEXT, page_rows=PAGE_ROWS)
    token = prefill(subject, store, slots)
    width = store.table_width(CONTEXT)

    def batch(shift: int) -> DecodeBatch:
        tables = torch.zeros((SLOTS, width), dtype=torch.int32)
        for i, s in enumerate(slots):
            tables[i, : len(store.host_table(s))] = torch.tensor(store.host_table(s), dtype=torch.int32)
        pad = SLOTS - len(slots)
        made = DecodeBatch(tokens=torch.tensor([token[s] for s in slots] + [0] * pad),
                           positions=torch.tensor([len(PROMPTS[s]) + shift for s in slots] + [0] * pad),
                           slots=torch.tensor(slots + [-1] * pad), tables=tables)
        return DecodeBatch(*(t.to("cuda") for t in (made.tokens, made.positions, made.slots, made.tables)))

    subject.model.decode(batch(0), store)
    second = batch(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = subject.model.decode(second, store)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.shape == (SLOTS, subject.model.vocab_size) and out.dtype == torch.float32
    assert bool(torch.isfinite(out[: len(slots)]).all())
