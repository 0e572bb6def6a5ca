"""The grouped alignment of triton_moe in two Triton launches: the same `Alignment`, bit for bit, as
`triton_moe.align(chosen, weights, N, block_m, grouped_only=True)`, without its dozen small torch launches.

The rows are cut into chunks of ROWS rows (at most CHUNK_PAIRS pairs, fewer rows for a small T so that a decode
step's few pairs still spread over about MIN_CHUNKS programs); _rows_kernel runs one program per chunk, _place_kernel
one per chunk and at least enough more that each fills at most FILL_BLOCKS blocks. The chunking changes no result:
the pairs land in the stable order by pair index whatever the chunks.

    _rows_kernel, program (chunk c)    each row's k pairs in ascending id, ties in j order (a pair's rank is the
                                       count of its row's pairs before it), written to expert / weight at
                                       t·k + rank; the chunk's per-expert counts to hist[c] (bin N: dropped)
    _place_kernel, program (chunk c)   totals and the counts of the chunks before c from hist; each expert's
                                       padded group start (exclusive prefix of counts rounded up to block_m);
                                       then the chunk's pairs in order, SUB at a time, each to its expert's next
                                       free row (its rank among the step's pairs of that expert is a SUB × SUB
                                       count, and a histogram of the step moves the next free rows on): the
                                       stable order by pair index. Last a share of the blocks: block_expert
                                       (searchsorted right of the block's first row in the padded ends) and P in
                                       the block's rows past its group's pairs

Every row of row_pair has one writer (a pair's place, or a padding row past its group's pairs), so the two
launches need no fill, no atomics and no host sync, and the result does not depend on scheduling. Launch sizes
are functions of T, k, N and block_m alone: cdiv(T, chunk_rows(T, k)) chunks, blocks_bound(T·k, N, block_m) blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels.moe.alignment import Alignment, blocks_bound

CHUNK_PAIRS = 1024  # pairs per program at most (k padded to a power of two)
MIN_CHUNKS = 16     # a small T's rows still cut into about this many chunks (rows a chunk: a power of two)
SUB_PAIRS = 64      # pairs per step of a chunk's scatter (a SUB × SUB compare)
HIST_ROWS = 8       # chunks' histograms read per step of the prefix over chunks
FILL_BLOCKS = 16    # blocks per step of a program's share of block_expert and the padding rows


@triton.jit(do_not_specialize=["T"])
def _rows_kernel(chosen_ptr, weights_ptr, expert_ptr, weight_ptr, hist_ptr, T, N, s_ct, s_cj, s_wt, s_wj,
                 K_TOP: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr):
    """Each row's pairs stably sorted by id into expert / weight (ids outside [0, N) become N); hist[c]."""
    c = tl.program_id(0)
    t = c * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, KP)
    ok = (t < T)[:, None] & (j < K_TOP)[None, :]
    ids = tl.load(chosen_ptr + t[:, None].to(tl.int64) * s_ct + j[None, :] * s_cj, mask=ok, other=0)
    w = tl.load(weights_ptr + t[:, None].to(tl.int64) * s_wt + j[None, :] * s_wj, mask=ok)
    mine = ids[:, :, None]                      # [ROWS, KP (this pair), KP (another of its row)]
    other = ids[:, None, :]
    before = (other < mine) | ((other == mine) & (j[None, None, :] < j[None, :, None]))
    rank = tl.sum((before & (j < K_TOP)[None, None, :]).to(tl.int32), axis=2)
    expert = tl.where(ok & (ids >= 0) & (ids < N), ids, N).to(tl.int32)
    dest = t[:, None] * K_TOP + rank
    tl.store(expert_ptr + dest, expert, mask=ok)
    tl.store(weight_ptr + dest, w, mask=ok)
    counts = tl.histogram(tl.reshape(expert, [ROWS * KP]), NB)
    tl.store(hist_ptr + c * NB + tl.arange(0, NB), counts)


