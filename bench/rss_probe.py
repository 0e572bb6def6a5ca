"""`tensorfold serve` in this process with a probe thread beside it, to tell a leak from the allocator keeping
freed memory: RSS, glibc's heap figures (in use vs free but kept), Python's live blocks and objects by type, the
CPU tensor storages' bytes and (optionally) tracemalloc's live bytes by line, every few seconds as JSON lines;
malloc_trim(0) on SIGUSR1 or on a timer.

    TF_PROBE_OUT=probe.jsonl python bench/rss_probe.py serve --family example ...     # the same args as serve
    python bench/soak.py --launcher bench/rss_probe.py --env TF_PROBE_OUT=probe.jsonl ...

Environment: TF_PROBE_OUT (required), TF_PROBE_EVERY_S (default 20), TF_PROBE_TRACEMALLOC=N (trace N frames from
TF_PROBE_BASELINE_S seconds on, default 60: what is allocated after warm-up and still alive, by line),
TF_PROBE_TRIM_EVERY_S (call malloc_trim(0) that often, RSS before and after logged), TF_PROBE_HEAP_TRIMMER=1 (run
tensorfold.heap_trim's HeapTrimmer, the proposed remedy), TF_PROBE_ARENAS=N (at most N malloc arenas, via mallopt).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import signal
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from rss import status_kib  # bench/rss.py: this script runs from bench/ on sys.path

from tensorfold.heap_trim import HeapTrimmer, limit_arenas, start_heap_trimmer

TOP = 12


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (2.33+): what malloc holds from the system and how much of it is in use."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2
LIBC.malloc_trim.argtypes = [ctypes.c_size_t]


def heap() -> dict[str, float]:
    """glibc's heap in MiB: in use (uordblks), free but kept (fordblks), mmapped chunks (hblkhd), arenas (arena)."""
    info = LIBC.mallinfo2()
    mib = 1 << 20
    return {"malloc_in_use_mib": round(info.uordblks / mib, 1), "malloc_free_kept_mib": round(info.fordblks / mib, 1),
            "malloc_mmapped_mib": round(info.hblkhd / mib, 1), "malloc_arena_mib": round(info.arena / mib, 1),
            "malloc_top_pad_mib": round(info.keepcost / mib, 1)}


def memory() -> dict[str, Any]:
    """This process's RSS (all, anonymous) and heap figures."""
    pid = os.getpid()
    return {"rss_mib": round((status_kib(pid, "VmRSS") or 0) / 1024, 1),
            "rss_anon_mib": round((status_kib(pid, "RssAnon") or 0) / 1024, 1), **heap(),
            "py_blocks": sys.getallocatedblocks(), "threads": threading.active_count()}


def trim() -> dict[str, Any]:
    """malloc_trim(0): hand every arena's free pages back; RSS before and after."""
    before = memory()
    started = time.perf_counter()
    released = LIBC.malloc_trim(0)
    took = time.perf_counter() - started
    after = memory()
    return {"trim_released": bool(released), "trim_ms": round(took * 1000, 2), "rss_before_trim_mib":
            before["rss_mib"], "rss_after_trim_mib": after["rss_mib"],
            "free_kept_after_trim_mib": after["malloc_free_kept_mib"]}


def type_counts() -> collections.Counter:
    """Live gc-tracked objects by type name."""
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def tensor_bytes() -> dict[str, Any]:
    """Bytes of the CPU storages that live Python tensors hold (each storage once)."""
    import torch

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return {"tensor_storages": len(storages), "tensor_mib": round(sum(storages.values()) / (1 << 20), 1)}


class Probe:
    """Samples this process every `every_s` seconds into `out`."""

    def __init__(self, out: Path, every_s: float, frames: int, baseline_s: float, trim_every_s: float) -> None:
        self.out = out
        self.every_s = every_s
        self.frames = frames
        self.baseline_s = baseline_s
        self.trim_every_s = trim_every_s
        self.started = time.monotonic()
        self.first_types: collections.Counter | None = None
        self.trimmed_at = self.started
        self.lock = threading.Lock()
        self.trimmer: HeapTrimmer | None = None

    def write(self, **fields: Any) -> None:
        fields = {"t_s": round(time.monotonic() - self.started, 1), **fields}
        with self.lock, self.out.open("a") as out:
            out.write(json.dumps(fields) + "\n")

    def sample(self) -> None:
        """One line: memory, object counts (growth by type since the first sample), tracemalloc growth by line."""
        gc.collect()
        types = type_counts()
        self.first_types = self.first_types or types
        grown = {name: types[name] - self.first_types.get(name, 0) for name in types}
        top_types = dict(sorted(grown.items(), key=lambda item: -abs(item[1]))[:TOP])
        fields: dict[str, Any] = {**memory(), **tensor_bytes(), "gc_objects": sum(types.values()),
                                  "types_grown": top_types}
        if self.frames:
            fields.update(self.traced())
        if self.trimmer is not None:
            fields.update(heap_trims=self.trimmer.trims, heap_released_mib=self.trimmer.released_bytes >> 20)
        if self.trim_every_s and time.monotonic() - self.trimmed_at >= self.trim_every_s:
            self.trimmed_at = time.monotonic()
            fields.update(trim())
        self.write(**fields)

    def traced(self) -> dict[str, Any]:
        """tracemalloc, started `baseline_s` into the run: bytes allocated since then and still alive, by the lines
        that hold most of them (what a leak keeps; warm-up allocations are not traced)."""
        if time.monotonic() - self.started < self.baseline_s:
            return {}
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
            return {"traced_from_now": True}
        current, peak = tracemalloc.get_traced_memory()
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        top = snapshot.statistics("traceback")[:TOP]
        return {"traced_mib": round(current / (1 << 20), 2), "traced_peak_mib": round(peak / (1 << 20), 2),
                "traced_top": [{"kib": round(stat.size / 1024, 1), "count": stat.count,
                                "where": [f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
                                          for frame in stat.traceback[-self.frames:]]} for stat in top]}

    def run(self) -> None:
        while True:
            time.sleep(self.every_s)
            try:
                self.sample()
            except Exception as err:  # a probe must never stop the server it watches
                self.write(probe_error=f"{type(err).__name__}: {err}")


def main() -> None:
    out = Path(os.environ["TF_PROBE_OUT"])
    frames = int(os.environ.get("TF_PROBE_TRACEMALLOC", "0"))
    setting = os.environ.get
    probe = Probe(out, float(setting("TF_PROBE_EVERY_S", "20")), frames, float(setting("TF_PROBE_BASELINE_S", "60")),
                  float(setting("TF_PROBE_TRIM_EVERY_S", "0")))
    if os.environ.get("TF_PROBE_ARENAS"):
        limit_arenas(int(os.environ["TF_PROBE_ARENAS"]))
    if os.environ.get("TF_PROBE_HEAP_TRIMMER") == "1":
        probe.trimmer = start_heap_trimmer()
    probe.write(start=True, **memory())
    signal.signal(signal.SIGUSR1, lambda signum, frame: probe.write(on_signal=True, **trim()))
    threading.Thread(target=probe.run, name="rss-probe", daemon=True).start()
    from tensorfold.cli import main as tensorfold_main

    sys.argv = ["tensorfold", *sys.argv[1:]]
    tensorfold_main()


if __name__ == "__main__":
    main()
