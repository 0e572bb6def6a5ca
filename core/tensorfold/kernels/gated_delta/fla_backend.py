"""The gated delta rule through fla-core (flash-linear-attention's kernels), behind the naive module's contract.

fla is optional and imported lazily: `available()` says whether it can be used; without it the op's dispatch
falls back to our kernels (docs/kernels.md). What fla expects, read from fla-core 0.6.0
(fla/ops/gated_delta_rule/{chunk,fused_recurrent}.py):

    layout      [B, T, H, D]; variable lengths as B = 1 with `cu_seqlens` (LongTensor [N+1], on the device)
                and optionally `cu_seqlens_cpu` (the same on the host: saves a device->host sync)
    heads       q, k [.., H, K]; v [.., HV, V]; HV % H == 0, value head i reads key head i // (HV / H) (GVA,
                the same map as repeat_interleave)
    g           log decay (natural log) [B, T, HV]; the chunked kernels cumsum it per chunk in float32 and
                use exp2(cumsum / ln 2) (not exp); pass float32
    beta        [B, T, HV], after the sigmoid (use_beta_sigmoid_in_kernel=False)
    scale       multiplies q·k (None: K^-0.5, so the adapter always passes ours, default 1.0);
                use_qk_l2norm_in_kernel normalises q and k (x / sqrt(Σx² + 1e-6))
    state       initial_state [N, HV, K, V] (read, any dtype, as float32); the final state is a new float32
                tensor [N, HV, K, V] when output_final_state=True. Neither op updates a state in place.
    chunks      of 64 rows counted from each sequence's first row (relative to the call), not from an
                absolute position; `align_grid` below pads zero rows in front to put them on the absolute grid.
    output      the chunked op returns o in q's dtype, the recurrent one in v's dtype.
    dispatch    the chunked op goes through fla's backend registry: FlashQLA (package flash_qla, Hopper and
                Blackwell, bf16/fp16, K = V = 128) takes the call when installed unless FLA_FLASH_QLA=0; the
                intra-card split of long sequences runs only with FLA_INTRACARD_CP=1 under inference_mode.
                `environment()` reports what is installed and set.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from tensorfold.kernels.fla_import import FlaImport
from tensorfold.kernels.fla_varlen import chunk_varlen
from tensorfold.kernels.gated_delta.naive import CHUNK
from tensorfold.kernels.stream_args import as_packed

ENV_SWITCHES = ("FLA_FLASH_QLA", "FLA_INTRACARD_CP", "FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH",
                "FLA_USE_FAST_OPS", "FLA_CACHE_MODE", "FLA_CONFIG_DIR", "FLA_CACHE_RESULTS", "FLA_DISABLE_TENSOR_CACHE",
                "TRITON_F32_DEFAULT")

_FLA = FlaImport("fla.ops.gated_delta_rule", packages=("flash_qla", "tilelang"), switches=ENV_SWITCHES,
                 instead="backend='triton' or 'naive'")
_ops = _FLA.load                    # fla's gated delta rule module, or None (the reason in `import_error()`)
# These call fla's module up through the name `_ops`, so a test that stubs `_ops` stubs all four.
available, import_error, environment, _require = _FLA.functions(lambda: _ops())


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor | None = None, start: int = 0, *,
                      cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
                      scale: float = 1.0, qk_l2norm: bool = False,
                      align_grid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive module's chunk_gated_delta (one stream with a [NV, DK, DV] state, or N packed streams with
    [N, NV, DK, DV] states) through fla's chunk_gated_delta_rule.

    Always called in varlen form (B = 1 with cu_seqlens, even for one stream), so one stream alone and the same
    stream inside a batch run the same kernel specialisations. The start positions matter only with
    `align_grid`: each stream then gets start % 64 zero rows in front, putting fla's chunks on the absolute grid
    the naive version uses (a zero row changes nothing; it costs a copy of the inputs).
    """
    states, bounds, starts = as_packed(q.shape[0], initial_state, start, cu_seqlens, starts)
    fla_op = partial(_require().chunk_gated_delta_rule, scale=float(scale), output_final_state=True,
                     use_qk_l2norm_in_kernel=qk_l2norm)
    out, final = chunk_varlen(q, k, v, g, beta, states, bounds, starts, align_grid, CHUNK, fla_op, chunk_indices=True)
    return (out, final) if cu_seqlens is not None else (out, final[0])


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | Sequence[int], *,
                               scale: float = 1.0, qk_l2norm: bool = False) -> torch.Tensor:
    """The naive module's recurrent_gated_delta_step through fla's fused_recurrent_gated_delta_rule: B streams as
    the batch with T = 1. fla takes a state and returns a new one, so the slots' states are gathered before and
    scattered back after (two extra passes over the states)."""
    ops = _require()
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor(list(slots), dtype=torch.long)
    slots = slots.to(states.device, torch.long)
    initial = states.index_select(0, slots)                                        # [B, NV, DK, DV]
    out, final = ops.fused_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=float(scale),
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm)
    states.index_copy_(0, slots, final.to(states.dtype))
    return out[:, 0]
