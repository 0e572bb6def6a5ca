"""Host memory for kept states: a few large slabs (pinned when the store is on CUDA) carved into the tensors of
states and carved again as states go, so keeping, restoring and dropping a state make no host allocation and no
free (a pinned allocation or free costs in proportion to its bytes, and cudaFreeHost waits for the device).

    carve   `empty_many(specs)`: one state's tensors as one run, the first free run of a slab that holds them (each
            tensor starting on ALIGN bytes); tensors over it whose storage keeps the run taken: the run comes back
            when the last of them or of their views is gone, on whichever thread drops it (the disk's I/O thread
            too). `empty(shape, dtype)` is one tensor
    fence   on CUDA a run is read or written by copies queued on a stream: `fence(tensors, event)` records the
            event the last of them is done at; a run that comes back is carved again only once its event has
            passed (checked without waiting; waited for only when nothing else fits and the slabs may not grow),
            so a late copy never lands in, or reads, memory given out again
    grow    when no free run holds a tensor: a new slab of at least `slab_bytes` (a power of two: the pinned
            allocator rounds up to one) while the slabs stay within `limit`; past it a tensor of its own, counted
            as `outside` (it costs its allocation and free); `reserve(nbytes)` grows a slab ahead, at startup,
            and `ahead(nbytes)` keeps a free run of that many bytes by growing on a thread of its own, so a state
            kept after startup finds its room ready
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Iterable

import numpy as np
import torch

ALIGN = 512                 # bytes a run starts on: any dtype's view of it is aligned
SLAB_BYTES = 256 * 2**20    # the smallest slab grown


class _Run(np.ndarray):
    """The bytes of one carved run: a tensor made over it keeps it alive, and its end gives the run back."""


class HostArena:
    """Slabs of host memory (pinned with `pin`) carved into tensors, within `limit` bytes of slabs."""

    def __init__(self, pin: bool, limit: int, slab_bytes: int = SLAB_BYTES) -> None:
        if limit < 0 or slab_bytes < ALIGN:
            raise ValueError(f"an arena needs a limit of at least 0 bytes and slabs of at least {ALIGN} bytes, got "
                             f"{limit} and {slab_bytes}")
        self.pin = pin
        self.limit = limit
        self.slab_bytes = slab_bytes
        self._slabs: list[np.ndarray] = []                        # each slab's bytes
        self._bases: list[int] = []                               # and its address
        self._keep: list[torch.Tensor] = []                       # the tensors that own them
        self._free: list[list[tuple[int, int]]] = []              # per slab: free (offset, size), by offset
        self._cooling: list[tuple[int, int, int, object]] = []    # runs back whose fence has not passed yet
        self._fences: dict[int, object] = {}                      # a taken run's address -> its fence
        self._back: deque[tuple[int, int, int, int]] = deque()    # runs whose last tensor is gone, not yet freed
        self._lock = threading.Lock()
        self._growing: threading.Thread | None = None
        self._ahead = 0
        self.capacity = 0       # bytes of every slab
        self.taken = 0          # bytes of the runs carved and not yet back (cooling ones included)
        self.grown = 0          # slabs grown while carving (on the caller's thread), reserve and ahead aside
        self.outside = 0        # tensors that got memory of their own: the slabs were full and at the limit

    # -- carving --------------------------------------------------------------------------------------------------

    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor carved from a slab (module docstring)."""
        return self.empty_many([(tuple(shape), dtype)])[0]

    def empty_many(self, specs: Iterable[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Uninitialised host tensors of these shapes and dtypes, carved as one run (one state's tensors: they come
        back together, once the last of them and of their views is gone)."""
        specs = [(tuple(shape), dtype) for shape, dtype in specs]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
        offsets, size = [], 0
        for nbytes in sizes:
            offsets.append(size)
            size += -(-nbytes // ALIGN) * ALIGN
        if size == 0:
            return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        with self._lock:
            found = self._carve(size)
            if found is None and self._grow(size, counted=True):
                found = self._carve(size)
            if found is None and self._settle_cooling(size):
                found = self._carve(size)
            if found is None:
                self.outside += 1
        if found is None:
            return [torch.empty(shape, dtype=dtype, pin_memory=self.pin) for shape, dtype in specs]
        slab, offset = found
        run = self._slabs[slab][offset: offset + size].view(_Run)
        finalizer = weakref.finalize(run, self._give_back, slab, offset, size, self._bases[slab] + offset)
        finalizer.atexit = False
        whole = torch.frombuffer(run, dtype=torch.uint8)
        self._wake_ahead()
        return [whole[start: start + nbytes].view(dtype).view(shape)
                for (shape, dtype), start, nbytes in zip(specs, offsets, sizes, strict=True)]

    def fence(self, tensors: Iterable[torch.Tensor], event: object) -> None:
        """Copies queued on a stream read or write these tensors' runs until `event` has passed (its `query()`
        says so): a run given back meanwhile waits until then (tensors not carved here are ignored)."""
        with self._lock:
            for tensor in tensors:
                address = tensor.untyped_storage().data_ptr()
                if address in self._fences:
                    self._fences[address] = event

    def _carve(self, size: int) -> tuple[int, int] | None:
        """The first free run of `size` bytes, taken (under the lock)."""
        self._harvest()
        for slab, runs in enumerate(self._free):
            for k, (offset, free) in enumerate(runs):
                if free < size:
                    continue
                if free == size:
                    del runs[k]
                else:
                    runs[k] = (offset + size, free - size)
                self.taken += size
                self._fences[self._bases[slab] + offset] = None
                return slab, offset
        return None

    def _give_back(self, slab: int, offset: int, size: int, address: int) -> None:
        """A run's last tensor is gone (on any thread, maybe inside a carve): noted, freed at the next carve."""
        self._back.append((slab, offset, size, address))

    def _release(self, slab: int, offset: int, size: int) -> None:
        """Put a run back among its slab's free runs, merged with its neighbours (under the lock)."""
        runs = self._free[slab]
        k = 0
        while k < len(runs) and runs[k][0] < offset:
            k += 1
        runs.insert(k, (offset, size))
        if k + 1 < len(runs) and offset + size == runs[k + 1][0]:
            runs[k] = (offset, size + runs[k + 1][1])
            del runs[k + 1]
        if k > 0 and runs[k - 1][0] + runs[k - 1][1] == runs[k][0]:
            runs[k - 1] = (runs[k - 1][0], runs[k - 1][1] + runs[k][1])
            del runs[k]
        self.taken -= size

    def _harvest(self) -> None:
        """Free the runs given back and the cooling runs whose fences have passed (never waits; under the lock)."""
        while self._back:
            slab, offset, size, address = self._back.popleft()
            fence = self._fences.pop(address, None)
            if fence is not None and not fence.query():
                self._cooling.append((slab, offset, size, fence))
            else:
                self._release(slab, offset, size)
        if not self._cooling:
            return
        cooling, self._cooling = self._cooling, []
        for slab, offset, size, fence in cooling:
            if fence.query():
                self._release(slab, offset, size)
            else:
                self._cooling.append((slab, offset, size, fence))

    def _settle_cooling(self, size: int) -> bool:
        """Nothing fits and the arena may not grow: wait for the cooling runs' fences (oldest first) until a run of
        `size` bytes is free; False when none would be."""
        while self._cooling:
            slab, offset, run, fence = self._cooling.pop(0)
            fence.synchronize()
            self._release(slab, offset, run)
            if self._largest() >= size:
                return True
        return False

    # -- growing --------------------------------------------------------------------------------------------------

    def _grow(self, size: int, counted: bool) -> bool:
        """Add a slab that holds `size` bytes, within the limit (under the lock); False when it would pass it."""
        bytes_ = max(self.slab_bytes, 1 << (size - 1).bit_length())
        if self.capacity + bytes_ > self.limit:
            bytes_ = size
            if self.capacity + bytes_ > self.limit:
                return False
        self._add(torch.empty(bytes_, dtype=torch.uint8, pin_memory=self.pin))
        self.grown += counted
        return True

    def _add(self, slab: torch.Tensor) -> None:
        """Make a new slab's bytes carvable (under the lock)."""
        self._keep.append(slab)
        self._slabs.append(slab.numpy())
        self._bases.append(slab.data_ptr())
        self._free.append([(0, slab.numel())])
        self.capacity += slab.numel()

    def reserve(self, nbytes: int) -> None:
        """Grow now, by one slab, until a free run holds `nbytes` (within the limit)."""
        with self._lock:
            self._harvest()
            if self._largest() < nbytes:
                self._grow(min(nbytes, self.limit), counted=False)

    @property
    def free(self) -> int:
        """Bytes of the slabs not carved (cooling runs count as carved)."""
        return self.capacity - self.taken

    def _largest(self) -> int:
        """The largest free run (under the lock)."""
        return max((free for runs in self._free for _, free in runs), default=0)

    def ahead(self, nbytes: int) -> None:
        """Keep a free run of at least `nbytes`, growing on a thread of its own while there is none (within the
        limit)."""
        self._ahead = max(self._ahead, min(nbytes, self.limit))
        self._wake_ahead()

    def _wake_ahead(self) -> None:
        if not self._ahead or self.capacity >= self.limit:
            return
        with self._lock:
            if self._largest() >= self._ahead or (self._growing is not None and self._growing.is_alive()):
                return
            self._growing = threading.Thread(target=self._grow_ahead, name="tensorfold-host-arena", daemon=True)
            self._growing.start()

    def _grow_ahead(self) -> None:
        """The thread `ahead` starts: allocate a slab outside the lock while no free run holds `ahead` bytes."""
        while True:
            with self._lock:
                self._harvest()
                if self._largest() >= self._ahead or self.capacity >= self.limit:
                    return
                bytes_ = min(max(self.slab_bytes, 1 << (self._ahead - 1).bit_length()), self.limit - self.capacity)
            slab = torch.empty(bytes_, dtype=torch.uint8, pin_memory=self.pin)
            with self._lock:
                if self.capacity + bytes_ > self.limit:
                    return
                self._add(slab)

    def describe(self) -> dict[str, int]:
        """Numbers for /memory."""
        with self._lock:
            self._harvest()
            return {"capacity": self.capacity, "taken": self.taken, "slabs": len(self._slabs), "grown": self.grown,
                    "outside": self.outside}
