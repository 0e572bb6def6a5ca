"""Mamba2's state-space duality (SSD) scan in plain torch: the reference every fast version is measured against, and
the CPU path.

    S_t = exp(dt_t·A) S_{t-1} + (dt_t·x_t) ⊗ B_t          state S [P, N] per head
    y_t = S_t C_t

Conventions (those of HF transformers' mamba2 / nemotron_h torch_forward):
    x       [T, H, P]: H heads of head dim P (the conv output's x part)
    dt      [T, H] float32, already softplus'd (+ dt_bias) and clamped to the time step limit
    A       [H] float32, negative (-exp(A_log))
    B, C    [T, G, N]: G groups with H % G == 0, head h reads group h // (H / G) (= repeat_interleave)
    state   [H, P, N] per stream, float32 (head-dim-major, the layout of HF's cache and mamba_ssm's)
    y       excludes the D skip and the gating (the family adds those); math in float32, y in x's dtype.

The chunked form runs on the absolute position grid of CHUNK rows (counted from position 0, not from the call's first
row), so a prefill split at a grid cut gives bit for bit the y and state of one call over the whole. Every stream runs
on its own (a loop), so a stream's bits never depend on the others in the call.

Shapes: T rows of one call (all streams packed), S streams or pool slots, Bt rows of a decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tensorfold.kernels.per_stream import each_slot
from tensorfold.kernels.stream_args import as_packed

CHUNK = 64          # the chunked form's block, on the absolute position grid (fla's chunk size, so align_grid fits)


def heads_of(t: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """B or C [..., G, N] -> [..., H, N] in `dtype`: each group repeated to its heads."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2).to(dtype)


def chunk_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              initial_state: torch.Tensor | None = None, start: int = 0, *,
              cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
              math_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan over one stream's rows, or S streams' rows packed one after another.

    x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N].
    One stream (cu_seqlens None): initial_state [H, P, N] or None (zeros); `start` the absolute position of the first
    row, which places the chunks on the grid of CHUNK rows. Returns y [T, H, P] in x's dtype and the final state.
    S streams: cu_seqlens S+1 row offsets; initial_state [S, H, P, N] or None; starts S positions (None: 0).
    Returns y [T, H, P] and the final states [S, H, P, N].
    States come out in `math_dtype` (float32; float64 gives a truth to measure the fast versions against).
    """
    T, H, P = x.shape
    N = B.shape[-1]
    states, bounds, starts = as_packed(T, initial_state, start, cu_seqlens, starts)
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        state = (torch.zeros(H, P, N, dtype=math_dtype, device=x.device) if states is None
                 else states[n].to(math_dtype))
        if a == b:                                                                 # an empty stream keeps its state
            outs.append(x.new_zeros(0, H, P, dtype=math_dtype))
            finals.append(state.clone())
            continue
        g = dt[a:b].to(math_dtype) * A.to(math_dtype)                              # [L, H] log decay
        xdt = x[a:b].to(math_dtype) * dt[a:b].to(math_dtype)[..., None]            # [L, H, P]
        y, final = chunked(xdt, g, heads_of(B[a:b], H, math_dtype), heads_of(C[a:b], H, math_dtype), state,
                           starts[n])
        outs.append(y)
        finals.append(final)
    out, final = torch.cat(outs).to(x.dtype), torch.stack(finals)
    return (out, final) if cu_seqlens is not None else (out, final[0])


def chunked(xdt: torch.Tensor, g: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor,
            start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One stream's T >= 1 rows in chunks of CHUNK on the absolute grid. xdt [T, H, P] (x·dt); g [T, H] (dt·A);
    B, C [T, H, N]; state [H, P, N] (read only). Returns y [T, H, P] and the final state.

    Rows are padded with zeros in front (start % CHUNK) and behind up to the grid; a zero row (xdt = 0, g = 0, B = C
    = 0) leaves the state and every other row's output exactly as they were.
    """
    T = xdt.shape[0]
    lead = start % CHUNK
    trail = -(lead + T) % CHUNK

    def blocks(t: torch.Tensor) -> torch.Tensor:                                   # [T, H, ...] -> [H, n, CHUNK, ...]
        t = F.pad(t, [0, 0] * (t.dim() - 1) + [lead, trail])
        return t.reshape(-1, CHUNK, *t.shape[1:]).movedim(2, 0)

    y, final = ssd_blocks(blocks(xdt), blocks(g), blocks(B), blocks(C), state)
    heads, head_dim = y.shape[0], y.shape[-1]
    y = y.movedim(0, 2).reshape(-1, heads, head_dim)                               # [n·CHUNK, H, P]
    return y[lead: lead + T], final


