"""Packed streams through one of fla's chunked ops in its varlen form (B = 1 with cu_seqlens), shared by the fla
backends of gated_delta, kda and ssd: fla chunks from each stream's first row, so `align_grid` pads zero rows in
front to put its chunks on the absolute grid our naive versions use. With `dense_alone` one stream alone takes fla's
dense form (B = 1, no cu_seqlens) instead: the same chunks without the varlen form's host wait. An op passes it only
once its GPU test has shown the dense form's bits equal to the same stream's inside a pack (ssd:
test_ssd_gpu.py::test_gpu_fla_chunk_is_deterministic_and_batch_invariant)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None, bounds: list[int], starts: list[int], align_grid: bool,
                 grid: int, fla_op: Callable[..., tuple[torch.Tensor, torch.Tensor]], dense_alone: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The N streams between `bounds` through `fla_op` (fla's chunked op, its op-specific keywords bound), called
    as fla_op(q, k, v, g, beta, initial_state=, cu_seqlens=, cu_seqlens_cpu=) on [1, T, ...] inputs (one stream
    with `dense_alone`: without the two cu_seqlens keywords).

    initial_state [N, H, DK, DV] or None (zeros, float32). With `align_grid` each stream gets start % grid zero
    rows in front (a zero row changes nothing; it costs a copy of the inputs). Returns out [T, H, DV] in v's dtype
    and fla's final states.
    """
    heads, k_dim, v_dim = v.shape[1], q.shape[-1], v.shape[-1]
    if initial_state is None:
        initial_state = torch.zeros(len(bounds) - 1, heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    rows = None
    leads = [s % grid for s in starts]
    if align_grid and any(leads):
        q, k, v, g, beta, bounds, rows = pad_in_front(q, k, v, g, beta, bounds, leads)
    if dense_alone and len(bounds) == 2:
        # One stream: fla's dense form (B = 1, no cu_seqlens) chunks from the same first row, and its varlen form
        # reads a device value back per call (chunk_fwd_h's split offsets), a host wait per layer.
        out, final = fla_op(q[None], k[None], v[None], g[None], beta[None], initial_state=initial_state)
    else:
        cu_cpu = torch.tensor(bounds, dtype=torch.long)
        out, final = fla_op(q[None], k[None], v[None], g[None], beta[None], initial_state=initial_state,
                            cu_seqlens=cu_cpu.to(q.device, non_blocking=True), cu_seqlens_cpu=cu_cpu)
    out = out[0]
    if rows is not None:
        out = out[rows]
    return out.to(v.dtype), final


def pad_in_front(q, k, v, g, beta, bounds: list[int], leads: list[int]):
    """Each stream's rows moved behind `lead` zero rows; returns the padded tensors, their bounds, and the index
    of the real rows in the padded layout."""
    padded_bounds, index = [0], []
    for n, lead in enumerate(leads):
        a, b = bounds[n], bounds[n + 1]
        base = padded_bounds[-1] + lead
        index.extend(range(base, base + b - a))
        padded_bounds.append(base + b - a)
    rows = torch.tensor(index, dtype=torch.long).to(q.device, non_blocking=True)
    total = padded_bounds[-1]

    def spread(t: torch.Tensor) -> torch.Tensor:
        full = t.new_zeros(total, *t.shape[1:])
        full[rows] = t
        return full

    return (*(spread(t) for t in (q, k, v, g, beta)), padded_bounds, rows)
