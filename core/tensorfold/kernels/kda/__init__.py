"""Kimi Delta Attention (KDA, the linear-attention mixer of GLM-5.3-Flash and Kimi Linear): chunked prefill over
packed streams and the in-place decode step.

    chunk_kda(q, k, v, g, beta, initial_state=None, start=0, *, cu_seqlens=None, starts=None,
              scale=1.0, qk_l2norm=False, backend=None)
        -> (out [T, H, DV], final_state [H, DK, DV] float32)            one stream's prefill chunk
        -> (out [T, H, DV], final_states [N, H, DK, DV] float32)        N streams packed (cu_seqlens)
    recurrent_kda_step(q, k, v, g, beta, states, slots, *, scale=1.0, qk_l2norm=False, backend=None)
        -> out [B, H, DV]                                                states[slots] updated in place
    kda_gate(f, b, A_log, dt_bias, lower_bound) -> (g [.., H, DK] float32, beta [.., H] float32)

The delta rule of kernels/gated_delta with a decay per key channel: g is [.., H, DK] (natural log, float32), not
[.., H]. q, k and v have the same H heads. Shapes and conventions are the naive module's. Which implementation
runs:

    backend   prefill (chunked)                         decode step
    naive     naive.py (any device; the CPU path)       naive.py
    fla       fla_backend.py (fla-core's chunk_kda)     fla_backend.py (gather, fla's fused_recurrent_kda,
              CUDA tensors only                         scatter; CUDA tensors only)

`backend=None` picks by device: CPU -> naive; CUDA -> fla when fla-core imports, else naive (as kernels/gated_delta
does for its prefill; there is no Triton KDA kernel of ours). Float32 models keep the exact naive form by passing
backend="naive" (the family decides, as tensorfold_qwen does for GDN). docs/kernels.md ("kda") records what fla
offers and what the H200 run must decide.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from tensorfold.kernels.kda import fla_backend, naive
from tensorfold.kernels.stream_args import check_pool, check_slots, check_streams

__all__ = ["BACKENDS", "chunk_backend", "chunk_kda", "kda_gate", "recurrent_kda_step", "step_backend"]

BACKENDS = ("naive", "fla")
MAX_HEAD_DIM = 256              # fla's chunked kernels stop there (DK); past it `backend=None` runs naive
FLA_STEP_IN_PLACE = True        # the fla decode step: gather/scatter (False) or fla's in-place pool kernel (True)
logger = logging.getLogger(__name__)


def chunk_backend(device: torch.device | str) -> str:
    """The prefill implementation `backend=None` picks on this device."""
    return "fla" if torch.device(device).type == "cuda" and fla_backend.available() else "naive"


def step_backend(device: torch.device | str) -> str:
    """The decode-step implementation `backend=None` picks on this device."""
    return "fla" if torch.device(device).type == "cuda" and fla_backend.available() else "naive"


@functools.cache
def _announce(op: str, device: str, backend: str) -> None:
    logger.info("kda %s on %s: %s", op, device, backend)


def _check_backend(backend: str | None, device: torch.device) -> None:
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "fla" and device.type != "cuda":
        raise ValueError(f"backend 'fla' runs fla-core's Triton kernels on CUDA tensors, got {device.type} tensors")


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None = None, start: int = 0, *,
              cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
              scale: float = 1.0, qk_l2norm: bool = False,
              backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked KDA over one stream's rows (a prefill chunk), or N streams' rows packed end to end.

    q, k [T, H, DK]; v [T, H, DV] (q, k, v one dtype); g [T, H, DK] float32; beta [T, H].
    One stream (cu_seqlens None): initial_state [H, DK, DV] float32 or None (zeros); `start` the absolute
    position of its first row (chunks of 64 sit on the absolute grid). Returns out [T, H, DV] in v's dtype and
    the final state [H, DK, DV] float32.
    N streams: cu_seqlens N+1 nondecreasing row offsets from 0 to T, as host ints; initial_state
    [N, H, DK, DV] or None; starts N absolute positions (None: all 0). Returns out [T, H, DV] and the final
    states [N, H, DK, DV].
    The naive version chunks on the absolute grid of 64 (from the start positions); fla chunks from each
    stream's first row (docs/kernels.md).
    """
    T, H, DK, DV = _check_rows(q, k, v, g, beta)
    cu_seqlens, starts = check_streams(T, (H, DK, DV), q.device, initial_state, start, cu_seqlens, starts)
    _check_backend(backend, q.device)
    if backend == "fla" and DK > MAX_HEAD_DIM:
        raise ValueError(f"backend 'fla' takes DK up to {MAX_HEAD_DIM}, got {DK}")
    chosen = backend or (chunk_backend(q.device) if DK <= MAX_HEAD_DIM else "naive")
    _announce("chunk", q.device.type, chosen)
    if chosen == "fla":
        return fla_backend.chunk_kda(q, k, v, g, beta, initial_state, int(start), cu_seqlens=cu_seqlens,
                                     starts=starts, scale=scale, qk_l2norm=qk_l2norm)
    return naive.chunk_kda(q, k, v, g, beta, initial_state, int(start), cu_seqlens=cu_seqlens, starts=starts,
                           scale=scale, qk_l2norm=qk_l2norm)


