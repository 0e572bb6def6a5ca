"""Real tensor-parallel worlds for tests: each rank a spawned process joined over gloo on the loopback, rank 0
serving requests through the Engine (with kept-state tiers when the Job gives them budgets) and its followers
replaying its steps (follow/); each follower saves the keys of its kept parts when rank 0 stops. With a
`learn_dir`, rank 0 also keeps states on disk (each rank its own part, tiers/disk_mirror.py), its identity probed
through the Leader as `serve` does, and a read always preferred to a prefill."""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import attrs
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.engine.api import Sampling
from tensorfold.engine.runner import Engine
from tensorfold.family import Family, FamilyModel
from tensorfold.follow.channel import join, leave
from tensorfold.follow.follower import follow
from tensorfold.follow.leader import Leader
from tensorfold.follow.rank import load_rank
from tensorfold.image import row_offset
from tensorfold.kv import KvStore, PagedStore, WindowStore
from tensorfold.memory import StreamMemory
from tensorfold.plan import StepPlan
from tensorfold.plugins import load_families
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.ports import free_port
from tensorfold.rows.identity import identity_facts, prefill_rate, probe_hash
from tensorfold.rows.store import RowsStore
from tensorfold.service import EngineDead
from tensorfold.shard import SINGLE
from tensorfold.testing.engine_gates import Client, running
from tensorfold.tiers.device import DeviceTier
from tensorfold.tiers.disk import DiskTier
from tensorfold.tiers.host import HostTier
from tensorfold.tiers.mirror import Mirror
from tensorfold.tiers.states import HostState, KeptState


@attrs.frozen
class Job:
    """What every rank of one world runs: the family, its checkpoint, the requests and the memory."""

    family: str
    model: Path
    prompts: tuple[tuple[int, ...], ...] = attrs.field(converter=tuple)
    max_tokens: int = 12
    parallel: int = 4
    pages: int = 64
    page_rows: int = 16
    chunk: int = 8
    context: int = 256
    timeout_s: float = 10.0
    die_after: int | None = None       # a follower kills itself (SIGKILL) after this many steps
    device_bytes: int = 0              # the device tier's budget on rank 0 (0: off)
    host_bytes: int = 0                # the host tier's budget on rank 0 (0: off)
    together: bool = True              # also serve every prompt at once after serving them one by one
    paged: bool = True                 # False: one window per slot (TF_KV_PAGES=0)
    learn_dir: Path | None = None      # the disk tier's --learn-dir (None: off)
    learn_block_rows: int = 8


class Recorder:
    """A FamilyModel that keeps every logits row its model returns, in order, and apart those of the steps where
    every stream feeds one row (decode steps: as many with kept states as without)."""

    def __init__(self, model: FamilyModel) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.rows: list[torch.Tensor] = []
        self.decode_rows: list[torch.Tensor] = []

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """The model's forward, its rows kept."""
        out = self.model.forward(plan, kv)
        self.rows.append(out.detach().clone())
        if plan.rows == len(plan.streams):
            self.decode_rows.append(self.rows[-1])
        return out


class Dying:
    """A follower's model that SIGKILLs its own process before its step number `after`: a rank dying mid-run."""

    def __init__(self, model: FamilyModel, after: int) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.after = after
        self.steps = 0

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Run, until the step it dies at."""
        if self.steps == self.after:
            os.kill(os.getpid(), signal.SIGKILL)
        self.steps += 1
        return self.model.forward(plan, kv)


def parts(mirror: Mirror) -> dict:
    """A follower's kept parts at the end: their keys by kind, and the bytes their copies hold."""
    return {"device": sorted(k for k, p in mirror.parts.items() if isinstance(p, KeptState)),
            "host": sorted(k for k, p in mirror.parts.items() if isinstance(p, HostState)),
            "bytes": mirror.nbytes}


def serve(engine: Engine, prompts: Sequence[tuple[int, ...]], max_tokens: int, together: bool) -> list[dict]:
    """Each prompt's greedy reply and how it ended (alone: one after another; together: all submitted at once)."""
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens)
    clients = [Client(f"r{i}", prompt, sampling) for i, prompt in enumerate(prompts)]
    out = []
    groups = [clients] if together else [[c] for c in clients]
    for group in groups:
        refused = {}
        for client in group:
            try:
                engine.submit(client.request)
            except EngineDead as err:
                refused[client.request.id] = f"EngineDead: {err}"
        for client in group:
            end = refused.get(client.request.id) or repr(client.done.get(timeout=300))
            out.append({"tokens": list(client.tokens), "end": end})
    return out


