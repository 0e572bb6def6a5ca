"""Triton routed experts: a grouped GEMM over the (row, j) pairs sorted by expert, with no host sync.

    align (on the device)  each row's k pairs ordered by expert id (the reference's sum order); all T·k pairs
        sorted by expert (stable); each expert's group padded to BLOCK_M rows; `row_pair[r]` names the pair at
        padded row r (P = T·k where none), `block_expert[b]` the expert of block b (N where none). At most
        PAIR_BLOCKS_UP_TO pairs (decode) skip the grouping: block p holds pair p alone in its first row. On CUDA
        the grouping is triton_align's two launches; elsewhere (and as their reference) a dozen torch ops. Pairs
        that come `ordered` (a routing kernel's: ids ascending per row, all in range) skip the per-row sort and
        the range check, so a decode call's align issues no launch at all.
    gate_up kernel, program (block b, F block)   h = round(round(silu(g)) · u), [g | u] = x[token] @ gate_up[e]ᵀ
                                                 (with a limit, g and u clamped first, each rounded again)
                                                 (relu2: h = round(relu(u)²), u = x[token] @ gate_up[e]ᵀ, no gate)
    down kernel, program (block b, E block)      c[pair] = round(round(h @ down[e]ᵀ) · weight[pair])
                                                 (float32_sum: c[pair] = round(h @ down[e]ᵀ), unweighted)
    sum kernel, program (row t, E block)         out[t] = Σ_j c[t·k + j], j in order, rounded after each add
                                                 (float32_sum: Σ_j c · weight in float32, j in order, rounded
                                                 once; shared_last: the row's last pair, round(c · weight),
                                                 added after that rounding and the sum rounded again)

Every size the launches see is a static bound of T, k, N and the config: P + min(N, P)·(BLOCK_M − 1) padded
rows at most, so `cdiv(that, BLOCK_M)` blocks, of which those past the used rows find expert N and return. No
.item(), .tolist(), nonzero, unique, bincount or boolean mask anywhere: the whole op can be captured in a CUDA
graph. Each pair's contribution has one writer and the per-row sum runs in a fixed order (no atomics), so the
result is deterministic. Expert ids outside [0, N) contribute nothing.

Batch invariance: the config (block sizes, K-loop order, warps, dot precision) is a function of (E, F, dtype) and
the call's kind alone, never of T, and a row's products read only its own x row and its experts' weights, so a
row's output bits are the same alone or inside any batch of its kind. One exception, by design: a 16-bit decode call
of lone pairs (a block each) takes the PAIR_* tiles, a grouped one the DECODE_* tiles. The claim that lets them
differ: a tile changes neither the K order nor the dot's 16-wide fp32 accumulation steps on the device, so a row's
bits are the same under both (test_moe_gpu.py holds a row alone and in lone pairs against the same row grouped,
with PAIR_* set apart from DECODE_*; the interpreter's row-by-row dot sums a whole K step at once, so there only the
F and E tiles may differ). As shipped the two are equal. Two kinds: "decode" (the default: small
tiles, for a step's one row per stream) and "prefill" (a prefill chunk's rows: 128-row expert blocks and larger
tiles, for thousands of rows sharing each expert); a row's bits may differ between the kinds. Float32 dots run in
IEEE float32 (no TF32); bfloat16 dots accumulate in float32. Each intermediate is rounded to x's dtype where the
reference's torch ops round; bfloat16 rounding is done on the bits (nearest even) because triton's interpreter
truncates on `.to(tl.bfloat16)`. The sum kernel compiles without fp fusion: float32_sum's products and sums
round as the reference's torch ops do.
"""

from __future__ import annotations

import functools

import attrs
import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.moe.alignment import Alignment, blocks_bound
from tensorfold.kernels.moe.triton_align import align_grouped
from tensorfold.kernels.strides import row_major
from tensorfold.kernels.triton_rounding import round_to

BLOCK_M = 16          # decode: rows per expert block; every group is padded to a multiple of it
PREFILL_BLOCK_M = 128  # prefill: rows per expert block (bench/moe_tiles.py picked the tiles)
PAIR_BLOCKS_UP_TO = 72  # decode, at most this many (row, expert) pairs: one block per pair, no grouping
                        # (8 streams at k = 8, plus a shared expert run as a ninth pair)