def ssd_blocks(xdt: torch.Tensor, g: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (SSD) scan, block by block. xdt [H, n, L, P]; g [H, n, L]; B, C [H, n, L, N]; state [H, P, N].
    Returns y [H, n, L, P] and the final state [H, P, N].

    Every op runs on one block's fixed shape (never batched over the n blocks), so a block's bits cannot depend on
    how many blocks the call holds, whatever the matmul library picks per shape: resumption at a grid cut is
    bitwise on any device that is deterministic per shape.
    """
    s = state.to(xdt.dtype)
    y = torch.empty_like(xdt)
    for n in range(xdt.shape[1]):
        y[:, n], s = ssd_block(xdt[:, n], g[:, n], B[:, n], C[:, n], s)
    return y, s


def ssd_block(xdt: torch.Tensor, g: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block. xdt [H, L, P]; g [H, L]; B, C [H, L, N]; s [H, P, N] the state entering it. Returns y [H, L, P]
    and the state leaving it.

    With G_i the cumulative log decay up to row i and Γ_ij = exp(G_i - G_j) for j <= i (0 above):
        y = exp(G)·C Sᵀ + (C Bᵀ ∘ Γ) xdt;   S <- exp(G_L) S + (xdt·exp(G_L - G))ᵀ B
    """
    L = xdt.shape[1]
    lower = torch.ones(L, L, dtype=torch.bool, device=xdt.device).tril()          # j <= i
    cumulative = g.cumsum(-1)                                                      # [H, L]
    gaps = (cumulative[:, :, None] - cumulative[:, None, :]).masked_fill(~lower, float("-inf"))
    scores = (C @ B.transpose(-1, -2)) * gaps.exp()                                # [H, L, L]
    y = scores @ xdt + (C * cumulative.exp()[..., None]) @ s.transpose(-1, -2)     # [H, L, P]
    x_to_end = xdt * (cumulative[:, -1:] - cumulative).exp()[..., None]            # [H, L, P]
    s = s * cumulative[:, -1].exp()[:, None, None] + x_to_end.transpose(-1, -2) @ B
    return y, s


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """One token for each of Bt streams whose states live in `slots` of a pool, updated in place.

    x [Bt, H, P]; dt [Bt, H]; A [H]; B, C [Bt, G, N]; states [S, H, P, N] (its dtype is the math dtype, float32);
    slots [Bt] distinct, negative for a padded row (y zero, no state touched). Returns y [Bt, H, P] in x's dtype.
    """
    heads, dtype = x.shape[1], states.dtype

    def one(i: int, state: torch.Tensor) -> torch.Tensor:
        return recurrent_step(x[i].to(dtype), dt[i].to(dtype), A.to(dtype), heads_of(B[i], heads, dtype),
                              heads_of(C[i], heads, dtype), state)

    return each_slot(x, states, slots, one)


def time_steps(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """The raw dt [Bt, H] (in_proj's output) -> float32 clamp(softplus(dt + dt_bias), dt_min, dt_max), the family's
    time step (torch's softplus: beta 1, threshold 20)."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min, max=dt_max)


def d_skip(y: torch.Tensor, D: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y + D·x in float32 (y as the step returned it, in x's dtype): y [Bt, H, P], D [H], x [Bt, H, P]."""
    return y.float() + D.float()[:, None] * x.float()


def ssd_step_gated(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | Sequence[int], *,
                   dt_min: float, dt_max: float) -> torch.Tensor:
    """The family's decode glue around the step, unfused: time_steps, ssd_step (y in x's dtype), d_skip. dt [Bt, H]
    raw; dt_bias, D [H]. Returns y_skip [Bt, H, P] float32 (a padded row: y zero, so D·x)."""
    y = ssd_step(x, time_steps(dt, dt_bias, dt_min, dt_max), A, B, C, states, slots)
    return d_skip(y, D, x)


def recurrent_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of one stream. x [H, P]; dt, A [H]; B, C [H, N]; state [H, P, N] in place. Returns y [H, P]."""
    state.mul_((dt * A).exp()[:, None, None])                                      # decay
    state.add_((x * dt[:, None])[:, :, None] * B[:, None, :])                      # S += (x·dt) ⊗ B
    return (state * C[:, None, :]).sum(-1)                                         # S C


def recurrent_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  initial_state: torch.Tensor | None = None,
                  math_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One stream token by token (the recurrence as written): the tests' second reference for the chunked form.
    x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N]; initial_state [H, P, N] or None. Returns y in x's dtype and
    the final state in `math_dtype`."""
    T, H, P = x.shape
    state = (torch.zeros(H, P, B.shape[-1], dtype=math_dtype, device=x.device) if initial_state is None
             else initial_state.to(math_dtype).clone())
    y = torch.empty(T, H, P, dtype=math_dtype, device=x.device)
    for t in range(T):
        y[t] = recurrent_step(x[t].to(math_dtype), dt[t].to(math_dtype), A.to(math_dtype),
                              heads_of(B[t], H, math_dtype), heads_of(C[t], H, math_dtype), state)
    return y.to(x.dtype), state
