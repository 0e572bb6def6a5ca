"""TTFT of a next turn at a real shape, in process: the engine with its real tiers, on random weights (no checkpoint
on disk, so the 9B shape fits a short device call). bench/resume.py measures the same through a server.

For each history length L: cold = the next turn (L history rows + NEW rows) on an engine with no tiers; device /
host = the history sent first on an engine with only that tier (its state kept at L), then the next turn, which
resumes at L. Also the measured pinned host -> device copy bandwidth, and for the host resume its restore's own
bandwidth as the host tier measured it (the state's bytes over its copies' time on the copy stream, CUDA events:
`host_restore_gb_s`, and `host_over_pinned` against the pinned copy), beside the bytes restored over the extra time
it took beside the device resume (`host_restore_gb_s_estimate`).
disk = the history sent to an engine with only the disk tier (built as `serve --learn-conversations` builds it,
boot.build_disk, on a temporary --learn-dir), that engine closed (its queue flushed, the store released), then a
new engine and store on the same directory time the next turn, resumed from disk with the store's files out of
the page cache. The store's read (read and verify, each block put back as it lands) and the tier's whole restore
(DiskTier.load: that read, then the fixed states and last rows) are timed in place; the state's bytes over each
time are held against a plain sequential read of the same files, page cache dropped (bench/disk_read.py):
`read_over_seq` and `restore_over_seq`. The timed turn reads whatever the payoff rule says; the rule's verdict, with the
read and prefill times it predicts from the startup probes, is reported beside the measured ones.
promote = both the device and the host tier: the history kept on the device, every device state let go into the
host tier once the engine is idle, then the next turn resumes from the host and its state moves back up (`promoted`).

Where a resumed turn's time goes, for the host, promote and disk runs (`{run}_phase_{phase}_ms`): `choose` (the
lookup that weighs every tier's candidates), `restore` (HostTier.restore, or DiskTier.load with its store `read`
inside it), `promote` (DeviceTier.adopt), `first_step` (the forward of the turn's one prefill step, which waits on
the device for the restore's copies), `keep` (keeping the turn's own state), and `other` (the rest of the time to
the first token: submit, admission, sampling, the event). On CUDA each is the span between CUDA events on the
engine thread's stream (`_wall_ms`: the host's own span; `_lane_ms`: from the call's start to the last copy it
queued on its tier's copy stream); on the CPU perf_counter. `{run}_restore_copy_ms` is the restore's copies' own
time on the copy stream; `{run}_arena_grown` / `_arena_outside` count host memory the tier allocated beyond its
startup reserve (tiers/arena.py): 0 means no pinned allocation anywhere in the run.
One JSON line per measurement.

    python bench/resume_engine.py --shape qwen3_5-9b --lengths 2048 8192 32768 --out $OUT
"""

from __future__ import annotations

import argparse
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import gpu  # bench/gpu.py: this script runs from bench/ on sys.path
import torch
from disk_read import drop_cache, entry_files, sequential_read, store_files
from gpu import SHAPES, build, sync

from tensorfold.boot import build_disk
from tensorfold.checkpoint import Checkpoint
from tensorfold.engine.api import KeepMarks, Request, Sampling, TokenEvent
from tensorfold.engine.runner import Engine
from tensorfold.family import Declarations
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.plugins import load_families
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.rows.api import StateEntry
from tensorfold.rows.payoff import should_read
from tensorfold.settings import Settings
from tensorfold.tiers import DeviceTier, HostTier
from tensorfold.tiers.disk import DiskTier
from tensorfold.tiers.lanes import Lane

NEW = 64
PAGE_ROWS = 256
MIN_CHUNK = 256
FIRST = Sampling(temperature=0.0, max_tokens=1)
TOP_PHASES = ("choose", "restore", "promote", "first_step", "keep")   # one after another in a resumed turn


def emit(out: Path | None, **record: object) -> None:
    gpu.emit(out, jsonl="resume.jsonl", **record)