DECODE_BLOCK_F = 32     # decode gate_up: output features per program
DECODE_STEP_E = 128     # decode gate_up, 16-bit: the reduction step over E
DECODE_BLOCK_E = 32     # decode down: output features per program
DECODE_STEP_F = 64      # decode down, 16-bit: the reduction step over F
DECODE_WARPS = 4
DECODE_STAGES = 3       # the decode K loops' software pipelining depth
# A 16-bit decode call of lone pairs (at most PAIR_BLOCKS_UP_TO: a block each, batch 1 to 8 at the 35B-A3B) takes
# these tiles instead, so they can suit one row per expert; they ship equal to the DECODE_* tiles (the device sweep
# found no faster set: docs/kernels.md "The lone pairs' tiles").
PAIR_BLOCK_F = 32
PAIR_STEP_E = 128
PAIR_BLOCK_E = 32
PAIR_STEP_F = 64
PAIR_WARPS = 4
PAIR_STAGES = 3
KINDS = ("decode", "prefill")


@attrs.frozen
class Config:
    """Tile sizes and dot precision of one (E, F, dtype): never a function of the batch."""

    block_f: int          # gate_up: output features per program
    block_k_e: int        # gate_up: reduction step over E
    block_e: int          # down: output features per program
    block_k_f: int        # down: reduction step over F
    block_sum: int        # sum: features per program
    precision: str        # tl.dot input precision
    num_warps: int = 4
    block_m: int = BLOCK_M    # rows per expert block
    num_stages: int = 3       # software pipelining depth of the K loops
    grouped_only: bool = False  # never the one-block-per-pair form (prefill: many rows share an expert)


def tile(size: int, most: int) -> int:
    """A power-of-two tile of at most `most` (and at least 16, as tl.dot wants) for a dimension of `size`."""
    return max(16, min(most, triton.next_power_of_2(size)))


