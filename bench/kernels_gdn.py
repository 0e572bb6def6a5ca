"""The gated delta rule kernels at Qwen3.5-9B's GDN shape (NK=16, NV=32, DK=DV=128): fla-core against ours.

Prints one JSON line per measurement (and appends them to --out/kernels_gdn.jsonl):
    env       versions, the GPU, fla's optional packages and FLA_* switches
    chunk     prefill of T rows (one stream, and the same rows as 4 varlen streams): ms, tokens/s, fla's first
              call (autotuning) ms, max |diff| against naive float32 and against a float64 truth, for bf16 and
              fp32 inputs (float32 state)
    step      a decode step of B streams in a pool: ms and state GB/s for naive, our triton kernel (in place),
              fla (gather + kernel + scatter) and fla's kernel alone; max |diff| against naive
    bitwise   the same call twice, and one stream alone vs inside the batch, for fla's chunked op and every step

    python bench/kernels_gdn.py [--lengths 2048 8192] [--batches 1 8 32 128] [--out DIR]
"""

from __future__ import annotations

import math

import kernel_bench  # bench/kernel_bench.py: this script runs from bench/ on sys.path
import torch
import torch.nn.functional as F
from kernel_bench import Log, kept_states, pool_slots, timed_ms

from tensorfold.kernels.gated_delta import fla_backend, naive

NK, NV, DK, DV = 16, 32, 128, 128
L2 = dict(qk_l2norm=True, scale=DK ** -0.5)      # raw q, k: normalised in the op, q scaled
LOG = Log("kernels_gdn.jsonl")


def rows(T: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Qwen-like inputs on the GPU: g = -A·softplus(a + dt_bias) float32, beta = sigmoid(.)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, NK, DK, generator=gen)
    k = torch.randn(T, NK, DK, generator=gen)
    v = torch.randn(T, NV, DV, generator=gen)
    A = torch.empty(NV).uniform_(1, 16, generator=gen)
    dt = torch.exp(torch.empty(NV).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    g = -A * F.softplus(torch.randn(T, NV, generator=gen) + dt + torch.log(-torch.expm1(-dt)))
    beta = torch.sigmoid(torch.randn(T, NV, generator=gen))
    return (q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), g.cuda(), beta.cuda().to(dtype))


def bench_chunk(T: int, dtype: torch.dtype, has_fla: bool) -> None:
    """Prefill at T rows: naive and fla (kernel_bench.bench_chunk)."""
    kernel_bench.bench_chunk(LOG, rows(T, dtype), kept_states((NV, DK, DV), seed=1), naive.chunk_gated_delta,
                             fla_backend.chunk_gated_delta if has_fla else None, L2)


def bench_step(B: int, dtype: torch.dtype, has_fla: bool, slots_total: int) -> None:
    """A decode step of B streams: naive, our triton kernel, fla, and fla's kernel alone (no gather/scatter)."""
    from tensorfold.kernels.gated_delta import triton_recurrent
    inputs = q, k, v, g, beta = rows(B, dtype, seed=2)
    states = kept_states((slots_total, NV, DK, DV), seed=3)
    slots = pool_slots(slots_total, B)
    impls = {"naive": naive.recurrent_gated_delta_step, "triton": triton_recurrent.recurrent_gated_delta_step}
    if has_fla:
        impls["fla"] = fla_backend.recurrent_gated_delta_step
    kernel_bench.bench_step(LOG, inputs, states, slots, impls, L2)
    if has_fla:
        ops = fla_backend._ops()
        initial = states.index_select(0, slots)
        ms = timed_ms(lambda: ops.fused_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], initial_state=initial,
            output_final_state=True, use_qk_l2norm_in_kernel=True), repeats=20)
        state_bytes = 2 * B * NV * DK * DV * 4                                     # read + write
        LOG(bench="step", impl="fla_kernel_only", dtype=str(dtype).removeprefix("torch."), B=B, ms=round(ms, 4),
            state_gb_s=round(state_bytes / ms / 1e6, 1))


def main() -> None:
    kernel_bench.run(LOG, "gated delta rule kernels: fla-core vs ours", [1, 8, 32, 128], fla_backend,
                     dict(NK=NK, NV=NV, DK=DK, DV=DV), bench_chunk, bench_step)


if __name__ == "__main__":
    main()
