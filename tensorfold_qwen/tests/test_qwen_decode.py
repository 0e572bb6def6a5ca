"""The tensor-only decode step (decode.py) through the core's DecodeRunner: padded static buffers give what the
per-stream reference gives, padded rows touch no state, and steps the decode path does not cover fall back.
On the GPU the same runner replays CUDA graphs: the replay equals the eager decode bit for bit."""

from __future__ import annotations

import pytest
import torch

from tensorfold.engine.graphs import DecodeRunner
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_qwen import plugin

TOLERANCE = 1e-4
CONTEXT = 96


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module", params=["dense", "moe"])
def subject(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"qwen-decode-{request.param}")
    plugin.write_tiny(directory, seed=3, moe=request.param == "moe")
    return kit.load(load_families(["qwen"])["qwen"], directory)


def prefill(subject, store, prompts: dict[int, int]) -> None:
    for slot, length in prompts.items():
        subject.model.forward(StepPlan((StreamStep(slot, 0, tokens(length, slot)),)), store)


def fixed_bytes(store, slot: int) -> list[torch.Tensor]:
    return [store.fixed(i, spec.name, slot).clone() for i, layer in enumerate(store.layout.layers)
            for spec in layer.fixed]


@pytest.mark.parametrize("streams", [1, 3])
def test_padded_decode_equals_reference(subject, streams):
    prompts = {slot: 9 + 7 * slot for slot in range(streams)}
    reference, padded = (subject.store(5, CONTEXT, page_rows=16) for _ in range(2))
    prefill(subject, reference, prompts)
    prefill(subject, padded, prompts)
    runner = DecodeRunner(subject.model, padded, sizes=(1, 2, 4), context=CONTEXT, graphs=False)
    idle = fixed_bytes(padded, 4)
    worst, position = 0.0, dict(prompts)
    for _ in range(4):
        plan = StepPlan(tuple(StreamStep(slot, position[slot], (position[slot] % 400 + 5,)) for slot in prompts))
        assert runner.covers(plan, padded)
        expected = subject.model.forward(plan, reference)
        got = runner.forward(plan, padded)
        assert got.shape == expected.shape
        worst = max(worst, float((expected - got).abs().max()))
        assert torch.equal(expected.argmax(-1), got.argmax(-1))
        for slot in prompts:
            position[slot] += 1
    print(f"padded decode vs reference, {streams} streams: max |Δlogit| {worst:.2e}")
    assert worst < TOLERANCE
    assert all(torch.equal(a, b) for a, b in zip(idle, fixed_bytes(padded, 4), strict=True)), \
        "a padded row wrote an idle slot's state"


def test_steps_the_decode_path_does_not_cover_fall_back(subject):
    store = subject.store(3, CONTEXT, page_rows=16)
    runner = DecodeRunner(subject.model, store, sizes=(1, 2), context=CONTEXT, graphs=False)
    chunk = StepPlan((StreamStep(0, 0, tokens(5, 0)),))
    first_token = StepPlan((StreamStep(1, 0, (7,)),))
    too_many = StepPlan(tuple(StreamStep(s, 5, (7,)) for s in range(3)))
    other_store = subject.store(3, CONTEXT, page_rows=16)
    decode = StepPlan((StreamStep(0, 5, (9,)),))
    assert not runner.covers(chunk, store) and not runner.covers(first_token, store)
    assert not runner.covers(too_many, store) and not runner.covers(decode, other_store)
    runner.forward(chunk, store)
    assert runner.covers(decode, store)
    assert runner.forward(decode, store).shape == (1, subject.model.vocab_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_decode(tmp_path, dtype):
    """Two stores fed the same steps, one by eager decode, one by graph replay: logits and every state equal."""
    plugin.write_tiny(tmp_path, seed=4)
    subject = kit.load(load_families(["qwen"])["qwen"], tmp_path, dtype=dtype, device="cuda")
    prompts = {0: 40, 1: 17, 2: 70}
    stores = [subject.store(4, CONTEXT, page_rows=16) for _ in range(2)]
    runners = [DecodeRunner(subject.model, s, sizes=(1, 2, 4), context=CONTEXT, graphs=g)
               for s, g in zip(stores, (False, True), strict=True)]
    for store in stores:
        prefill(subject, store, prompts)
    runners[1].capture()
    position = dict(prompts)
    for step in range(6):
        live = [s for s in prompts if step < 3 or s != 1]                # batch 3 (padded to 4), then 2
        plan = StepPlan(tuple(StreamStep(s, position[s], (position[s] % 400 + 5,)) for s in live))
        eager, replayed = (runner.forward(plan, store) for runner, store in zip(runners, stores, strict=True))
        assert torch.equal(eager, replayed)
        for s in live:
            position[s] += 1
    assert runners[1].replays == 6
    for slot in prompts:
        assert all(torch.equal(a, b) for a, b in zip(fixed_bytes(stores[0], slot), fixed_bytes(stores[1], slot),
                                                     strict=True))