def config_for(E: int, F: int, dtype: torch.dtype, kind: str = "decode") -> Config:
    """The fixed config of a shape, dtype and kind of call; `kind` in KINDS (module docstring)."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    block_sum = min(1024, triton.next_power_of_2(E))
    if kind == "prefill" and dtype != torch.float32:
        return Config(block_f=tile(F, 128), block_k_e=tile(E, 64), block_e=tile(E, 128), block_k_f=tile(F, 64),
                      block_sum=block_sum, precision=precision, num_warps=8, block_m=PREFILL_BLOCK_M,
                      num_stages=3, grouped_only=True)
    step = 32 if dtype == torch.float32 else DECODE_STEP_F
    # decode: 32-wide F and E tiles, so a step's few pairs still spread over the SMs; bf16 reads E in 128-deep steps
    # (bench/moe_tiles.py --decode picked them at the 35B-A3B shape, docs/kernels.md)
    decode = Config(block_f=tile(F, DECODE_BLOCK_F), block_k_e=tile(E, 32 if dtype == torch.float32 else DECODE_STEP_E),
                    block_e=tile(E, DECODE_BLOCK_E), block_k_f=tile(F, step), block_sum=block_sum,
                    precision=precision, num_warps=DECODE_WARPS, num_stages=DECODE_STAGES)
    if kind == "prefill":   # float32 (the checking mode): the decode tiles, grouped in 128-row blocks
        return attrs.evolve(decode, block_m=PREFILL_BLOCK_M, grouped_only=True)
    return decode


def lone_pairs(P: int, grouped_only: bool) -> bool:
    """Whether a call of P pairs gives each pair a block of its own (align's short form)."""
    return P <= PAIR_BLOCKS_UP_TO and not grouped_only


def pair_config(cfg: Config, E: int, F: int, dtype: torch.dtype) -> Config:
    """The tiles of a 16-bit decode call of lone pairs (PAIR_*); float32 keeps the decode tiles."""
    if dtype == torch.float32:
        return cfg
    return _pair_config(cfg, E, F, (PAIR_BLOCK_F, PAIR_STEP_E, PAIR_BLOCK_E, PAIR_STEP_F, PAIR_WARPS, PAIR_STAGES))


@functools.cache
def _pair_config(cfg: Config, E: int, F: int, tiles: tuple[int, ...]) -> Config:
    """pair_config's evolve, once per config and tiles (an eager decode step asks for it in every MoE layer)."""
    block_f, step_e, block_e, step_f, warps, stages = tiles
    return attrs.evolve(cfg, block_f=tile(F, block_f), block_k_e=tile(E, step_e), block_e=tile(E, block_e),
                        block_k_f=tile(F, step_f), num_warps=warps, num_stages=stages)


@triton.jit(do_not_specialize=["P"])
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, row_pair_ptr, block_expert_ptr, P, N, K_TOP,
                    s_xt, s_we, s_wf, s_wk, s_hm, limit, E: tl.constexpr, F: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    RELU2: tl.constexpr, CLAMP: tl.constexpr, PDL: tl.constexpr = False):
    """h[rows, f] = round(round(silu(g)) · u) for one expert block and F block; g, u rounded to h's dtype.
    RELU2: the weights are the up rows alone and h = round(relu(u)²). CLAMP: g <= limit, -limit <= u <= limit
    (each rounded to h's dtype again, as torch's clamp of a tensor in that dtype gives)."""
    pdl.ordered(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= N:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair_ptr + rows)
    ok = pair < P
    token = (pair // K_TOP).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = f < F
    base = w_ptr + expert.to(tl.int64) * s_we
    acc_g = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    for k0 in range(0, E, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < E
        a = tl.load(x_ptr + token[:, None] * s_xt + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & f_ok[None, :]
        if RELU2:
            bu = tl.load(base + f[None, :].to(tl.int64) * s_wf + kk[:, None] * s_wk, mask=w_mask, other=0.0)
        else:
            bg = tl.load(base + f[None, :].to(tl.int64) * s_wf + kk[:, None] * s_wk, mask=w_mask, other=0.0)
            bu = tl.load(base + (f + F)[None, :].to(tl.int64) * s_wf + kk[:, None] * s_wk, mask=w_mask,
                         other=0.0)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
    ty = h_ptr.dtype.element_ty
    u = round_to(acc_u, ty)
    if RELU2:
        r = tl.maximum(u, 0.0)
        h = round_to(r * r, ty)
    else:
        g = round_to(acc_g, ty)
        if CLAMP:
            g = round_to(tl.minimum(g, limit), ty)
            u = round_to(tl.minimum(tl.maximum(u, -limit), limit), ty)
        silu = round_to(g / (1.0 + tl.exp(-g)), ty)
        h = round_to(silu * u, ty)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * s_hm + f[None, :], h, mask=ok[:, None] & f_ok[None, :])


@triton.jit(do_not_specialize=["P"])
def _down_kernel(h_ptr, w_ptr, weight_ptr, c_ptr, row_pair_ptr, block_expert_ptr, P, N,
                 s_hm, s_we, s_wn, s_wk, s_cp, E: tl.constexpr, F: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 WEIGH: tl.constexpr, PDL: tl.constexpr = False):
    """c[pair, n] = round(round(h @ down[e]ᵀ) · weight[pair]) for one expert block and E block (WEIGH false:
    round(h @ down[e]ᵀ), the weight left to the sum)."""
    pdl.ordered(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= N:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair_ptr + rows)
    ok = pair < P
    n = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    n_ok = n < E
    base = w_ptr + expert.to(tl.int64) * s_we
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < F
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * s_hm + kk[None, :], mask=ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(base + n[None, :].to(tl.int64) * s_wn + kk[:, None] * s_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    ty = c_ptr.dtype.element_ty
    if WEIGH:
        weight = tl.load(weight_ptr + pair, mask=ok, other=0.0).to(tl.float32)
        c = round_to(round_to(acc, ty) * weight[:, None], ty)
    else:
        c = round_to(acc, ty)
    tl.store(c_ptr + pair[:, None].to(tl.int64) * s_cp + n[None, :], c, mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _weighted(c_ptr, expert_ptr, weight_ptr, pair, cols, col_ok, N, s_cp):
    """Pair `pair`'s c · weight in float32 over `cols` (0 where its expert is invalid)."""
    expert = tl.load(expert_ptr + pair)
    c = tl.load(c_ptr + pair * s_cp + cols, mask=col_ok & (expert < N), other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + pair).to(tl.float32)
    return tl.where(expert < N, c * weight, 0.0)


@triton.jit
def _sum_kernel(c_ptr, expert_ptr, weight_ptr, out_ptr, N, s_cp, s_ot, E: tl.constexpr, K_TOP: tl.constexpr,
                BLOCK: tl.constexpr, F32_SUM: tl.constexpr, LAST_APART: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = Σ_j c[t·k + j] in j order, rounded to out's dtype after each add (pairs of invalid experts skip).
    F32_SUM: Σ_j c · weight in float32, rounded once; LAST_APART (1): the row's last pair left out of that sum,
    then added as round(c · weight) and the sum rounded again."""
    pdl.ordered(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < E
    ty = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K_TOP - LAST_APART):
        pair = t * K_TOP + j
        if F32_SUM:
            acc = acc + _weighted(c_ptr, expert_ptr, weight_ptr, pair, cols, col_ok, N, s_cp)
        else:
            expert = tl.load(expert_ptr + pair)
            c = tl.load(c_ptr + pair * s_cp + cols, mask=col_ok & (expert < N), other=0.0).to(tl.float32)
            acc = round_to(acc + c, ty)
    if F32_SUM:
        acc = round_to(acc, ty)
    if LAST_APART:
        last = _weighted(c_ptr, expert_ptr, weight_ptr, t * K_TOP + K_TOP - 1, cols, col_ok, N, s_cp)
        acc = round_to(acc + round_to(last, ty), ty)
    tl.store(out_ptr + t * s_ot + cols, acc, mask=col_ok)


@functools.cache
def _lone_rows(P: int, block_m: int, device: torch.device) -> torch.Tensor:
    """row_pair when pair p has block p to itself: its first row, the rest empty (P)."""
    rows = torch.full((P, block_m), P, dtype=torch.int32, device=device)
    rows[:, 0] = torch.arange(P, dtype=torch.int32, device=device)
    return rows.reshape(P * block_m)


def align(chosen: torch.Tensor, weights: torch.Tensor, N: int, block_m: int = BLOCK_M,
          grouped_only: bool = False, ordered: bool = False) -> Alignment:
    """Sort the (row, j) pairs by expert and pad each group to block_m rows, with device ops only; a few pairs
    (decode, unless grouped_only) get a block each instead, which skips the grouping's dozen small launches.
    ordered: each row's ids are already ascending and in [0, N) (routing.softmax_top_k's), taken as they are."""
    T, k = chosen.shape
    P, device = T * k, chosen.device
    if chosen.is_cuda and not lone_pairs(P, grouped_only):
        return align_grouped(chosen, weights, N, block_m)                 # the same bits in two launches
    if ordered:
        expert, weight = chosen.reshape(P), weights.reshape(P)
    else:
        by_expert, perm = chosen.sort(dim=1, stable=True)                 # a row's pairs in ascending expert
        weight = weights.gather(1, perm).reshape(P)
        expert = by_expert.reshape(P)
        expert = torch.where((expert >= 0) & (expert < N), expert, N)     # out of range -> group N, dropped
    if lone_pairs(P, grouped_only):
        ids = expert if ordered else expert.to(torch.int32)
        return Alignment(expert=ids, weight=weight, row_pair=_lone_rows(P, block_m, device), block_expert=ids)
    grouped, order = torch.sort(expert, stable=True)                      # pairs grouped by expert
    starts = torch.searchsorted(grouped, torch.arange(N + 1, device=device))   # [N + 1] each group's first place
    rank = torch.arange(P, device=device) - starts[grouped]               # a pair's place in its group
    counts = starts[1:] - starts[:-1]                                     # [N] pairs per expert
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)                                               # [N] padded group ends
    blocks = blocks_bound(P, N, block_m)
    rows = blocks * block_m
    dest = torch.where(grouped < N, (ends - padded)[grouped.clamp(max=N - 1)] + rank, rows)
    row_pair = torch.full((rows + 1,), P, dtype=torch.int32, device=device)
    row_pair.scatter_(0, dest, order.to(torch.int32))                      # row `rows` collects the dropped
    block_start = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    return Alignment(expert=expert if ordered else expert.to(torch.int32), weight=weight, row_pair=row_pair[:rows],
                     block_expert=block_expert)


def contributions(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, activation: str = "silu_gate", kind: str = "decode", config: Config | None = None,
                  limit: float | None = None, ordered: bool = False, float32_sum: bool = False
                  ) -> tuple[torch.Tensor, Alignment]:
    """The gate_up and down launches of `routed_experts`: each pair's output c [T·k, E] (weighted unless
    float32_sum) and the alignment (its `expert` names each pair's expert, N or more where it adds nothing)."""
    x, gate_up, down = row_major(x), row_major(gate_up), row_major(down)
    T, E = x.shape
    k = chosen.shape[1]
    relu2 = activation == "relu2"
    N, F = gate_up.shape[0], gate_up.shape[1] if relu2 else gate_up.shape[1] // 2
    cfg = config or config_for(E, F, x.dtype, kind)
    plan = align(chosen, weights, N, cfg.block_m, cfg.grouped_only, ordered)
    P, blocks = T * k, plan.block_expert.shape[0]
    if config is None and lone_pairs(P, cfg.grouped_only):
        cfg = pair_config(cfg, E, F, x.dtype)
    contrib = torch.empty((P, E), dtype=x.dtype, device=x.device)
    if F == 0:
        return contrib.zero_(), plan
    hidden = torch.empty((blocks * cfg.block_m, F), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(F, cfg.block_f))](
        x, gate_up, hidden, plan.row_pair, plan.block_expert, P, N, k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), hidden.stride(0),
        0.0 if limit is None else float(limit), E=E, F=F,
        BLOCK_M=cfg.block_m, BLOCK_F=cfg.block_f, BLOCK_K=cfg.block_k_e, PRECISION=cfg.precision, RELU2=relu2,
        CLAMP=limit is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x))
    _down_kernel[(blocks, triton.cdiv(E, cfg.block_e))](
        hidden, down, plan.weight, contrib, plan.row_pair, plan.block_expert, P, N,
        hidden.stride(0), down.stride(0), down.stride(1), down.stride(2), contrib.stride(0), E=E, F=F,
        BLOCK_M=cfg.block_m, BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k_f, PRECISION=cfg.precision,
        WEIGH=not float32_sum, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(hidden))
    return contrib, plan


def routed_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, activation: str = "silu_gate", kind: str = "decode",
                   config: Config | None = None, limit: float | None = None, ordered: bool = False,
                   float32_sum: bool = False, shared_last: bool = False) -> torch.Tensor:
    """Launcher: x [T, E], chosen [T, k], weights [T, k], gate_up [N, 2F, E] ([N, F, E] for relu2),
    down [N, E, F] -> [T, E]; `config` (a benchmark's tile sweep) replaces the kind's; `limit` clamps the SwiGLU;
    `ordered`: each row's ids ascending and in range (align); `float32_sum`, `shared_last`: the sum's modes
    (module docstring)."""
    T, E = x.shape
    k = chosen.shape[1]
    N, F = gate_up.shape[0], gate_up.shape[1] if activation == "relu2" else gate_up.shape[1] // 2
    out = torch.empty((T, E), dtype=x.dtype, device=x.device)
    if T == 0 or E == 0:
        return out
    if F == 0:
        return out.zero_()
    cfg = config or config_for(E, F, x.dtype, kind)
    contrib, plan = contributions(x, chosen, weights, gate_up, down, activation, kind, cfg, limit, ordered,
                                  float32_sum)
    _sum_kernel[(T, triton.cdiv(E, cfg.block_sum))](
        contrib, plan.expert, plan.weight, out, N, contrib.stride(0), out.stride(0), E=E, K_TOP=k,
        BLOCK=cfg.block_sum, F32_SUM=float32_sum, LAST_APART=int(shared_last), num_warps=cfg.num_warps,
        enable_fp_fusion=False, **pdl.options(contrib))
    return out