def run_rank(rank: int, world: int, port: int, job: Job, out: Path) -> None:
    """One rank: join, load its part, then serve (rank 0: alone, then together; results in `out`) or follow."""
    torch.set_num_threads(1)
    try:
        _run_rank(rank, world, port, job, out)
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _run_rank(rank: int, world: int, port: int, job: Job, out: Path) -> None:
    family = load_families([job.family])[job.family]
    checkpoint = Checkpoint(job.model)
    joined = join(rank, world, f"tcp://127.0.0.1:{port}", job.timeout_s) if world > 1 else None
    shard = joined.shard if joined is not None else SINGLE
    model, layout = load_rank(family, checkpoint, torch.float32, torch.device("cpu"), shard)
    if rank > 0:
        follow(joined.channel, Dying(model, job.die_after) if job.die_after is not None else model, layout,
               torch.device("cpu"), at_stop=lambda mirror: torch.save(parts(mirror), out / f"rank{rank}.pt"))
        leave()
        return
    if job.paged:
        memory = StreamMemory(PagedStore(layout, job.parallel, job.pages, job.page_rows, poison=True),
                              SlotPool(job.parallel), PagePool(job.pages, job.page_rows))
    else:
        memory = StreamMemory(WindowStore(layout, job.parallel, job.context, poison=True), SlotPool(job.parallel),
                              None)
    recorder = Recorder(model)
    served = Leader(recorder, memory.kv, joined.channel) if joined is not None else recorder
    disk = learning(job, family, checkpoint, served, memory, world) if job.learn_dir is not None else None
    recorder.rows.clear()
    recorder.decode_rows.clear()
    device = DeviceTier(memory, job.device_bytes) if job.device_bytes else None
    host = HostTier(memory, job.host_bytes) if job.host_bytes else None
    engine = Engine(served, memory, prefill_chunk=job.chunk, context=job.context, max_waiting=64, tier=device,
                    host=host, disk=disk)
    with running(engine):
        alone = serve(engine, job.prompts, job.max_tokens, together=False)
        logits, decode_logits = list(recorder.rows), list(recorder.decode_rows)
        together = serve(engine, job.prompts, job.max_tokens, together=True) if job.together else []
    kept = engine.scheduler.tiers
    result = {"alone": alone, "together": together, "logits": logits, "decode_logits": decode_logits,
              "failure": engine.failure,
              "tiers": kept.describe() if kept is not None else {},
              "keys": {tier.name: sorted(s.key for s in tier.states) for tier in kept.ram} if kept else {}}
    torch.save(result, out / "rank0.pt")
    if engine.failure is not None:      # the world is lost: nothing to stop or tear down in step
        return
    if isinstance(served, Leader):
        served.stop("the test is done")
    leave()


def learning(job: Job, family: Family, checkpoint: Checkpoint, served: FamilyModel, memory: StreamMemory,
             world: int) -> DiskTier:
    """Rank 0's disk tier over `job.learn_dir`, its identity probed through `served` (the Leader at TP above 1),
    reads always preferred; at TP above 1 the followers open their own stores (DiskTier.lead)."""
    declarations = family.declare(checkpoint.config, torch.float32)
    layout = memory.kv.layout
    probe = probe_hash(served, memory, declarations, job.chunk)
    facts = identity_facts(checkpoint, declarations, torch.float32, memory.kv.device, probe, layout, world)
    store = RowsStore(job.learn_dir, facts, row_offset=partial(row_offset, layout, declarations.image),
                      block_rows=job.learn_block_rows, cap_bytes=(1 << 30) // world, min_free_bytes=0)
    prefill_rate(served, memory, job.chunk, runs=1)      # the forwards `serve` times at startup, on every rank
    disk = DiskTier(memory, store, declarations.image, read_bytes_per_s=1e15, prefill_rows_per_s=1e-3)
    if isinstance(served, Leader):
        disk.lead(served)
    return disk


def run_world(world: int, job: Job, out: Path, join_s: float = 300.0) -> tuple[dict, list[int | None]]:
    """Run every rank (TP=1 in this process, else each in a spawned process); rank 0's results and the exit codes."""
    out.mkdir(parents=True, exist_ok=True)
    if world == 1:
        run_rank(0, 1, 0, job, out)
        return torch.load(out / "rank0.pt"), [0]
    codes = spawn_ranks(run_rank, world, (job, out), join_s)
    found = out / "rank0.pt"
    return (torch.load(found) if found.exists() else {}), codes


def spawn_ranks(target: Callable[..., None], world: int, args: tuple, join_s: float = 300.0) -> list[int | None]:
    """`target(rank, world, port, *args)` in one spawned process per rank, joined on a free local port; their exit
    codes (a rank still running after `join_s`, a guard against a hang and not a measurement, is killed)."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=target, args=(rank, world, port, *args), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(join_s)
    codes = [proc.exitcode for proc in procs]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    return codes


def tp1_and_tp2(job: Job, out: Path) -> tuple[dict, list[dict]]:
    """TP=1 once, TP=2 twice: rank 0's results of each (what every family's TP tests compare)."""
    one, _ = run_world(1, job, out / "tp1")
    runs = []
    for run in range(2):
        found = out / f"tp2-{run}"
        result, codes = run_world(2, job, found)
        errors = [path.read_text() for path in found.glob("*.error")]
        if codes != [0, 0] or errors:
            raise AssertionError(f"TP=2 run {run}: exit codes {codes}; {errors}")
        runs.append(result)
    return one, runs


def replied(replies: list[dict]) -> list[list[int]]:
    """Each reply's token ids."""
    return [reply["tokens"] for reply in replies]


def greedy_gap(one: dict, two: dict, max_tokens: int) -> tuple[int, float]:
    """Check TP=2's greedy replies equal TP=1's, full length, over the same sampling steps; (the logits rows
    compared, the largest |TP=2 − TP=1| among them). Steps that sampled nothing are left out."""
    assert one["failure"] is None and two["failure"] is None, (one["failure"], two["failure"])
    assert all(len(tokens) == max_tokens for tokens in replied(one["alone"]))
    assert replied(two["alone"]) == replied(one["alone"])
    assert len(two["logits"]) == len(one["logits"])
    pairs = [(a, b) for a, b in zip(one["logits"], two["logits"], strict=True) if a.numel()]
    assert all(a.shape == b.shape for a, b in pairs)
    return sum(a.shape[0] for a, _ in pairs), max(float((a - b).abs().max()) for a, b in pairs)


def same_bits(first: dict, second: dict) -> bool:
    """Two runs' replies alone and together, and every logits row, bitwise the same."""
    return (replied(first["alone"]) == replied(second["alone"])
            and replied(first["together"]) == replied(second["together"])
            and all(torch.equal(a, b) for a, b in zip(first["logits"], second["logits"], strict=True)))
