"""Mamba2's SSD scan through fla-core's simple GLA, behind the naive module's contract.

SSD is simple GLA (linear attention with one scalar decay per head and row): q = C, k = B (repeated from its group to
the group's heads), v = x·dt, g = dt·A (natural-log decay), scale = 1. What fla expects, read from fla-core 0.6.0
(fla/ops/simple_gla/{chunk,fused_recurrent}.py, fla/ops/common/{chunk_h,chunk_o,fused_recurrent}.py):

    layout      [B, T, H, D]; variable lengths as B = 1 with `cu_seqlens` (LongTensor [S+1] on the device) and
                `cu_seqlens_cpu` (the same on the host: saves a device->host sync)
    heads       q, k, v all H heads (no groups): B and C are repeated to the heads here
    g           log decay [B, T, H]; the chunked op cumsums it per chunk in float32 (scaled by 1/ln 2, then exp2)
    state       `state_v_first=True` takes and returns states [S, H, V, K] = [S, H, P, N]: our layout, no transpose.
                initial_state is read as float32; the final state is a new float32 tensor. Nothing is in place.
    chunks      of 64 rows counted from each sequence's first row (relative to the call), not from an absolute
                position; `align_grid` pads start % 64 zero rows in front to put them on the absolute grid.
    precision   the per-chunk states are stored in k's dtype (bf16 for bf16 inputs) between fla's two kernels; the
                carried state is float32; the output comes back in q's dtype. v = x·dt is formed in float32 and
                rounded to x's dtype (one rounding the naive form does not have).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorfold.kernels.fla_import import FlaImport
from tensorfold.kernels.fla_varlen import chunk_varlen
from tensorfold.kernels.ssd.naive import CHUNK, heads_of
from tensorfold.kernels.stream_args import as_packed

ENV_SWITCHES = ("FLA_DISABLE_BACKEND_DISPATCH", "FLA_USE_FAST_OPS", "FLA_CACHE_MODE", "FLA_CONFIG_DIR",
                "FLA_CACHE_RESULTS", "FLA_DISABLE_TENSOR_CACHE", "TRITON_F32_DEFAULT")

_FLA = FlaImport("fla.ops.simple_gla", packages=("tilelang",), switches=ENV_SWITCHES,
                 instead="backend='naive' (prefill) or 'triton' (step)")
_ops = _FLA.load                    # fla's simple GLA module, or None (the reason in `import_error()`)
# These call fla's module up through the name `_ops`, so a test that stubs `_ops` stubs all four.
available, import_error, environment, _require = _FLA.functions(lambda: _ops())


def as_gla(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SSD's inputs as simple GLA's q, k, v (x's dtype, H heads) and g (float32 log decay), along their last dims."""
    heads = x.shape[-2]
    q, k = heads_of(C, heads, x.dtype), heads_of(B, heads, x.dtype)
    v = (x.float() * dt.float()[..., None]).to(x.dtype)
    g = dt.float() * A.float()
    return q, k, v, g


def chunk_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              initial_state: torch.Tensor | None = None, start: int = 0, *,
              cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
              align_grid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive module's chunk_ssd (one stream with an [H, P, N] state, or S packed streams with [S, H, P, N]
    states) through fla's chunk_simple_gla.

    Several streams go in fla's varlen form (B = 1 with cu_seqlens); one stream alone in its dense form, which gives
    the same bits on the GPU (test_ssd_gpu.py) without the varlen form's host wait. The start positions matter only
    with `align_grid`: each stream then gets start % 64 zero rows in front, putting fla's chunks on the absolute grid
    the naive version uses (a zero row changes nothing; it costs a copy of the inputs).
    """
    states, bounds, starts = as_packed(x.shape[0], initial_state, start, cu_seqlens, starts)
    T, H, P = x.shape
    if states is None:
        states = torch.zeros(len(bounds) - 1, H, P, B.shape[-1], dtype=torch.float32, device=x.device)
    ops = _require()

    def fla_op(q, k, v, g, _unused, **streams):
        return ops.chunk_simple_gla(q, k, v, g=g, scale=1.0, output_final_state=True, state_v_first=True,
                                    **streams)

    q, k, v, g = as_gla(x, dt, A, B, C)
    out, final = chunk_varlen(q, k, v, g, g, states, bounds, starts, align_grid, CHUNK, fla_op, dense_alone=True)
    out = out.to(x.dtype)
    return (out, final) if cu_seqlens is not None else (out, final[0])


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The naive module's ssd_step through fla's fused_recurrent_simple_gla: Bt streams as the batch with T = 1.
    fla takes a state and returns a new one, so the slots' states are gathered before and scattered back after (two
    extra passes over the states); no padded rows (negative slots)."""
    ops = _require()
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor(list(slots), dtype=torch.long)
    slots = slots.to(states.device, torch.long)
    q, k, v, g = as_gla(x, dt, A, B, C)
    initial = states.index_select(0, slots)                                        # [Bt, H, P, N]
    out, final = ops.fused_recurrent_simple_gla(q[:, None], k[:, None], v[:, None], g=g[:, None], scale=1.0,
                                                initial_state=initial, output_final_state=True, state_v_first=True)
    states.index_copy_(0, slots, final.to(states.dtype))
    return out[:, 0].to(x.dtype)