def memory(layout, context: int, device: str) -> StreamMemory:
    """Two streams' slots and pages for `context` rows each."""
    pages = 2 * -(-context // PAGE_ROWS)
    kv = PagedStore(layout, 2, pages, PAGE_ROWS, device)
    return StreamMemory(kv, SlotPool(2), PagePool(pages, PAGE_ROWS))


def engine(model, layout, context: int, chunk: int, device: str, tier: str | None) -> Engine:
    """An engine with no tier, or only the device or the host tier, or both (`promote`: a host hit moves up)."""
    mem = memory(layout, context, device)
    host = HostTier(mem, 64 << 30) if tier in ("host", "promote") else None
    kept = DeviceTier(mem, 64 << 30) if tier in ("device", "promote") else None
    return Engine(model, mem, chunk, context, 4, min_chunk=MIN_CHUNK, tier=kept, host=host)


def evict_when_idle(eng: Engine, at: int) -> threading.Event:
    """Once the engine is idle with a device state at `at` kept, on its own thread: let every device state go into
    the host tier, so the next turn resumes from the host and is promoted back. The event is set when that is done."""
    done = threading.Event()
    check = eng._check_memory

    def evicting() -> None:
        tiers = eng.scheduler.tiers
        if not done.is_set() and any(state.at == at for state in tiers.device.states):
            while tiers.evict_one(None):
                pass
            done.set()
        check()

    eng._check_memory = evicting
    return done


class Phases:
    """Where one timed turn's time goes: the span of each wrapped call, summed by phase, from CUDA events on the
    calling thread's stream on CUDA (the device's view: a host stall inside the call shows, and so does a wait for
    copies the call's stream makes), from perf_counter on the CPU; on CUDA also the host's own perf_counter span
    (`_wall_ms`) and, for calls whose copies run on a lane, the span from the call's start to the lane's last copy
    (`_lane_ms`). Only calls made while `on` count; `undo` puts every wrapped method back."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.on = False
        self._spans: dict[str, list[tuple]] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: object, name: str, phase: str, lane: Lane | None = None) -> None:
        """Time `owner.name` as `phase` (its copies' end on `lane`, when given)."""
        method = getattr(owner, name)
        own = name in vars(owner)

        def timed(*args: object, **kwargs: object) -> object:
            if not self.on:
                return method(*args, **kwargs)
            start = (self._event(), time.perf_counter())
            try:
                return method(*args, **kwargs)
            finally:
                lane_end = self._event(lane.stream) if lane is not None and lane.stream is not None else None
                self._spans.setdefault(phase, []).append((*start, self._event(), time.perf_counter(), lane_end))

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, method) if own else delattr(owner, name))

    def _event(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def ms(self, run: str, seconds: float) -> dict[str, float]:
        """`{run}_phase_{phase}_ms` for each phase timed (after a sync), with the `_wall_ms` and `_lane_ms` spans on
        CUDA, and `{run}_phase_other_ms`: what of the turn's `seconds` to its first token no top phase took (the
        host's spans; `read` runs inside `restore`)."""
        sync()
        out: dict[str, float] = {}
        walls = 0.0
        for phase, spans in self._spans.items():
            wall = sum(end_t - start_t for _, start_t, _, end_t, _ in spans) * 1e3
            walls += wall if phase in TOP_PHASES else 0.0
            if not self.cuda:
                out[f"{run}_phase_{phase}_ms"] = round(wall, 2)
                continue
            out[f"{run}_phase_{phase}_ms"] = round(sum(start.elapsed_time(end) for start, _, end, _, _ in spans), 2)
            out[f"{run}_phase_{phase}_wall_ms"] = round(wall, 2)
            lanes = [start.elapsed_time(lane) for start, _, _, _, lane in spans if lane is not None]
            if lanes:
                out[f"{run}_phase_{phase}_lane_ms"] = round(sum(lanes), 2)
        out[f"{run}_phase_other_ms"] = round(seconds * 1e3 - walls, 2)
        return out

    def undo(self) -> None:
        """Put every wrapped method back."""
        while self._undo:
            self._undo.pop()()


def watch(phases: Phases, eng: Engine, model) -> None:
    """Wrap what a resumed turn runs: the choice of a resume point, the restore (a host restore, a disk load and
    its store read), the promotion, the forward of the first step, and the keep of the new state."""
    tiers = eng.scheduler.tiers
    phases.wrap(tiers, "lookup", "choose")
    if tiers.host is not None:
        phases.wrap(tiers.host, "restore", "restore", tiers.host.lane)
    if tiers.device is not None:
        phases.wrap(tiers.device, "adopt", "promote")
    if tiers.disk is not None:
        phases.wrap(tiers.disk, "load", "restore")
        phases.wrap(tiers.disk.store, "read", "read")
    phases.wrap(model, "forward", "first_step")
    keeper = tiers.host if tiers.device is None and tiers.host is not None else tiers.disk if tiers.device is None \
        else None                                    # the tier the new state goes to, when it copies it out
    phases.wrap(tiers, "keep_from", "keep", keeper.lane if keeper is not None else None)


def disk_engine(model, mem: StreamMemory, declarations: Declarations, checkpoint: Checkpoint, root: Path,
                context: int, chunk: int, device: str) -> tuple[Engine, DiskTier]:
    """An engine whose only tier is the disk tier on `root`, built by boot.build_disk as the server builds it
    (probe, identity, store, read bandwidth, prefill rate), so its identity and payoff inputs are the server's."""
    settings = Settings(learn=True, learn_dir=root, context=context, prefill_chunk=chunk, min_chunk=MIN_CHUNK)
    disk = build_disk(settings, checkpoint, declarations, model, mem, torch.bfloat16, torch.device(device))
    return Engine(model, mem, chunk, context, 4, min_chunk=MIN_CHUNK, disk=disk), disk


def timing(calls: list[tuple[object, float]], method: Callable) -> Callable:
    """`method` with each call's first argument and seconds appended to `calls`: the read timed where it runs."""
    def timed(first: object, *args: object, **kwargs: object) -> object:
        began = time.perf_counter()
        result = method(first, *args, **kwargs)
        sync()
        calls.append((first, time.perf_counter() - began))
        return result
    return timed


def disk_resume(model, layout, declarations: Declarations, checkpoint: Checkpoint, root: Path, context: int,
                chunk: int, device: str, history: list[int], turn: list[int]) -> tuple[float, dict[str, object]]:
    """Seconds to the next turn's first token resumed from disk after a restart, and the read's numbers."""
    length = len(history)
    warm = torch.randint(3, model.vocab_size, (chunk,), generator=torch.Generator().manual_seed(11)).tolist()
    eng, disk = disk_engine(model, memory(layout, context, device), declarations, checkpoint, root, context, chunk,
                            device)
    eng.start()
    try:
        first_token(eng, "warm", warm, ())
        first_token(eng, "history", history, ())
    finally:
        eng.close()
    written, dropped = disk.store.stats().written, disk.writer.dropped
    eng, disk = disk_engine(model, memory(layout, context, device), declarations, checkpoint, root, context, chunk,
                            device)
    reads: list[tuple[StateEntry, float]] = []
    loads: list[tuple[object, float]] = []
    disk.store.read = timing(reads, disk.store.read)
    disk.load = timing(loads, disk.load)
    phases = Phases(device == "cuda")
    watch(phases, eng, model)
    eng.start()
    try:
        first_token(eng, "warm", warm + turn[length:], (len(warm),))
        disk.writer.settle(60)
        drop_cache(store_files(root))
        reads.clear()
        loads.clear()
        probed = disk.read_bytes_per_s
        disk.read_bytes_per_s = float("inf")     # read whatever the payoff rule says; its verdict is reported
        phases.on = True
        seconds, cached = first_token(eng, "turn", turn, (length,))
        phases.on = False
    finally:
        eng.close()
        phases.undo()
    if cached != length or len(reads) != 1:
        raise RuntimeError(f"disk: resumed {cached} rows with {len(reads)} reads, expected {length} with one "
                           f"(states written before the restart: {written}, dropped: {dropped})")
    entry, read_s = reads[0]
    restore_s = loads[0][1]
    arena = disk.arena.describe()
    verdict = should_read(entry.nbytes, length, probed, disk.prefill_rows_per_s, disk.margin)
    nbytes, sequential = sequential_read(entry_files(disk.store.directory, entry))
    return seconds, {"disk_written": written, "disk_dropped": dropped, "disk_state_bytes": nbytes,
                     "disk_read_ms": round(read_s * 1e3, 2), "disk_restore_ms": round(restore_s * 1e3, 2),
                     "disk_read_gb_s": round(nbytes / read_s / 1e9, 3),
                     "disk_restore_gb_s": round(nbytes / restore_s / 1e9, 3),
                     "seq_read_gb_s": round(sequential / 1e9, 3),
                     "read_over_seq": round(nbytes / read_s / sequential, 4),
                     "restore_over_seq": round(nbytes / restore_s / sequential, 4),
                     "store_probe_gb_s": round(probed / 1e9, 3),
                     "probe_prefill_rows_s": round(disk.prefill_rows_per_s),
                     "payoff_predicts_read_ms": round(entry.nbytes / probed * 1e3, 1),
                     "payoff_predicts_prefill_ms": round(length / disk.prefill_rows_per_s * 1e3, 1),
                     "payoff_would_read": verdict, **phases.ms("disk", seconds),
                     "disk_arena_grown": arena["grown"], "disk_arena_outside": arena["outside"]}


def first_token(eng: Engine, name: str, prompt: list[int], starts: tuple[int, ...]) -> tuple[float, int]:
    """Seconds from submit to the first token, and the rows the request resumed."""
    events: queue.Queue = queue.Queue()
    sync()
    began = time.perf_counter()
    eng.submit(Request(name, tuple(prompt), FIRST, events.put, starts=starts, marks=KeepMarks()))
    seconds, cached = None, 0
    while True:
        event = events.get(timeout=600)
        if isinstance(event, TokenEvent) and seconds is None:
            seconds = time.perf_counter() - began
        elif not isinstance(event, TokenEvent):
            if not hasattr(event, "cached_tokens"):
                raise RuntimeError(f"{name}: {event}")
            cached = event.cached_tokens
            break
    return seconds, cached


def pinned_bandwidth(device: str) -> float | None:
    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        sync()
        began = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - began)
    return src.numel() / best


