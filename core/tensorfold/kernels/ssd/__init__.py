"""Mamba2's state-space duality scan (Nemotron-H's Mamba2 mixer): chunked prefill over packed streams and the in-place
decode step.

    chunk_ssd(x, dt, A, B, C, initial_state=None, start=0, *, cu_seqlens=None, starts=None, backend=None)
        -> (y [T, H, P], final_state [H, P, N] float32)             one stream's prefill chunk
        -> (y [T, H, P], final_states [S, H, P, N] float32)         S streams packed (cu_seqlens)
    ssd_step(x, dt, A, B, C, states, slots, *, backend=None)
        -> y [Bt, H, P]                                             states[slots] updated in place
    ssd_step_gated(x, dt, dt_bias, A, D, B, C, states, slots, *, dt_min, dt_max, backend=None)
        -> y_skip [Bt, H, P] float32                                the step with the family's glue fused in

Per row and head h (group g = h // (H / G)): S_h = exp(dt·A_h)·S_h + (dt·x_h) ⊗ B_g, y_h = S_h C_g, S_h [P, N]
float32; y excludes the D skip and the gating. Conventions are the naive module's. Which implementation runs:

    backend   prefill (chunked)                         decode step
    naive     naive.py (any device; the CPU path)       naive.py
    triton    naive.py                                  triton_step.py (ours, in place)
    fla       fla_backend.py (fla-core's simple GLA)    fla_backend.py (gather, fla, scatter)

`backend=None` picks by device: CPU -> naive; CUDA -> fla for prefill when fla-core imports (else naive), triton for
the step. docs/kernels.md says why.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from tensorfold.kernels.backend import pick_chunk, pick_step
from tensorfold.kernels.ssd import fla_backend, naive
from tensorfold.kernels.ssd.naive import CHUNK
from tensorfold.kernels.stream_args import check_pool, check_slots, check_streams

__all__ = ["BACKENDS", "CHUNK", "chunk_backend", "chunk_ssd", "ssd_step", "ssd_step_gated", "step_backend"]

BACKENDS = ("naive", "triton", "fla")
MAX_STATE_DIM = 256             # fla's chunked kernels stop at K = 256; ours keep a [16, N] state block per program
logger = logging.getLogger(__name__)


def chunk_backend(device: torch.device | str) -> str:
    """The prefill implementation `backend=None` picks on this device."""
    return pick_chunk(device, fla_backend.available)


def step_backend(device: torch.device | str) -> str:
    """The decode-step implementation `backend=None` picks on this device."""
    return pick_step(device, fla_backend.available)


@functools.cache
def _announce(op: str, device: str, backend: str) -> None:
    logger.info("ssd %s on %s: %s", op, device, backend)


def chunk_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              initial_state: torch.Tensor | None = None, start: int = 0, *,
              cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan over one stream's rows (a prefill chunk), or S streams' rows packed end to end.

    x [T, H, P]; dt [T, H] float32 (softplus'd, clamped); A [H] float32 (negative); B, C [T, G, N], H % G == 0;
    x, B, C one floating dtype.
    One stream (cu_seqlens None): initial_state [H, P, N] float32 or None (zeros); `start` the absolute position of
    its first row. Returns y [T, H, P] in x's dtype and the final state [H, P, N] float32.
    S streams: cu_seqlens S+1 nondecreasing row offsets from 0 to T, as host ints; initial_state [S, H, P, N] or
    None; starts S absolute positions (None: all 0). Returns y [T, H, P] and the final states [S, H, P, N].
    The naive version chunks on the absolute grid of CHUNK = 64 (from the start positions); fla chunks from each
    stream's first row (docs/kernels.md).
    """
    T, H, P, N = _check_rows(x, dt, A, B, C)
    cu_seqlens, starts = check_streams(T, (H, P, N), x.device, initial_state, start, cu_seqlens, starts)
    chosen = backend or chunk_backend(x.device)
    _announce("chunk", x.device.type, chosen)
    if chosen == "fla":
        return fla_backend.chunk_ssd(x, dt, A, B, C, initial_state, start, cu_seqlens=cu_seqlens, starts=starts)
    if chosen in ("naive", "triton"):
        return naive.chunk_ssd(x, dt, A, B, C, initial_state, start, cu_seqlens=cu_seqlens, starts=starts)
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor | Sequence[int], *, backend: str | None = None) -> torch.Tensor:
    """One token for each of Bt streams; their states live in `slots` of the pool `states` and are updated in place
    (the other slots are untouched).

    x [Bt, H, P]; dt [Bt, H] float32; A [H] float32; B, C [Bt, G, N]; states [S, H, P, N] float32, contiguous;
    slots [Bt] distinct (int tensor on the states' device, or host ints); a negative slot marks a padded row (no
    state read or written, y zero; not on the fla backend). Returns y [Bt, H, P] in x's dtype. Distinctness is
    checked only for host slots (a device check would sync).
    """
    Bt, H, P, N = _check_rows(x, dt, A, B, C)
    check_pool(states, (H, P, N), x.device)
    host = check_slots(slots, Bt, states, read_back=False)
    chosen = backend or step_backend(x.device)
    _announce("step", x.device.type, chosen)
    if chosen == "naive":
        return naive.ssd_step(x, dt, A, B, C, states, slots)
    if chosen == "triton":
        from tensorfold.kernels.ssd import triton_step
        return triton_step.ssd_step(x, dt, A, B, C, states, slots)
    if chosen == "fla":
        if host is not None and any(s < 0 for s in host):
            raise ValueError("the fla backend takes no padded rows (negative slots)")
        return fla_backend.ssd_step(x, dt, A, B, C, states, slots)
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def ssd_step_gated(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | Sequence[int], *,
                   dt_min: float, dt_max: float, backend: str | None = None) -> torch.Tensor:
    """ssd_step with the family's decode glue around it: the time step from the raw dt and the D skip.

    dt [Bt, H] raw (in_proj's output, any float dtype); dt_bias [H] (any float dtype); A [H] float32; D [H]; x, B,
    C, states, slots as ssd_step. dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max) in float32 (torch's softplus,
    beta 1, threshold 20); y = ssd_step(x, dt', ...) in x's dtype; returns y.float() + D.float()·x.float()
    [Bt, H, P] float32. A padded row (negative slot) touches no state and gives D·x. naive: the three torch pieces
    in that order (bitwise the unfused code); triton: one launch of the step kernel with both fused in; fla: the
    naive time step and skip around fla's step.
    """
    Bt, H, P, N = _check_rows(x, dt, A, B, C, raw_dt=True)
    for name, t in (("dt_bias", dt_bias), ("D", D)):
        if t.shape != (H,) or not t.dtype.is_floating_point or t.device != x.device:
            raise ValueError(f"{name} must be a floating [{H}] tensor on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    chosen = backend or step_backend(x.device)
    if chosen in ("naive", "triton"):
        check_pool(states, (H, P, N), x.device)
        check_slots(slots, Bt, states, read_back=False)
        _announce("gated step", x.device.type, chosen)
        if chosen == "naive":
            return naive.ssd_step_gated(x, dt, dt_bias, A, D, B, C, states, slots, dt_min=dt_min, dt_max=dt_max)
        from tensorfold.kernels.ssd import triton_step
        return triton_step.ssd_step_gated(x, dt, dt_bias, A, D, B, C, states, slots, dt_min=dt_min, dt_max=dt_max)
    y = ssd_step(x, naive.time_steps(dt, dt_bias, dt_min, dt_max), A, B, C, states, slots, backend=chosen)
    return naive.d_skip(y, D, x)                                                   # fla (or a bad name: refused)


def _check_rows(x, dt, A, B, C, raw_dt: bool = False) -> tuple[int, int, int, int]:
    """Shapes, dtypes and devices of the per-row inputs; returns (rows, H, P, N). raw_dt: dt may be any float
    dtype (the gated step's raw time step), not only float32."""
    if x.dim() != 3:
        raise ValueError(f"x must be [rows, H, P], got {tuple(x.shape)}")
    rows, heads, head_dim = x.shape
    if B.dim() != 3 or B.shape[0] != rows or C.shape != B.shape:
        raise ValueError(f"B and C must be [{rows}, G, N] alike, got {tuple(B.shape)} and {tuple(C.shape)}")
    groups, state_dim = B.shape[1], B.shape[2]
    if groups == 0 or heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups})")
    if state_dim > MAX_STATE_DIM:
        raise ValueError(f"state size up to {MAX_STATE_DIM}, got N={state_dim}")
    if dt.shape != (rows, heads) or A.shape != (heads,):
        raise ValueError(f"dt must be [{rows}, {heads}] and A [{heads}], got {tuple(dt.shape)}, {tuple(A.shape)}")
    if not (dt.dtype.is_floating_point if raw_dt else dt.dtype == torch.float32) or A.dtype != torch.float32:
        raise ValueError(f"dt and A must be float32, got {dt.dtype}, {A.dtype}")
    if not (x.dtype == B.dtype == C.dtype) or not x.dtype.is_floating_point:
        raise ValueError(f"x, B, C must share one floating dtype, got {x.dtype}, {B.dtype}, {C.dtype}")
    if len({t.device for t in (x, dt, A, B, C)}) != 1:
        raise ValueError("x, dt, A, B, C must be on one device")
    return rows, heads, head_dim, state_dim
