"""How a kept state's bytes reach the store's device from host memory, the same code on the CPU and on CUDA.

On CUDA a Lane owns a copy stream: the work queued inside `copying()` runs there, after the compute stream's work
queued so far (a device-side wait, so a page freed by a finished stream is never overwritten under its last
kernels), as large asynchronous copies from pinned memory; `mark()` records an event at a layer's end, and the store
makes the compute stream wait for it at its first access to that layer (kv/base.py `arriving`), so the host never
waits and a step's first layers run while the later ones are still copying. A Timer's event pair gives the copy's
own device time once it has finished, read without waiting.

Copies out of the device (a state kept on the host or staged for the disk) run the same way, into pinned memory
(tiers/arena.py): `to_host`, then a mark per layer that the compute stream waits for before it next touches that
layer, so no step overwrites a page or a fixed state still being copied out, and the host never waits.

On the CPU there is no stream and no event: `to_device` hands back the host tensor itself (or a copy when one is
owned), `to_host` is a plain copy, `mark()` is None, and a Timer is the wall clock around the plain copies.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import attrs
import torch


@attrs.frozen
class CudaArrival:
    """A copy stream's event at one layer's end, waited on by whichever stream then reads the layer."""

    event: torch.cuda.Event
    device: torch.device

    def wait(self) -> None:
        """The current stream waits for the event (the host does not)."""
        self.event.wait(torch.cuda.current_stream(self.device))

    def query(self) -> bool:
        """Whether the copies before it have finished (never waits)."""
        return self.event.query()

    def synchronize(self) -> None:
        """The host waits for the copies before it (for a reader on the host: the disk's I/O thread)."""
        self.event.synchronize()


class Timer:
    """The seconds a lane's copies took: the wall clock on the CPU, an event pair on the copy stream on CUDA."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._seconds: float | None = None
        if stream is None:
            self._began = time.perf_counter()
        else:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(stream)

    def stop(self) -> None:
        """The copies to time are queued."""
        if self._stream is None:
            self._seconds = time.perf_counter() - self._began
        else:
            self._end.record(self._stream)

    def seconds(self) -> float | None:
        """Their seconds once they have finished; None while they run (never waits)."""
        if self._seconds is None and self._stream is not None and self._end.query():
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds


class Lane:
    """Host → device copies for one store's device: on their own stream on CUDA, plain copies on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device) if self.cuda else None
        self._compute: torch.cuda.Stream | None = None   # the stream that was current when `copying` began

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Queue the block's work on the copy stream, after the compute stream's work queued so far."""
        if self.stream is None:
            yield
            return
        self._compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(self._compute)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self._compute = None

    def to_device(self, host: torch.Tensor, own: bool = False) -> torch.Tensor:
        """`host` on the device, copied asynchronously on CUDA (from pinned memory); on the CPU the tensor itself,
        or a copy when the caller keeps it (`own`). A kept copy is marked as used by the compute stream too, so
        its memory is not reused while that stream may still read it."""
        if not self.cuda:
            return host.clone() if own else host
        out = host.to(self.device, non_blocking=True)
        if own and self._compute is not None:
            out.record_stream(self._compute)
        return out

    def to_host(self, host: torch.Tensor, device: torch.Tensor, keep: bool = False) -> None:
        """Copy `device` into `host`: asynchronously on CUDA (into pinned memory, so the host never waits), a plain
        copy on the CPU. With `keep`, `device` was made on another stream and may be freed before the copy runs:
        its memory is held for the copy stream until then."""
        if not self.cuda:
            host.copy_(device)
            return
        if keep:
            device.record_stream(self.stream)
        host.copy_(device, non_blocking=True)

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor made on the copy stream that the compute stream will read (a promoted state's copies):
        its memory is not reused while that stream may still read it."""
        if self.cuda and self._compute is not None:
            tensor.record_stream(self._compute)
        return tensor

    def index(self, values: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Page ids as an int64 index on the device (one small copy from pinned memory on CUDA)."""
        host = torch.tensor(values, dtype=torch.long, pin_memory=self.cuda)
        return host.to(self.device, non_blocking=True) if self.cuda else host

    def mark(self) -> CudaArrival | None:
        """An arrival at this point of the copy stream (None on the CPU: copies there are done when queued)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return CudaArrival(event, self.device)

    def timer(self, compute: bool = False) -> Timer:
        """A Timer started here: on CUDA on the copy stream, or with `compute` on the current stream."""
        if not self.cuda:
            return Timer(None)
        return Timer(torch.cuda.current_stream(self.device) if compute else self.stream)
