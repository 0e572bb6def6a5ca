"""A fixed script of steps run by every rank of a TP world on its own part of the model and of the states, so a
test can read each rank's states, not only rank 0's logits.

Each rank joins the world (gloo, loopback), loads its part (`load_rank`), then drives three paged stores through
the same steps, each through one of the model's forwards: the per-stream reference (`forward`), the batched
forward (batched.py), and the batched forward with its one-row steps through the decode step (decode.py, eager).
Every rank writes `rank{r}.pt`: the logits of every step of every path and every slot's final states.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import attrs
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.engine.graphs import DecodeRunner
from tensorfold.follow.channel import join, leave
from tensorfold.follow.rank import load_rank
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.shard import SINGLE
from tensorfold.testing import kit
from tensorfold.testing.tp_world import spawn_ranks
from tensorfold_qwen.batched import batched_forward

SLOTS, CAPACITY, PAGE_ROWS = 4, 160, 16
STEPS = [  # per step: (slot, start, length) shares; prefill chunks across the GDN grid (64), then decode rows
    [(0, 0, 40), (1, 0, 7)],
    [(0, 40, 1), (1, 7, 64), (2, 0, 1)],
    [(0, 41, 1), (1, 71, 1), (2, 1, 30)],
    [(0, 42, 1), (1, 72, 1), (2, 31, 1), (3, 0, 65)],
    [(0, 43, 1), (1, 73, 1), (2, 32, 1), (3, 65, 1)],
    [(0, 44, 1), (1, 74, 1), (2, 33, 1), (3, 66, 1)],
]
PATHS = ("reference", "batched", "decode")


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 500 + 3 for i in range(n))


def plans() -> list[StepPlan]:
    return [StepPlan(tuple(StreamStep(slot, start, tokens(start + length, slot)[start:])
                           for slot, start, length in shares)) for shares in STEPS]


def ends() -> dict[int, int]:
    """Each slot's rows after the script."""
    return {slot: start + length for shares in STEPS for slot, start, length in shares}


def script(subject: kit.Subject) -> dict:
    """Every step through every path: {"logits": {path: [per step]}, "states": {path: {(layer, name, slot): t}},
    "decoded": steps the decode path ran through the decode step}."""
    logits, states, decoded = {}, {}, 0
    for path in PATHS:
        store = subject.store(SLOTS, CAPACITY, page_rows=PAGE_ROWS)
        runner = DecodeRunner(subject.model, store, sizes=(1, 2, 4), context=CAPACITY, graphs=False)
        rows = []
        for plan in plans():
            if path == "reference":
                rows.append(subject.model.forward(plan, store))
            elif path == "decode" and runner.covers(plan, store):
                rows.append(runner.forward(plan, store))
                decoded += 1
            else:
                rows.append(batched_forward(subject.model, plan, store))
        logits[path] = rows
        states[path] = read_states(store, subject.declarations.layout)
    return {"logits": logits, "states": states, "decoded": decoded}


def read_states(store, layout) -> dict[tuple[int, str, int], torch.Tensor]:
    """Every slot's fixed states and rows [0, end), copied out."""
    found = {}
    for index, layer in enumerate(layout.layers):
        for slot, end in ends().items():
            for spec in layer.fixed:
                found[(index, spec.name, slot)] = store.fixed(index, spec.name, slot).clone()
            for spec in layer.rows:
                found[(index, spec.name, slot)] = store.rows(index, spec.name, slot, end).clone()
    return found


def run_rank(rank: int, world: int, port: int, models: tuple[Path, ...], out: Path) -> None:
    """One rank: join, then the script on each checkpoint; results in `out/rank{rank}.pt`."""
    torch.set_num_threads(1)
    try:
        family = load_families(["qwen"])["qwen"]
        shard = join(rank, world, f"tcp://127.0.0.1:{port}", 60.0).shard if world > 1 else SINGLE
        results = []
        for directory in models:
            checkpoint = Checkpoint(directory)
            model, layout = load_rank(family, checkpoint, torch.float32, torch.device("cpu"), shard)
            declarations = attrs.evolve(family.declare(checkpoint.config, torch.float32), layout=layout)
            subject = kit.Subject(family, checkpoint, declarations, model, torch.float32, torch.device("cpu"))
            results.append(script(subject))
        torch.save(results, out / f"rank{rank}.pt")
        if world > 1:
            leave()
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_world(world: int, models: tuple[Path, ...], out: Path, join_s: float = 300.0) -> list[list[dict]]:
    """Every rank's results, per checkpoint (TP=1 in this process, else each rank in a spawned process)."""
    out.mkdir(parents=True, exist_ok=True)
    if world == 1:
        run_rank(0, 1, 0, models, out)
    else:
        codes = spawn_ranks(run_rank, world, (models, out), join_s)
        errors = [path.read_text() for path in sorted(out.glob("*.error"))]
        assert codes == [0] * world and not errors, (codes, errors)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]
