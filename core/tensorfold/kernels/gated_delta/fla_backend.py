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

import functools
import importlib
import importlib.util
import os
from collections.abc import Sequence

import torch

from tensorfold.kernels.gated_delta.naive import CHUNK

ENV_SWITCHES = ("FLA_FLASH_QLA", "FLA_INTRACARD_CP", "FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH",
                "FLA_USE_FAST_OPS", "FLA_CACHE_MODE", "FLA_CONFIG_DIR", "FLA_CACHE_RESULTS", "FLA_DISABLE_TENSOR_CACHE",
                "TRITON_F32_DEFAULT")


_import_error: str | None = None


@functools.cache
def _ops():
    """fla's gated delta rule module, or None when fla cannot be imported (the reason in `import_error()`)."""
    global _import_error
    if importlib.util.find_spec("fla") is None:
        _import_error = "fla-core is not installed"
        return None
    try:
        return importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as error:                                                     # noqa: BLE001 (any import failure)
        _import_error = f"fla-core is installed but does not import: {error!r} (fla-core also needs einops)"
        return None


def available() -> bool:
    """fla-core is installed and its gated delta rule imports."""
    return _ops() is not None


def import_error() -> str | None:
    """Why fla cannot be used, or None when it can."""
    return None if available() else _import_error


def environment() -> dict[str, object]:
    """What decides which of fla's code paths runs: versions, optional packages, and the FLA_* switches."""
    info: dict[str, object] = {"fla": None, "fla_import_error": import_error()}
    if available():
        import fla
        info["fla"] = getattr(fla, "__version__", "?")
    for package in ("flash_qla", "tilelang"):
        info[package] = importlib.util.find_spec(package) is not None
    info["env"] = {name: os.environ[name] for name in ENV_SWITCHES if name in os.environ}
    return info


def _require():
    ops = _ops()
    if ops is None:
        reason = import_error() or "fla-core is not installed"
        raise RuntimeError(f"{reason}: pip install fla-core einops, or use backend='triton' or 'naive'")
    return ops


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
    if cu_seqlens is None:
        out, final = _chunk_streams(q, k, v, g, beta, None if initial_state is None else initial_state[None],
                                    [0, q.shape[0]], [start], scale, qk_l2norm, align_grid)
        return out, final[0]
    bounds = [int(c) for c in cu_seqlens]
    starts = [0] * (len(bounds) - 1) if starts is None else [int(s) for s in starts]
    return _chunk_streams(q, k, v, g, beta, initial_state, bounds, starts, scale, qk_l2norm, align_grid)


def _chunk_streams(q, k, v, g, beta, initial_state, bounds: list[int], starts: list[int], scale: float,
                   qk_l2norm: bool, align_grid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ops = _require()
    heads, k_dim, v_dim = v.shape[1], q.shape[-1], v.shape[-1]
    if initial_state is None:
        initial_state = torch.zeros(len(bounds) - 1, heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    rows = None
    leads = [s % CHUNK for s in starts]
    if align_grid and any(leads):
        q, k, v, g, beta, bounds, rows = _pad_in_front(q, k, v, g, beta, bounds, leads)
    cu_cpu = torch.tensor(bounds, dtype=torch.long)
    out, final = ops.chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=float(scale), initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm,
        cu_seqlens=cu_cpu.to(q.device, non_blocking=True), cu_seqlens_cpu=cu_cpu)
    out = out[0]
    if rows is not None:
        out = out[rows]
    return out.to(v.dtype), final


def _pad_in_front(q, k, v, g, beta, bounds: list[int], leads: list[int]):
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