def recurrent_kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor | Sequence[int], *, scale: float = 1.0,
                       qk_l2norm: bool = False, backend: str | None = None) -> torch.Tensor:
    """One token for each of B streams; their states live in `slots` of the pool `states` and are updated in
    place (the other slots are untouched).

    q, k [B, H, DK]; v [B, H, DV]; g [B, H, DK] float32; beta [B, H]; states [S, H, DK, DV] float32,
    contiguous; slots [B] distinct (int tensor on the states' device, or host ints); a negative slot marks a
    padded row (no state read or written, out zero). Returns out [B, H, DV] in v's dtype.
    Slots on a CUDA device are checked (distinct, in range) only on the naive path, which reads them back anyway;
    the fla path reads nothing back (a check would sync).
    """
    B, H, DK, DV = _check_rows(q, k, v, g, beta)
    check_pool(states, (H, DK, DV), q.device)
    _check_backend(backend, q.device)
    chosen = backend or step_backend(q.device)
    host = check_slots(slots, B, states, read_back=chosen == "naive")
    _announce("step", q.device.type, chosen)
    if chosen == "fla":
        return fla_backend.recurrent_kda_step(q, k, v, g, beta, states, slots if host is None else host,
                                              scale=scale, qk_l2norm=qk_l2norm, in_place=FLA_STEP_IN_PLACE)
    return naive.recurrent_kda_step(q, k, v, g, beta, states, host, scale=scale, qk_l2norm=qk_l2norm)


def kda_gate(f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's gates from their raw projections, as HF's glm5_next computes them.

    f [.., H·DK] (f_b_proj(f_a_proj(x))), b [.., H] (b_proj(x)), A_log [H], dt_bias [H·DK]. With x = f + dt_bias
    in float32, per head h and channel: g = lower_bound · sigmoid(exp(A_log[h]) · x) (the "safe gate", in
    (lower_bound, 0)), or without a bound -exp(A_log[h]) · softplus(x) (softplus as log(1 + exp(x)), x past 20).
    beta = sigmoid(b) in b's dtype, then float32. Returns g [.., H, DK] float32 and beta [.., H] float32.
    """
    heads = A_log.shape[0]
    x = (f.float() + dt_bias.float()).unflatten(-1, (heads, -1))                 # [.., H, DK]
    rate = A_log.float().exp()[:, None]                                            # [H, 1]
    if lower_bound is not None:
        g = lower_bound * torch.sigmoid(rate * x)
    else:
        g = -rate * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    return g, torch.sigmoid(b).float()


def _check_rows(q, k, v, g, beta) -> tuple[int, int, int, int]:
    """Shapes, dtypes and devices of the per-row inputs; returns (rows, H, DK, DV)."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must be [rows, H, DK] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    rows, heads, k_dim = q.shape
    if v.dim() != 3 or v.shape[:2] != (rows, heads):
        raise ValueError(f"v must be [{rows}, {heads}, DV], got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must be [{rows}, {heads}, {k_dim}] (one decay per key channel), got {tuple(g.shape)}")
    if beta.shape != (rows, heads):
        raise ValueError(f"beta must be [{rows}, {heads}], got {tuple(beta.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if g.dtype != torch.float32:
        raise ValueError(f"g (log decay) must be float32, got {g.dtype}")
    if not beta.dtype.is_floating_point:
        raise ValueError(f"beta must be floating point, got {beta.dtype}")
    if len({t.device for t in (q, k, v, g, beta)}) != 1:
        raise ValueError("q, k, v, g, beta must be on one device")
    return rows, heads, k_dim, v.shape[2]
