"""Mamba2, Nemotron-H's recurrent mixer, for one stream and one step.

    [z | xBC | dt] = in_proj(x)                        z, x: I = MH·P each; B, C: G·N each; dt: MH
    xBC = silu(conv(xBC) + conv_bias)                  depthwise causal conv (kernel K) over [x | B | C]; its input
                                                       tail (the last K-1 columns) is a fixed state
    dt = clamp(softplus(dt + dt_bias), time_step_limit)    float32, the same in every path
    A = -exp(A_log)                                    per head, float32
    S_t = exp(dt_t·A) S_{t-1} + (dt_t·x_t) ⊗ B_t;  y_t = S_t C_t + D·x_t     float32 state [MH, P, N]; head h reads
                                                       group h // (MH / G) of B and C
    out = out_proj(w · groupnorm_G(y · silu(z)))      RMSNorm within each of G groups of I/G channels

A prefill step (T > 1) runs the chunked SSD scan on the absolute position grid (tensorfold.kernels.ssd, chunks of
ssd.CHUNK), so a step's bits depend only on the absolute rows it covers and the state it starts from; a 1-token step
runs the recurrence.

Shapes in comments: T rows, E hidden, I inner, C conv channels (I + 2·G·N), K kernel, MH heads of P, G groups, N
state.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.causal_conv1d import causal_conv1d_prefill
from tensorfold.kernels.rmsnorm import grouped_gated_rms_norm
from tensorfold.kernels.ssd import chunk_ssd, ssd_step
from tensorfold_nemotron.config import NemotronConfig


@attrs.frozen
class MambaWeights:
    """One Mamba2 layer's tensors (HF names under `mixer.`)."""

    in_proj: torch.Tensor               # [I + C + MH, E]
    conv: torch.Tensor                  # [C, K]        conv1d.weight [C, 1, K], squeezed
    conv_bias: torch.Tensor | None      # [C]           conv1d.bias (use_conv_bias)
    dt_bias: torch.Tensor               # [MH]
    A_log: torch.Tensor                 # [MH]
    D: torch.Tensor                     # [MH]
    norm: torch.Tensor                  # [I]           norm.weight (plain, grouped)
    out_proj: torch.Tensor              # [E, I]
    A: torch.Tensor = attrs.field(init=False)   # [MH] float32 -exp(A_log): the log decay per unit of dt, once

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "A", -torch.exp(self.A_log.float()))


def time_steps(w: MambaWeights, c: NemotronConfig, dt: torch.Tensor) -> torch.Tensor:
    """dt [T, MH] as projected -> float32 softplus(dt + dt_bias) clamped to time_step_limit (one policy for all
    paths)."""
    low, high = c.dt_limit
    return F.softplus(dt.float() + w.dt_bias.float()).clamp(min=low, max=high)


def mamba2(w: MambaWeights, c: NemotronConfig, x: torch.Tensor, start: int, conv_tail: torch.Tensor,
           state: torch.Tensor) -> torch.Tensor:
    """One step's rows [start, start + T) through the layer: [T, E] -> [T, E].

    conv_tail [C, K-1] (x's dtype) and state [MH, P, N] (float32) are the stream's fixed states, read and updated
    in place; at start 0 they are taken as zero whatever they hold.
    """
    T, inner, G, N, MH, P = x.shape[0], c.mamba_inner, c.n_groups, c.state_size, c.mamba_heads, c.mamba_head_dim
    if start == 0:
        conv_tail.zero_()
        state.zero_()
    z, xbc, dt = F.linear(x, w.in_proj).split([inner, c.conv_dim, MH], dim=-1)
    xbc = causal_conv1d_prefill(xbc.contiguous(), w.conv, conv_tail, w.conv_bias)  # [T, C], silu applied
    xs, B, C = xbc.split([inner, G * N, G * N], dim=-1)
    xs = xs.reshape(T, MH, P)
    B, C = B.reshape(T, G, N), C.reshape(T, G, N)
    dt = time_steps(w, c, dt)                                                      # [T, MH] float32
    if T == 1:
        y = ssd_step(xs, dt, w.A, B, C, state[None], [0])                          # [1, MH, P]
    else:
        # fla's chunked kernel (bf16 on CUDA) takes TF32 dots; a float32 model (the checking mode) keeps the
        # exact naive form on the absolute grid on every device.
        backend = "naive" if x.dtype == torch.float32 else None
        y, final = chunk_ssd(xs, dt, w.A, B, C, state, start, backend=backend)     # [T, MH, P]
        state.copy_(final)
    y = y.float() + w.D.float()[:, None] * xs.float()                              # the D skip, float32
    # core's op is norms.gated_rms_norm's float32 math and roundings (the same bits on the CPU; one kernel on CUDA)
    out = grouped_gated_rms_norm(y.reshape(T, inner), z, w.norm, G, c.eps)         # [T, I]
    return F.linear(out, w.out_proj)                                               # [T, E]