@triton.jit(do_not_specialize=["P", "G", "BLOCKS", "PER"])
def _place_kernel(expert_ptr, hist_ptr, row_pair_ptr, block_expert_ptr, P, N, G, BLOCKS, PER,
                  K_TOP: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr, NB: tl.constexpr,
                  BLOCK_M: tl.constexpr, BM2: tl.constexpr, HIST_ROWS: tl.constexpr, FILL: tl.constexpr):
    """The chunk's pairs scattered to their padded rows; block_expert and the padding rows of PER blocks."""
    c = tl.program_id(0)   # programs past the G chunks only fill blocks
    bins = tl.arange(0, NB)
    total = tl.zeros([NB], dtype=tl.int32)
    earlier = tl.zeros([NB], dtype=tl.int32)
    for g0 in range(0, G, HIST_ROWS):
        g = g0 + tl.arange(0, HIST_ROWS)
        h = tl.load(hist_ptr + g[:, None] * NB + bins[None, :], mask=(g < G)[:, None], other=0)
        total += tl.sum(h, axis=0)
        earlier += tl.sum(tl.where((g < c)[:, None], h, 0), axis=0)
    counts = tl.where(bins < N, total, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    place = starts + earlier                            # an expert's next free row, for this chunk's pairs
    s = tl.arange(0, SUB)
    if c < G:
        for q0 in range(0, ROWS * K_TOP, SUB):
            pair = c * (ROWS * K_TOP) + q0 + s
            ok = (q0 + s < ROWS * K_TOP) & (pair < P)
            expert = tl.load(expert_ptr + pair, mask=ok, other=N)
            ahead = (expert[None, :] == expert[:, None]) & (s[None, :] < s[:, None])
            dest = tl.gather(place, expert, 0) + tl.sum(ahead.to(tl.int32), axis=1)
            tl.store(row_pair_ptr + dest, pair, mask=ok & (expert < N))
            place += tl.histogram(expert, NB, mask=ok)

    used_end = starts + counts                          # rows past this in an expert's group are padding
    r = tl.arange(0, BM2)
    for b0 in range(0, PER, FILL):
        i = b0 + tl.arange(0, FILL)
        b = c * PER + i
        b_ok = (i < PER) & (b < BLOCKS)
        first_row = b * BLOCK_M
        past = (ends[None, :] <= first_row[:, None]) & (bins < N)[None, :]
        owner = tl.sum(past.to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=b_ok)
        row = first_row[:, None] + r[None, :]
        pad = (row >= tl.gather(used_end, owner, 0)[:, None]) & (r < BLOCK_M)[None, :]
        tl.store(row_pair_ptr + row, tl.full([FILL, BM2], 0, tl.int32) + P, mask=b_ok[:, None] & pad)


def chunk_rows(T: int, k: int) -> int:
    """Rows a chunk: CHUNK_PAIRS pairs' worth, or fewer (a power of two) so that T rows make about MIN_CHUNKS."""
    most = max(1, CHUNK_PAIRS // triton.next_power_of_2(k))
    return min(most, triton.next_power_of_2(triton.cdiv(T, MIN_CHUNKS)))


def align_grouped(chosen: torch.Tensor, weights: torch.Tensor, N: int, block_m: int) -> Alignment:
    """triton_moe.align's grouped form (chosen [T, k] ids, weights [T, k]) in two launches sized by T, k, N and
    block_m only, so a prefill's routing costs two launches and no host read."""
    T, k = chosen.shape
    P, device = T * k, chosen.device
    blocks = blocks_bound(P, N, block_m)
    expert = torch.empty(P, dtype=torch.int32, device=device)
    weight = torch.empty(P, dtype=weights.dtype, device=device)
    row_pair = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    plan = Alignment(expert=expert, weight=weight, row_pair=row_pair, block_expert=block_expert)
    if P == 0:
        return plan
    kp = triton.next_power_of_2(k)
    rows = chunk_rows(T, k)
    chunks = triton.cdiv(T, rows)
    programs = max(chunks, triton.cdiv(blocks, FILL_BLOCKS))
    nb = triton.next_power_of_2(N + 1)
    hist = torch.empty((chunks, nb), dtype=torch.int32, device=device)
    _rows_kernel[(chunks,)](chosen, weights, expert, weight, hist, T, N, chosen.stride(0), chosen.stride(1),
                            weights.stride(0), weights.stride(1), K_TOP=k, KP=kp, ROWS=rows, NB=nb, num_warps=8)
    per = triton.cdiv(blocks, programs)
    _place_kernel[(programs,)](expert, hist, row_pair, block_expert, P, N, chunks, blocks, per,
                               K_TOP=k, ROWS=rows, SUB=SUB_PAIRS, NB=nb, BLOCK_M=block_m,
                               BM2=triton.next_power_of_2(block_m), HIST_ROWS=HIST_ROWS, FILL=FILL_BLOCKS,
                               num_warps=8)
    return plan
