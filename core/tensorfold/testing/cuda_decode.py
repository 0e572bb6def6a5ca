"""A family's tensor-only decode on a CUDA device through the core's graph runner, as shared gates: graph replay
against the family's eager reference (logits within a bound, greedy tokens where the top two are clear), a stream
alone and among others giving the same tokens, graph replay equal to eager decode bit for bit (logits and every
state), and a decode step that never syncs with the host. Used by the families' `pytest -m gpu` decode tests."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.testing.decode_engine import batch_of


@attrs.frozen
class Streams:
    """The streams a gate drives: one prompt per slot, on a paged store of `slots` slots of `context` rows."""

    prompts: list[list[int]]
    context: int = 256
    page_rows: int = 16

    @property
    def slots(self) -> int:
        return len(self.prompts)


def prefill(subject, streams: Streams, store, slots: list[int]) -> dict[int, int]:
    """Each slot's prompt through `forward` alone; the greedy first tokens."""
    first = {}
    for slot in slots:
        logits = subject.model.forward(StepPlan((StreamStep(slot, 0, tuple(streams.prompts[slot])),)), store)
        first[slot] = int(logits[0].argmax())
    return first


def runner_on(subject, streams: Streams, graphs: bool) -> tuple[DecodeRunner, object]:
    """A captured runner (graphs or eager) on a fresh store, and the store."""
    store = subject.store(streams.slots, streams.context, page_rows=streams.page_rows)
    runner = DecodeRunner(subject.model, store, batch_sizes(streams.slots), streams.context, graphs=graphs)
    runner.capture()
    return runner, store


def step_of(token: dict[int, int], position: dict[int, int], slots: list[int]) -> StepPlan:
    return StepPlan(tuple(StreamStep(s, position[s], (token[s],)) for s in slots))


def states(store, slot: int, end: int) -> list[torch.Tensor]:
    """A stream's fixed states and its key/value rows [0, end)."""
    layers = list(enumerate(store.layout.layers))
    return ([store.fixed(i, spec.name, slot).clone() for i, layer in layers for spec in layer.fixed]
            + [store.rows(i, spec.name, slot, end) for i, layer in layers for spec in layer.rows])


def replay_against(subject, streams: Streams, reference: Callable[[StepPlan, object], torch.Tensor],
                   tolerance: float, steps: int, exact_tokens: bool, live: int = 5) -> tuple[float, int, int]:
    """`live` streams (padded to the next graph) replayed step by step against `reference(plan, store)` on a twin
    store, each step fed the reference's greedy tokens: (max |Δlogit|, rows whose greedy tokens agree, rows).
    Asserts the greedy tokens agree on every row (exact_tokens) or where the reference's top two are more than
    2 · tolerance apart."""
    slots = list(range(live))
    twin = subject.store(streams.slots, streams.context, page_rows=streams.page_rows)
    runner, store = runner_on(subject, streams, graphs=True)
    token = prefill(subject, streams, twin, slots)
    assert prefill(subject, streams, store, slots) == token
    position = {s: len(streams.prompts[s]) for s in slots}
    worst, agree = 0.0, 0
    for _ in range(steps):
        plan = step_of(token, position, slots)
        expected = reference(plan, twin)
        got = runner.forward(plan, store)
        worst = max(worst, float((expected - got).abs().max()))
        top = expected.topk(2, dim=-1).values
        same = expected.argmax(-1) == got.argmax(-1)
        clear = (top[:, 0] - top[:, 1]) > 2 * tolerance
        assert bool(same.all()) if exact_tokens else bool(same[clear].all())
        agree += int(same.sum())
        for i, s in enumerate(slots):
            token[s] = int(expected[i].argmax())
            position[s] += 1
    assert runner.replays == steps
    return worst, agree, steps * len(slots)


def alone_and_among(subject, streams: Streams, among: int = 6, steps: int = 12) -> float:
    """`among` streams in one step (padded to the next graph) vs each alone (the graph of 1), each run following its
    own greedy tokens: asserts the same tokens step after step; the max |Δlogit| between the two."""
    slots = list(range(among))
    (together, kv_together), (alone, kv_alone) = runner_on(subject, streams, True), runner_on(subject, streams, True)
    first = prefill(subject, streams, kv_together, slots)
    assert prefill(subject, streams, kv_alone, slots) == first
    tokens = {"together": dict(first), "alone": dict(first)}
    seen = {"together": {s: [] for s in slots}, "alone": {s: [] for s in slots}}
    position = {s: len(streams.prompts[s]) for s in slots}
    worst = 0.0
    for _ in range(steps):
        batch = together.forward(step_of(tokens["together"], position, slots), kv_together)
        for i, s in enumerate(slots):
            one = alone.forward(step_of(tokens["alone"], position, [s]), kv_alone)
            worst = max(worst, float((one[0] - batch[i]).abs().max()))
            tokens["alone"][s] = int(one[0].argmax())
            tokens["together"][s] = int(batch[i].argmax())
            seen["alone"][s].append(tokens["alone"][s])
            seen["together"][s].append(tokens["together"][s])
            position[s] += 1
    assert seen["together"] == seen["alone"]
    return worst


def replay_equals_eager(subject, streams: Streams) -> None:
    """The same steps by eager decode and by graph replay (the graph of 4 with a row padded, then of 2): logits and
    every state bit for bit."""
    slots = [0, 1, 2]
    (eager, kv_eager), (replay, kv_replay) = runner_on(subject, streams, False), runner_on(subject, streams, True)
    token = prefill(subject, streams, kv_eager, slots)
    prefill(subject, streams, kv_replay, slots)
    position = {s: len(streams.prompts[s]) for s in slots}
    for step in range(8):
        live = slots if step < 4 else slots[:2]
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


def never_syncs(subject, streams: Streams, slots: tuple[int, ...] = (2, 0, 5)) -> None:
    """A batch of all slots (the listed streams, the rest padded) through `decode` under
    set_sync_debug_mode("error"), after a warm call that compiles the kernels."""
    store = subject.store(streams.slots, streams.context, page_rows=streams.page_rows)
    token = prefill(subject, streams, store, list(slots))
    pad = [None] * (streams.slots - len(slots))

    def batch(shift: int):
        made = batch_of(store, [(s, token[s], len(streams.prompts[s]) + shift) for s in slots] + pad,
                        streams.context)
        return type(made)(*(t.to("cuda") for t in (made.tokens, made.positions, made.slots, made.tables)))

    subject.model.decode(batch(0), store)
    second = batch(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = subject.model.decode(second, store)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.shape == (streams.slots, subject.model.vocab_size) and out.dtype == torch.float32
    assert bool(torch.isfinite(out[: len(slots)]).all())
