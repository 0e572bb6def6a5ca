"""Kimi Delta Attention through fla-core (flash-linear-attention's kernels), behind the naive module's contract.

fla is optional and imported lazily: `available()` says whether it can be used; without it the op's dispatch
falls back to the naive version (docs/kernels.md, "kda"). What fla expects, read from fla-core 0.6.0
(fla/ops/kda/{chunk,chunk_fwd,chunk_intra,fused_recurrent}.py):

    layout      [B, T, H, D]; variable lengths as B = 1 with `cu_seqlens` (LongTensor [N+1], on the device)
                and `cu_seqlens_cpu` (the same on the host: saves a device->host sync)
    heads       q, k [.., H, K]; v [.., HV, V]; HV % H == 0 (GVA). Ours have H = HV.
    g           [B, T, HV, K], the natural-log decay per key channel, already computed: use_gate_in_kernel=False
                (True would take the raw projection and apply fla's -exp(A_log)·softplus(g + dt_bias) or
                lower_bound·sigmoid(exp(A_log)·(g + dt_bias)) itself). The chunked kernels cumsum g per chunk in
                float32, times 1/ln 2, and use exp2; the recurrent kernel uses exp(g). Pass float32.
    safe_gate   False (default here): the intra-chunk scores use the pairwise exp2(G_i - G_j) (<= 1), exact for any
                decay, like the naive version. True factorises exp2(G_i - C)·exp2(C - G_j) around a reference C to
                use tensor cores on the 16x16 diagonal blocks: only valid for gates bounded below (fla's bound is
                -5: exp(C - G) reaches e^60; a per-step decay below about -6.9 overflows float32). Offered here for
                the bench, not through the public op.
    beta        [B, T, HV], after the sigmoid (use_beta_sigmoid_in_kernel=False)
    scale       multiplies q (None means K^-0.5, so the adapter always passes ours, default 1.0);
                use_qk_l2norm_in_kernel normalises q and k as x / sqrt(Σx² + 1e-6) (the chunked op stores the
                normalised q, k in the input dtype; the recurrent kernel keeps them in float32 registers)
    state       [N, HV, K, V] key-major (state_v_first=False), the layout of ours; initial_state must be float32
                (asserted); the final state is a new float32 tensor. chunk_kda never updates a state in place;
                the recurrent kernel can (fused_recurrent_kda_fwd with ssm_state_indices and
                inplace_final_state=True, vLLM-style; the public fused_recurrent_kda always returns a new state).
    chunks      of 64 rows counted from each sequence's first row (relative to the call), not from an absolute
                position; `align_grid` below pads zero rows in front to put them on the absolute grid.
    output      the chunked op returns o in q's dtype, the recurrent one in v's dtype (ours: one dtype for both).
    head dims   K <= 256 (asserted by fla).
    dispatch    chunk_kda goes through fla's backend registry: FlashKDA (package flash_kda) takes the call only
                with use_gate_in_kernel, use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel, safe_gate and
                state_v_first all set — never with the prepared g this adapter passes; the intra-card split of
                long sequences (FLA_INTRACARD_CP=1 under inference_mode) applies to the state pass, as for the
                gated delta rule. `environment()` reports what is installed and set.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from tensorfold.kernels.fla_import import FlaImport
from tensorfold.kernels.fla_varlen import chunk_varlen
from tensorfold.kernels.kda.naive import CHUNK
from tensorfold.kernels.stream_args import as_packed

ENV_SWITCHES = ("FLA_FLASH_KDA", "FLA_INTRACARD_CP", "FLA_INTRACARD_MAX_SPLITS", "FLA_TILELANG",
                "FLA_DISABLE_BACKEND_DISPATCH", "FLA_USE_FAST_OPS", "FLA_CACHE_MODE", "FLA_CONFIG_DIR",
                "FLA_CACHE_RESULTS", "FLA_DISABLE_TENSOR_CACHE", "FLA_TENSOR_CACHE_SIZE", "TRITON_F32_DEFAULT")

_FLA = FlaImport("fla.ops.kda", packages=("flash_kda", "tilelang"), switches=ENV_SWITCHES, instead="backend='naive'")
_ops = _FLA.load                    # fla's KDA module, or None (the reason in `import_error()`)
# These call fla's module up through the name `_ops`, so a test that stubs `_ops` stubs all four.
available, import_error, environment, _require = _FLA.functions(lambda: _ops())


# ---------------------------------------------------------------- prefill: fla's chunk_kda


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None = None, start: int = 0, *,
              cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
              scale: float = 1.0, qk_l2norm: bool = False, align_grid: bool = False,
              safe_gate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive module's chunk_kda (one stream with a [H, DK, DV] state, or N packed streams with
    [N, H, DK, DV] states) through fla's chunk_kda.

    Always called in varlen form (B = 1 with cu_seqlens, even for one stream), so one stream alone and the same
    stream inside a batch run the same kernel specialisations. The start positions matter only with
    `align_grid`: each stream then gets start % 64 zero rows in front, putting fla's chunks (and their 16-row
    sub-chunks) on the absolute grid the naive version uses (a zero row, k = v = q = g = beta = 0, changes
    neither the state nor another row's output; it costs a copy of the inputs and up to 63 rows per stream).
    `safe_gate` is fla's tensor-core path for gates in [-5, 0) (module docstring); off by default.
    """
    states, bounds, starts = as_packed(q.shape[0], initial_state, int(start), cu_seqlens, starts)
    ops = _require()
    if bounds[-1] == 0:                                                            # no rows at all: nothing to run
        heads, k_dim, v_dim = v.shape[1], q.shape[-1], v.shape[-1]
        final = (torch.zeros(len(bounds) - 1, heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
                 if states is None else states.to(torch.float32, copy=True))
        out = v.new_zeros(0, heads, v_dim)
    else:
        fla_op = partial(ops.chunk_kda, scale=float(scale), output_final_state=True,
                         use_qk_l2norm_in_kernel=qk_l2norm, use_gate_in_kernel=False,
                         use_beta_sigmoid_in_kernel=False, safe_gate=safe_gate, state_v_first=False)
        out, final = chunk_varlen(q, k, v, g, beta, states, bounds, starts, align_grid, CHUNK, fla_op)
    return (out, final) if cu_seqlens is not None else (out, final[0])


# ---------------------------------------------------------------- decode: fla's recurrent kernel


def recurrent_kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor | Sequence[int], *, scale: float = 1.0,
                       qk_l2norm: bool = False, in_place: bool = False) -> torch.Tensor:
    """The naive module's recurrent_kda_step through fla's recurrent KDA kernel: B streams, one token each;
    states[slots] updated, the other slots untouched; a negative slot is a padded row (out zero, no slot
    changed). Nothing reads device data back to the host, so the step can be captured in a CUDA graph.

    in_place=False (default): the public fused_recurrent_kda on states gathered by slot, then scattered back
    (two extra passes over the B states). in_place=True: fla's pool kernel (fused_recurrent_kda_fwd with
    ssm_state_indices and inplace_final_state=True) reads and writes each stream's slot directly; padded rows are
    sorted behind the live ones and given zero length, which the kernel skips. Both run one program per (stream,
    head, 32 value columns) with one fixed config (no autotuning), so a stream's bits do not depend on the batch.
    """
    ops = _require()
    batch, heads, v_dim = v.shape
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor([int(s) for s in slots], dtype=torch.long)
    slots = slots.to(states.device, torch.long)
    if batch == 0 or states.shape[0] == 0:                                         # nothing live can be here
        return v.new_zeros(batch, heads, v_dim)
    live = slots >= 0
    if in_place:
        return _step_in_place(q, k, v, g, beta, states, slots, live, scale, qk_l2norm)
    # A padded row reads and writes back a stand-in slot: that of the first live row, written with the value that
    # row leaves there (so the duplicate write stores the same bits), or slot 0 rewritten unchanged when no row is
    # live. Chosen on the device: no sync.
    first = torch.argmax(live.to(torch.int8)).reshape(1)                          # first live row (0 when none)
    any_live = live.any()
    lead = slots.index_select(0, first)[0]                # by index_select: a 0-d tensor index would read it back
    stand_in = torch.where(any_live, lead, torch.zeros_like(lead))
    index = torch.where(live, slots, stand_in)
    initial = states.index_select(0, index)                                        # [B, H, DK, DV]
    out, final = ops.fused_recurrent_kda(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=float(scale),
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm)
    final = final.to(states.dtype)
    after = torch.where(any_live, final.index_select(0, first)[0], initial.index_select(0, first)[0])   # stand-in
    final = torch.where(live[:, None, None, None], final, after)
    states.index_copy_(0, index, final)
    return torch.where(live[:, None, None], out[:, 0], torch.zeros((), dtype=out.dtype, device=out.device))


def _step_in_place(q, k, v, g, beta, states, slots, live, scale: float, qk_l2norm: bool) -> torch.Tensor:
    """fla's pool kernel: the B rows as B varlen sequences of length 1 (live) or 0 (padded, sorted last)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    batch = v.shape[0]
    order = torch.argsort((~live).to(torch.int8), stable=True)                    # live rows first, in order
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.long, device=v.device)
    cu_seqlens[1:] = torch.cumsum(live[order].to(torch.long), 0)                  # row n: [n, n+1) or empty
    q, k, v, g, beta = (t.index_select(0, order).contiguous()[None] for t in (q, k, v, g, beta))
    sorted_out = torch.zeros_like(v)                                               # padded rows stay zero
    fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, scale=float(scale), initial_state=states, output_final_state=False,
        inplace_final_state=True, cu_seqlens=cu_seqlens, ssm_state_indices=slots.index_select(0, order),
        use_qk_l2norm_in_kernel=qk_l2norm, out=sorted_out)
    out = torch.empty_like(sorted_out[0])
    out.index_copy_(0, order, sorted_out[0])
    return out
