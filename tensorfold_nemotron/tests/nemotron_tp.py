"""A prompt through every rank of a real tensor-parallel world (gloo, spawned processes), each rank's states kept:
what the state tests compare with TP=1's states cut by the family's declared pieces. Engine-level worlds are
core's (tensorfold.testing.tp_world)."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.follow.channel import join, leave
from tensorfold.follow.rank import load_rank
from tensorfold.kv import WindowStore
from tensorfold.plan import DecodeBatch, StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.ports import free_port
from tensorfold.shard import SINGLE
from tensorfold.testing.kit import every_row


def prompt_states(rank: int, world: int, port: int, model: Path, tokens: Sequence[int], cuts: Sequence[int],
                  decoded: Sequence[int], out: Path, tensor_only: bool = False) -> None:
    """One rank: the prompt prefilled in pieces cut at `cuts`, then `decoded` fed one token a step (through the
    tensor-only `decode` with `tensor_only`, else `forward_all`); its logits of every row and every state of its
    one slot saved to `out/rank{rank}.pt`."""
    torch.set_num_threads(1)
    try:
        family = load_families(["nemotron"])["nemotron"]
        joined = join(rank, world, f"tcp://127.0.0.1:{port}", 60.0) if world > 1 else None
        shard = joined.shard if joined is not None else SINGLE
        model_, layout = load_rank(family, Checkpoint(model), torch.float32, torch.device("cpu"), shard)
        kv = WindowStore(layout, 1, len(tokens) + len(decoded), poison=True)
        rows = [every_row(model_, kv, tokens, cuts)]
        for at, token in enumerate(decoded, start=len(tokens)):
            if tensor_only:
                rows.append(model_.decode(DecodeBatch(tokens=torch.tensor([token]), positions=torch.tensor([at]),
                                                      slots=torch.tensor([0]), tables=kv.tables([0])), kv))
            else:
                rows.append(model_.forward_all(StepPlan([StreamStep(0, at, [token])]), kv))
        end = len(tokens) + len(decoded)
        states = {}
        for index, layer in enumerate(layout.layers):
            states.update({(index, s.name): kv.fixed(index, s.name, 0).clone() for s in layer.fixed})
            states.update({(index, s.name): kv.rows(index, s.name, 0, end).clone() for s in layer.rows})
        torch.save({"logits": torch.cat(rows), "states": states}, out / f"rank{rank}.pt")
        if joined is not None:
            leave()
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def world_states(world: int, model: Path, tokens: Sequence[int], cuts: Sequence[int], decoded: Sequence[int],
                 out: Path, tensor_only: bool = False) -> list[dict]:
    """Every rank's logits and states (TP=1 in this process, else each rank spawned)."""
    out.mkdir(parents=True, exist_ok=True)
    args = (model, list(tokens), list(cuts), list(decoded), out, tensor_only)
    if world == 1:
        prompt_states(0, 1, 0, *args)
    else:
        port = free_port()
        context = multiprocessing.get_context("spawn")
        procs = [context.Process(target=prompt_states, args=(rank, world, port, *args), daemon=True)
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(300)              # a guard against a hang, not a measurement
            if proc.is_alive():
                proc.kill()
        errors = [path.read_text() for path in sorted(out.glob("rank*.error"))]
        assert not errors and [proc.exitcode for proc in procs] == [0] * world, errors
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]