def main() -> None:
    parser = argparse.ArgumentParser(description="TTFT cold vs resumed from each tier, in process")
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--learn-dir", type=Path, help="the disk tier's directory (default: a temporary one)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gpu.DEVICE = args.device
    torch.manual_seed(0)
    hf, ours, layout, _, config = build(args.shape, torch.bfloat16)
    del hf
    work = Path(tempfile.mkdtemp(prefix="resume-engine-"))
    (work / "checkpoint").mkdir()
    (work / "checkpoint" / "config.json").write_text(config.to_json_string())
    checkpoint = Checkpoint(work / "checkpoint", require_weights=False)   # the identity's config; no weights
    declarations = load_families([SHAPES[args.shape][0]])[SHAPES[args.shape][0]].declare(config.to_dict(),
                                                                                          torch.bfloat16)
    root = args.learn_dir or work / "learned"
    bandwidth = pinned_bandwidth(args.device)
    emit(args.out, bench="pinned_copy", device=args.device,
         gb_s=None if bandwidth is None else round(bandwidth / 1e9, 1))
    context = max(args.lengths) + NEW + 8
    vocab = ours.vocab_size
    for length in args.lengths:
        history = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        turn = history + torch.randint(3, vocab, (NEW,), generator=torch.Generator().manual_seed(7)).tolist()
        record = {"bench": "resume_ttft", "shape": args.shape, "history": length, "new": NEW}
        times = {}
        for tier in (None, "device", "host", "promote"):
            eng = engine(ours, layout, context, args.chunk, args.device, tier)
            phases = Phases(args.device == "cuda")
            if tier is not None:
                watch(phases, eng, ours)
            evicted = evict_when_idle(eng, length) if tier == "promote" else None
            eng.start()
            try:
                first_token(eng, "warm", turn[: args.chunk], ())
                if tier is not None:
                    first_token(eng, "history", history, ())
                if evicted is not None and not evicted.wait(600):
                    raise RuntimeError("promote: the device tier's states were not let go into the host tier")
                host = eng.scheduler.tiers.host if tier in ("host", "promote") else None
                restored = host.restore_seconds if host is not None else 0.0
                phases.on = True
                seconds, cached = first_token(eng, "turn", turn, (length,))
                phases.on = False
                expected = length if tier is not None else 0
                if cached != expected:
                    raise RuntimeError(f"{tier or 'cold'}: resumed {cached} rows, expected {expected}")
                times[tier or "cold"] = seconds
                record |= phases.ms(tier, seconds) if tier in ("host", "promote") else {}
                if tier == "promote":
                    record["promoted"] = eng.scheduler.tiers.device.promoted
                if host is not None:
                    sync()
                    numbers = host.describe()                  # the restore's copies timed on the copy stream
                    record[f"{tier}_restore_copy_ms"] = round((host.restore_seconds - restored) * 1e3, 2)
                    record[f"{tier}_arena_grown"] = numbers["host_arena_grown"]
                    record[f"{tier}_arena_outside"] = numbers["host_arena_outside"]
                if tier == "host":
                    record["host_state_bytes"] = max(state.nbytes for state in host.states)
                    if numbers["host_restore_seconds"] > 0:
                        achieved = numbers["host_restored_bytes"] / numbers["host_restore_seconds"]
                        record["host_restore_gb_s"] = round(achieved / 1e9, 2)
                        if bandwidth:
                            record["host_over_pinned"] = round(achieved / bandwidth, 4)
            finally:
                eng.close()
                phases.undo()
        times["disk"], read = disk_resume(ours, layout, declarations, checkpoint, root, context, args.chunk,
                                          args.device, history, turn)
        record |= {f"{k}_ms": round(v * 1e3, 2) for k, v in times.items()}
        record |= {"device_over_cold": round(times["device"] / times["cold"], 4),
                   "host_over_cold": round(times["host"] / times["cold"], 4),
                   "promote_over_cold": round(times["promote"] / times["cold"], 4),
                   "disk_over_cold": round(times["disk"] / times["cold"], 4), **read}
        extra = times["host"] - times["device"]
        if record.get("host_state_bytes") and extra > 0:
            record["host_restore_gb_s_estimate"] = round(record["host_state_bytes"] / extra / 1e9, 1)
        emit(args.out, **record)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
