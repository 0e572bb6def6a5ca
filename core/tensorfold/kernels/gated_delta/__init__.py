"""The gated delta rule (Gated DeltaNet's mixer): chunked prefill over packed streams and the in-place decode step.

    chunk_gated_delta(q, k, v, g, beta, initial_state=None, start=0, *, cu_seqlens=None, starts=None,
                      scale=1.0, qk_l2norm=False, backend=None)
        -> (out [T, NV, DV], final_state [NV, DK, DV] float32)          one stream's prefill chunk
        -> (out [T, NV, DV], final_states [N, NV, DK, DV] float32)      N streams packed (cu_seqlens)
    recurrent_gated_delta_step(q, k, v, g, beta, states, slots, *, scale=1.0, qk_l2norm=False, backend=None)
        -> out [B, NV, DV]                                               states[slots] updated in place

Shapes and conventions are the naive module's: q, k as tensorfold_qwen.gdn prepares them (l2-normalised, q
scaled) unless qk_l2norm / scale say otherwise; NK key heads with NV % NK == 0 (NK = NV: already repeated);
g natural-log decay, float32; beta after the sigmoid; float32 states [.., NV, DK, DV], key-major. Which
implementation runs:

    backend   prefill (chunked)                         decode step
    naive     naive.py (any device; the CPU path)       naive.py
    triton    naive.py                                  triton_recurrent.py (ours, in place)
    fla       fla_backend.py (fla-core)                 fla_backend.py (gather, fla, scatter)

`backend=None` picks by device: CPU -> naive; CUDA -> fla when fla-core imports, else triton (decode) and naive
(prefill). docs/kernels.md records why and what was measured.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import pick_chunk, pick_step
from tensorfold.kernels.gated_delta import fla_backend, naive
from tensorfold.kernels.stream_args import check_pool, check_slots, check_state, check_streams

__all__ = ["BACKENDS", "chunk_backend", "chunk_gated_delta", "gate_terms", "gdn_gate", "gdn_gate_from_terms",
           "recurrent_gated_delta_step", "recurrent_gated_delta_step_gated", "step_backend"]

BACKENDS = ("naive", "triton", "fla")
MAX_HEAD_DIM = 256              # fla's chunked kernels stop there; ours keep a [DK, 32] state block per program
logger = logging.getLogger(__name__)


def chunk_backend(device: torch.device | str) -> str:
    """The prefill implementation `backend=None` picks on this device."""
    return pick_chunk(device, fla_backend.available)


def step_backend(device: torch.device | str) -> str:
    """The decode-step implementation `backend=None` picks on this device."""
    return pick_step(device, fla_backend.available)


@functools.cache
def _announce(op: str, device: str, backend: str) -> None:
    logger.info("gated delta %s on %s: %s", op, device, backend)


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor | None = None, start: int = 0, *,
                      cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
                      scale: float = 1.0, qk_l2norm: bool = False,
                      backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked delta rule over one stream's rows (a prefill chunk), or N streams' rows packed end to end.

    q, k [T, NK, DK]; v [T, NV, DV] (q, k, v one dtype); g [T, NV] float32; beta [T, NV].
    One stream (cu_seqlens None): initial_state [NV, DK, DV] float32 or None (zeros); `start` the absolute
    position of its first row. Returns out [T, NV, DV] in v's dtype and the final state [NV, DK, DV] float32.
    N streams: cu_seqlens N+1 nondecreasing row offsets from 0 to T, as host ints; initial_state
    [N, NV, DK, DV] or None; starts N absolute positions (None: all 0). Returns out [T, NV, DV] and the final
    states [N, NV, DK, DV].
    The naive version chunks on the absolute grid of 64 (from the start positions); fla chunks from each
    stream's first row (docs/kernels.md).
    """
    T, NK, DK, NV, DV = _check_rows(q, k, v, g, beta)
    cu_seqlens, starts = check_streams(T, (NV, DK, DV), q.device, initial_state, start, cu_seqlens, starts)
    chosen = backend or chunk_backend(q.device)
    _announce("chunk", q.device.type, chosen)
    if chosen == "fla":
        return fla_backend.chunk_gated_delta(q, k, v, g, beta, initial_state, start, cu_seqlens=cu_seqlens,
                                             starts=starts, scale=scale, qk_l2norm=qk_l2norm)
    if chosen in ("naive", "triton"):
        return naive.chunk_gated_delta(q, k, v, g, beta, initial_state, start, cu_seqlens=cu_seqlens,
                                       starts=starts, scale=scale, qk_l2norm=qk_l2norm)
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | Sequence[int], *,
                               scale: float = 1.0, qk_l2norm: bool = False,
                               backend: str | None = None) -> torch.Tensor:
    """One token for each of B streams; their states live in `slots` of the pool `states` and are updated in
    place (the other slots are untouched).

    q, k [B, NK, DK]; v [B, NV, DV]; g [B, NV] float32; beta [B, NV]; states [S, NV, DK, DV] float32,
    contiguous; slots [B] distinct (int tensor on the states' device, or host ints); a negative slot marks a
    padded row (no state read or written, out zero; not on the fla backend). Returns out [B, NV, DV] in v's
    dtype. Distinctness is checked only for host slots (a device check would sync).
    """
    B, NK, DK, NV, DV = _check_rows(q, k, v, g, beta)
    check_pool(states, (NV, DK, DV), q.device)
    host = check_slots(slots, B, states, read_back=False)
    chosen = backend or step_backend(q.device)
    _announce("step", q.device.type, chosen)
    if chosen == "naive":
        return naive.recurrent_gated_delta_step(q, k, v, g, beta, states, slots, scale=scale, qk_l2norm=qk_l2norm)
    if chosen == "triton":
        from tensorfold.kernels.gated_delta import triton_recurrent
        return triton_recurrent.recurrent_gated_delta_step(q, k, v, g, beta, states, slots, scale=scale,
                                                           qk_l2norm=qk_l2norm)
    if chosen == "fla":
        if host is not None and any(s < 0 for s in host):
            raise ValueError("the fla backend takes no padded rows (negative slots)")
        return fla_backend.recurrent_gated_delta_step(q, k, v, g, beta, states, slots, scale=scale,
                                                      qk_l2norm=qk_l2norm)
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def gdn_gate(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gate from its raw projections: g = -exp(A_log)·softplus(a + dt_bias) (float32) and
    beta = sigmoid(b) (in b's dtype, then float32), as the models compute them."""
    return gdn_gate_from_terms(a, b, *gate_terms(A_log, dt_bias))


def gate_terms(A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's per-layer factors, -exp(A_log) and dt_bias in float32 ([NV] each): a model computes them once
    at load, on the device its steps run on, so a step's gate costs none of their launches."""
    return -A_log.float().exp(), dt_bias.float()


def gdn_gate_from_terms(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, bias: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_gate` with its per-layer factors from `gate_terms`, the same bits: a + bias promotes a to float32
    exactly inside the add (no separate cast), then the same float32 sum, softplus and product."""
    if decay.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"decay and bias must be float32 (gate_terms), got {decay.dtype}, {bias.dtype}")
    g = decay * F.softplus(a + bias)
    return g, torch.sigmoid(b).float()


def recurrent_gated_delta_step_gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                     b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                     states: torch.Tensor, slots: torch.Tensor, *, scale: float,
                                     backend: str | None = None) -> torch.Tensor:
    """The decode step straight from a GDN layer's projections, q and k l2-normalised in the kernel, the gate
    (gdn_gate) computed in it: one launch where the unfused form takes a dozen small ones.

    q, k [B, NK, DK], v [B, NV, DV] (one dtype, raw conv outputs); a, b [B, NV] (raw projections); A_log,
    dt_bias [NV]; states and slots as in `recurrent_gated_delta_step`. Returns out [B, NV, DV] in v's dtype.
    """
    if a.shape != (q.shape[0], v.shape[1]) or b.shape != a.shape:
        raise ValueError(f"a and b must be [{q.shape[0]}, {v.shape[1]}], got {tuple(a.shape)}, {tuple(b.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (v.shape[1],) or t.device != q.device:
            raise ValueError(f"{name} must be [{v.shape[1]}] on {q.device}, got {tuple(t.shape)} on {t.device}")
    chosen = backend or step_backend(q.device)
    if chosen == "triton":
        _check_rows(q, k, v, a, b, raw_gate=True)
        check_state(states, (None, v.shape[1], q.shape[2], v.shape[2]), q.device, "states")
        from tensorfold.kernels.gated_delta import triton_recurrent
        return triton_recurrent.recurrent_gated_delta_step(q, k, v, a, b, states, slots, scale=scale,
                                                           qk_l2norm=True, gate=(A_log, dt_bias))
    g, beta = gdn_gate(a, b, A_log, dt_bias)
    return recurrent_gated_delta_step(q, k, v, g, beta, states, slots, scale=scale, qk_l2norm=True, backend=chosen)


def _check_rows(q, k, v, g, beta, raw_gate: bool = False) -> tuple[int, int, int, int, int]:
    """Shapes, dtypes and devices of the per-row inputs; returns (rows, NK, DK, NV, DV)."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must be [rows, NK, DK] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    rows, heads_k, k_dim = q.shape
    if v.dim() != 3 or v.shape[0] != rows:
        raise ValueError(f"v must be [{rows}, NV, DV], got {tuple(v.shape)}")
    heads_v, v_dim = v.shape[1], v.shape[2]
    if heads_k == 0 or heads_v % heads_k:
        raise ValueError(f"value heads ({heads_v}) must be a multiple of key heads ({heads_k})")
    if max(k_dim, v_dim) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM}, got DK={k_dim}, DV={v_dim}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (rows, heads_v):
            raise ValueError(f"{name} must be [{rows}, {heads_v}], got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if g.dtype != torch.float32 and not raw_gate:
        raise ValueError(f"g (log decay) must be float32, got {g.dtype}")
    if not beta.dtype.is_floating_point:
        raise ValueError(f"beta must be floating point, got {beta.dtype}")
    if len({t.device for t in (q, k, v, g, beta)}) != 1:
        raise ValueError("q, k, v, g, beta must be on one device")
    return rows, heads_k, k_dim, heads_v, v_dim
