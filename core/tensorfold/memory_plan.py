"""The memory plan: how many streams and pages fit the KV budget, priced from the family's Layout alone.

    page bytes      = Σ layers Σ row states (page_rows / every) · entry bytes
    window pages    = ⌈context / page_rows⌉            (what one stream can reach; 0 without row states)
    one stream      = window pages · page bytes + fixed bytes per stream
    parallel (auto) = min(⌊budget / one stream⌋, AUTO_PARALLEL_MAX, --max-step-rows)
    pages           = min(⌊(budget − parallel · fixed) / page bytes⌋, parallel · window pages)   (0 without rows)
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from tensorfold.layout import Layout

GIB = 2**30
AUTO_PARALLEL_MAX = 256  # the largest decode batch engine/graphs.py captures (and vLLM's default max_num_seqs)
CPU_BUDGET_SHARE = 0.25
CUDA_RESERVE_BYTES = 2 * GIB
HOST_CACHE_SHARE = 0.25  # of MemAvailable: the host tier's default budget
MEMINFO = Path("/proc/meminfo")


@attrs.frozen
class MemoryPlan:
    """What `serve` holds for streams, and why."""

    budget_bytes: int
    context: int
    page_rows: int
    page_bytes: int
    fixed_bytes: int
    parallel: int
    pages: int

    @property
    def window_pages(self) -> int:
        """Pages one stream at the full context holds (none when pages hold nothing: no row states)."""
        return -(-self.context // self.page_rows) if self.page_bytes else 0

    @property
    def stream_bytes(self) -> int:
        """Bytes one stream at the full context holds."""
        return self.window_pages * self.page_bytes + self.fixed_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes the store allocates: the pages and every slot's fixed states."""
        return self.pages * self.page_bytes + self.parallel * self.fixed_bytes

    def describe(self) -> dict[str, int]:
        """JSON-ready numbers for explain and /memory."""
        return {"budget_bytes": self.budget_bytes, "context": self.context, "page_rows": self.page_rows,
                "page_bytes": self.page_bytes, "fixed_bytes_per_stream": self.fixed_bytes,
                "window_pages": self.window_pages, "stream_bytes": self.stream_bytes, "parallel": self.parallel,
                "pages": self.pages, "kv_bytes": self.kv_bytes}


def size(nbytes: float) -> str:
    """Bytes for a person: GiB from 1 GiB up, else MiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def page_bytes(layout: Layout, page_rows: int) -> int:
    """Bytes of one page across every layer's row states."""
    return sum((page_rows // s.every) * s.entry_bytes for layer in layout.layers for s in layer.rows)


def default_budget(device_type: str, weights_bytes: int, cuda_free_bytes: int | None = None) -> int:
    """The KV budget when --kv-gib is not given: what the device leaves after weights and a reserve."""
    if device_type == "cuda" and cuda_free_bytes is not None:
        return max(0, cuda_free_bytes - weights_bytes - CUDA_RESERVE_BYTES)
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return max(0, int((available - weights_bytes) * CPU_BUDGET_SHARE))


def available_ram(meminfo: Path = MEMINFO) -> int:
    """Bytes of RAM the kernel says are available (MemAvailable); without /proc/meminfo, the free pages."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_host_cache(meminfo: Path = MEMINFO) -> int:
    """The host tier's budget when --host-cache-gib is not given: a share of available RAM."""
    return int(available_ram(meminfo) * HOST_CACHE_SHARE)


def auto_parallel(fits: int, step_rows: int | None = None) -> int:
    """`--parallel auto`: every stream the budget holds at the full context, bounded by the largest decode batch
    captured as a CUDA graph and by the rows one step carries (each decoding stream takes one)."""
    return min(fits, AUTO_PARALLEL_MAX, step_rows if step_rows is not None else AUTO_PARALLEL_MAX)


def plan_memory(layout: Layout, context: int, page_rows: int, budget_bytes: int, parallel: int | None,
                step_rows: int | None = None) -> tuple[MemoryPlan | None, list[str]]:
    """The plan for `parallel` streams (None: `auto_parallel`), or the refusals that say why not."""
    per_page = page_bytes(layout, page_rows)
    window = -(-context // page_rows) if per_page else 0
    stream = window * per_page + layout.fixed_bytes
    fits = budget_bytes // stream if stream else AUTO_PARALLEL_MAX
    if parallel is None:
        parallel = auto_parallel(fits, step_rows)
        if parallel < 1:
            return None, [f"one stream needs {size(stream)} of KV at --context {context}, the budget is "
                          f"{size(budget_bytes)}: lower --context or raise --kv-gib"]
    elif parallel > fits:
        return None, [f"--parallel {parallel} needs {size(parallel * stream)} of KV at --context {context}, "
                      f"the budget is {size(budget_bytes)}: serve --parallel {max(fits, 1)} or lower "
                      f"--context" + ("" if fits else " (not even one stream fits)")]
    pages = 0
    if per_page:
        pages = max(1, min(parallel * window, (budget_bytes - parallel * layout.fixed_bytes) // per_page))
    plan = MemoryPlan(budget_bytes=budget_bytes, context=context, page_rows=page_rows, page_bytes=per_page,
                      fixed_bytes=layout.fixed_bytes, parallel=parallel, pages=pages)
    return plan, []
