"""Kimi Delta Attention kernels at GLM-5.3-Flash's KDA shape (H=64, DK=DV=128): fla-core against the naive form.

Prints one JSON line per measurement (and appends them to --out/kernels_kda.jsonl):
    env       versions, the GPU, fla's optional packages and FLA_* switches
    chunk     prefill of T rows (one stream, the same rows as 4 varlen streams, and fla with align_grid): ms,
              tokens/s, fla's first call (autotuning) ms, max |diff| against naive float32 and against a float64
              truth, for bf16 and fp32 inputs (float32 state; the decay GLM's bounded gate makes)
    step      a decode step of B streams in a pool: ms and state GB/s for naive and fla (gather/scatter and in
              place); max |diff| against naive
    bitwise   the same call twice, and one stream alone vs inside the batch

    python bench/kernels_kda.py [--lengths 2048 8192] [--batches 1 8 32] [--out DIR]
"""

from __future__ import annotations

import kernel_bench  # bench/kernel_bench.py: this script runs from bench/ on sys.path
import torch
from kernel_bench import Log, kept_states, pool_slots

from tensorfold.kernels.kda import fla_backend, kda_gate, naive

H, DK, DV = 64, 128, 128
LOWER_BOUND = -5.0
L2 = dict(qk_l2norm=True, scale=DK ** -0.5)      # raw q, k: normalised in the op, q scaled
LOG = Log("kernels_kda.jsonl")


def rows(T: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """GLM-like inputs on the GPU: the bounded gate over a random projection, beta = sigmoid(.)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, DK, generator=gen)
    k = torch.randn(T, H, DK, generator=gen)
    v = torch.randn(T, H, DV, generator=gen)
    A_log = (0.5 + torch.rand(H, generator=gen)).log()
    dt_bias = -2.0 + 0.5 * torch.randn(H * DK, generator=gen)
    g, beta = kda_gate(torch.randn(T, H * DK, generator=gen), torch.randn(T, H, generator=gen), A_log, dt_bias,
                       LOWER_BOUND)
    return (q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), g.cuda(), beta.cuda().to(dtype))


def fla_chunk(q, k, v, g, beta, state: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunk_kda with the states made contiguous: the adapter hands them to fla's kernel as they are, and
    the varlen call passes one state expanded over the streams."""
    return fla_backend.chunk_kda(q, k, v, g, beta, state.contiguous(), *args, **kwargs)


def bench_chunk(T: int, dtype: torch.dtype, has_fla: bool) -> None:
    """Prefill at T rows: naive and fla (kernel_bench.bench_chunk)."""
    kernel_bench.bench_chunk(LOG, rows(T, dtype), kept_states((H, DK, DV), seed=1), naive.chunk_kda,
                             fla_chunk if has_fla else None, L2)


def bench_step(B: int, dtype: torch.dtype, has_fla: bool, slots_total: int) -> None:
    """A decode step of B streams: naive, fla with gather/scatter, and fla's in-place pool kernel."""
    impls = {"naive": lambda *a, **kw: naive.recurrent_kda_step(*a[:6], a[6].tolist(), **kw)}
    if has_fla:
        impls["fla"] = fla_backend.recurrent_kda_step
        impls["fla_in_place"] = lambda *a, **kw: fla_backend.recurrent_kda_step(*a, in_place=True, **kw)
    kernel_bench.bench_step(LOG, rows(B, dtype, seed=2), kept_states((slots_total, H, DK, DV), seed=3),
                            pool_slots(slots_total, B), impls, L2)


def main() -> None:
    kernel_bench.run(LOG, "KDA kernels: fla-core vs the naive form", [1, 8, 32], fla_backend,
                     dict(H=H, DK=DK, DV=DV), bench_chunk, bench_step)


if __name__ == "__main__":
    main()
