"""Packed streams through one of fla's chunked ops in its varlen form (B = 1 with cu_seqlens), shared by the fla
backends of gated_delta, kda and ssd: fla chunks from each stream's first row, so `align_grid` pads zero rows in
front to put its chunks on the absolute grid our naive versions use. With `dense_alone` one stream alone takes fla's
dense form (B = 1, no cu_seqlens) instead: the same chunks without the varlen form's host wait. An op passes it only
once its GPU test has shown the dense form's bits equal to the same stream's inside a pack (ssd:
test_ssd_gpu.py::test_gpu_fla_chunk_is_deterministic_and_batch_invariant)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from tensorfold.kernels.upload import ints

# Each step's stream bounds, uploaded once: every layer of the step passes fla the same tensor objects, so fla's
# identity-keyed cache (fla.utils.tensor_cache) computes its chunk indices once per step instead of once per layer,
# each of those a copy to the device that waits for the stream to drain.
_KEPT_BOUNDS = 8
_uploaded: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()


def chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None, bounds: list[int], starts: list[int], align_grid: bool,
                 grid: int, fla_op: Callable[..., tuple[torch.Tensor, torch.Tensor]], dense_alone: bool = False,
                 chunk_indices: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The N streams between `bounds` through `fla_op` (fla's chunked op, its op-specific keywords bound), called
    as fla_op(q, k, v, g, beta, initial_state=, cu_seqlens=, cu_seqlens_cpu=) on [1, T, ...] inputs (one stream
    with `dense_alone`: without the two cu_seqlens keywords); with `chunk_indices`, for an op that takes them, the
    (stream, chunk) pairs of its `grid`-row chunks too, so fla computes nothing from the bounds.

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
        out, final = fla_op(q[None], k[None], v[None], g[None], beta[None], initial_state=initial_state,
                            **uploaded_bounds(bounds, q.device, grid if chunk_indices else 0))
    out = out[0]
    if rows is not None:
        out = out[rows]
    return out.to(v.dtype), final


def uploaded_bounds(bounds: list[int], device: torch.device, grid: int) -> dict[str, torch.Tensor]:
    """fla's varlen keywords for `bounds` (and, with a `grid`, the chunk indices fla would derive from them): the
    same tensor objects for the same bounds, uploaded without a wait the first time."""
    key = (tuple(bounds), str(device), grid)
    if key in _uploaded:
        _uploaded.move_to_end(key)
        return _uploaded[key]
    kwargs = {"cu_seqlens": ints(bounds, torch.long, device), "cu_seqlens_cpu": torch.tensor(bounds, dtype=torch.long)}
    if grid:
        pairs = [v for n, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)) for i in range(-(-(b - a) // grid))
                 for v in (n, i)]
        kwargs["chunk_indices"] = ints(pairs, torch.long, device).view(-1, 2)
    _uploaded[key] = kwargs
    if len(_uploaded) > _KEPT_BOUNDS:
        _uploaded.popitem(last=False)
    return kwargs


def pad_in_front(q, k, v, g, beta, bounds: list[int], leads: list[int]):
    """Each stream's rows moved behind `lead` zero rows; returns the padded tensors, their bounds, and the index
    of the real rows in the padded layout."""
    padded_bounds, index = [0], []
    for n, lead in enumerate(leads):
        a, b = bounds[n], bounds[n + 1]
        base = padded_bounds[-1] + lead
        index.extend(range(base, base + b - a))
        padded_bounds.append(base + b - a)
    rows = ints(index, torch.long, q.device)
    total = padded_bounds[-1]

    def spread(t: torch.Tensor) -> torch.Tensor:
        full = t.new_zeros(total, *t.shape[1:])
        full[rows] = t
        return full

    return (*(spread(t) for t in (q, k, v, g, beta)), padded_bounds, rows)
