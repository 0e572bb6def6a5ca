"""Paged attention: the naive path equals dense causal attention over the gathered keys bit for bit; the Triton
kernels match it within a stated tolerance; decode is batch-invariant bit for bit; NaN-poisoned pages never leak.

Tolerances against the naive path (unit-scale logits: q, k ~ N(0, 1), scale D^-0.5): fp32 1e-5 abs + 1e-5 rel;
bf16 1e-2 abs + 1e-2 rel (the naive path rounds logits and probabilities to bf16, the kernels keep them fp32).
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels import paged_attention
from tensorfold.kernels.paged_attention import naive

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """The families' attention, verbatim: q [T, H, D] at positions start.., k [S, KVH, D], v [S, KVH, Dv]."""
    T, H = q.shape[:2]
    keys = k.repeat_interleave(H // k.shape[1], dim=1)
    values = v.repeat_interleave(H // k.shape[1], dim=1)
    scores = torch.einsum("thd,shd->hts", q, keys) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= torch.arange(start, start + T,
                                                                                  device=q.device)[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.einsum("hts,shd->thd", probs, values)


class Pool:
    """Pages poisoned with NaN; each stream's keys written through a scrambled page table, the rest left NaN."""

    def __init__(self, rows: list[int], R: int, KVH: int, D: int, Dv: int, dtype: torch.dtype, device: str,
                 seed: int = 0, spare: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        need = [-(-n // R) + 1 for n in rows]                               # one unused page on each table
        P = sum(need) + spare                                               # spare pages: never listed
        self.k = torch.full((P, R, KVH, D), float("nan"), dtype=dtype)
        self.v = torch.full((P, R, KVH, Dv), float("nan"), dtype=dtype)
        ids = torch.randperm(P, generator=g)
        self.dense_k, self.dense_v, tables = [], [], []
        for n, used in zip(rows, need, strict=True):
            table, ids = ids[:used], ids[used:]
            k = torch.randn(n, KVH, D, generator=g).to(dtype)
            v = torch.randn(n, KVH, Dv, generator=g).to(dtype)
            r = torch.arange(n)
            self.k[table[r // R], r % R] = k
            self.v[table[r // R], r % R] = v
            self.dense_k.append(k.to(device))
            self.dense_v.append(v.to(device))
            tables.append(table)
        width = max(len(t) for t in tables) + 2
        poisoned = int(ids[0])                                              # padding points at a NaN page
        self.tables = torch.tensor([t.tolist() + [poisoned] * (width - len(t)) for t in tables], dtype=torch.int32,
                                   device=device)
        self.k, self.v = self.k.to(device), self.v.to(device)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[ref.dtype])


# (B lengths, H, KVH, D, Dv, R, dtype): MHA / GQA / MQA, D 16 and 64, Dv != D, page rows 16 and 64, lengths on
# and across page boundaries.
DECODE = [
    ([1, 15, 16, 17, 40], 4, 4, 16, 16, 16, torch.float32),
    ([33, 64, 65], 4, 2, 16, 32, 16, torch.bfloat16),
    ([70, 1], 4, 1, 64, 64, 64, torch.float32),
    ([5, 130, 63], 6, 2, 64, 16, 64, torch.bfloat16),
    ([200], 2, 1, 16, 16, 16, torch.bfloat16),
]


@pytest.mark.parametrize("lengths,H,KVH,D,Dv,R,dtype", DECODE)
def test_naive_decode_is_dense_attention(lengths, H, KVH, D, Dv, R, dtype, device):
    """Each stream's row equals dense attention over its keys, bit for bit; the poison never shows."""
    pool = Pool(lengths, R, KVH, D, Dv, dtype, device)
    q = torch.randn(len(lengths), H, D).to(dtype).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out = naive.paged_decode(q, pool.k, pool.v, pool.tables, lens, D ** -0.5)
    for b, n in enumerate(lengths):
        assert torch.equal(out[b], dense(q[b : b + 1], pool.dense_k[b], pool.dense_v[b], n - 1, D ** -0.5)[0])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("start,T,H,KVH,D,Dv,R,dtype", [
    (0, 9, 4, 2, 16, 16, 16, torch.float32), (13, 20, 4, 1, 16, 32, 16, torch.bfloat16),
    (64, 3, 2, 2, 64, 64, 64, torch.float32), (50, 30, 6, 3, 64, 16, 64, torch.bfloat16),
])
def test_naive_prefill_is_dense_attention(start, T, H, KVH, D, Dv, R, dtype, device):
    pool = Pool([start + T], R, KVH, D, Dv, dtype, device)
    q = torch.randn(T, H, D).to(dtype).to(device)
    out = naive.paged_prefill(q, pool.k, pool.v, pool.tables[0], start, D ** -0.5)
    assert torch.equal(out, dense(q, pool.dense_k[0], pool.dense_v[0], start, D ** -0.5))
    assert torch.isfinite(out).all()


@pytest.mark.triton
@pytest.mark.parametrize("split_keys,spread", [(64, 32), (512, 32), (512, 1), (512, 3)])
@pytest.mark.parametrize("lengths,H,KVH,D,Dv,R,dtype", DECODE)
def test_triton_decode_matches_naive(lengths, H, KVH, D, Dv, R, dtype, split_keys, spread, device):
    """Small splits and few-block spreads exercise the split merge; (512, 32) is the default, spread 1 one split
    a stream up to 512 keys."""
    from tensorfold.kernels.paged_attention import triton_decode
    pool = Pool(lengths, R, KVH, D, Dv, dtype, device, seed=1)
    q = torch.randn(len(lengths), H, D).to(dtype).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out = triton_decode.paged_decode(q, pool.k, pool.v, pool.tables, lens, D ** -0.5, split_keys=split_keys,
                                     spread=spread)
    _close(out, naive.paged_decode(q, pool.k, pool.v, pool.tables, lens, D ** -0.5))


@pytest.mark.triton
def test_triton_decode_long_streams_split_at_512(device):
    """Streams past SPLIT_KEYS run several default-size splits (512, 513, 1100 keys)."""
    from tensorfold.kernels.paged_attention import triton_decode
    lengths = [512, 513, 1100]
    pool = Pool(lengths, 64, 1, 16, 16, torch.bfloat16, device, seed=5)
    q = torch.randn(3, 2, 16).to(torch.bfloat16).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    _close(triton_decode.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.25),
           naive.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.25))


@pytest.mark.triton
@pytest.mark.parametrize("path", ["naive", "triton-64", "triton-spread-2"])
def test_decode_is_batch_invariant(path, device):
    """One stream's output alone equals its output at any place in batches of 1..16, bit for bit (spread 2: each
    stream's split size follows its own length, 64 or 128 keys here). The interpreter takes six of the sixteen
    batches, the stream first, in the middle and last among them."""
    from tensorfold.kernels.paged_attention import triton_decode
    fn = naive.paged_decode if path == "naive" else triton_decode.paged_decode
    kwargs = {"naive": {}, "triton-64": {"split_keys": 64}, "triton-spread-2": {"spread": 2}}[path]
    H, KVH, D, R = 4, 2, 16, 16
    others = [3, 150, 1, 47, 16, 96, 33, 120, 2, 64, 81, 17, 140, 9, 58]
    pool = Pool([70, *others], R, KVH, D, D, torch.bfloat16, device, seed=2)
    q = torch.randn(16, H, D).to(torch.bfloat16).to(device)
    lengths = torch.tensor([70, *others], dtype=torch.int32, device=device)
    alone = fn(q[:1], pool.k, pool.v, pool.tables[:1, :6], lengths[:1], D ** -0.5, **kwargs)
    for B in range(1, 17) if device == "cuda" or path == "naive" else (1, 2, 3, 7, 12, 16):
        at = 5 * B // 7                                                     # the stream's place in this batch
        order = list(range(1, B))
        order.insert(at, 0)
        out = fn(q[order], pool.k, pool.v, pool.tables[order], lengths[order], D ** -0.5, **kwargs)
        assert torch.equal(out[at], alone[0]), f"batch of {B}"


@pytest.mark.triton
def test_triton_decode_empty_stream_reads_zeros(device):
    from tensorfold.kernels.paged_attention import triton_decode
    pool = Pool([20, 5], 16, 1, 16, 16, torch.float32, device)
    q = torch.randn(2, 2, 16, device=device)
    lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    out = triton_decode.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _close(out, naive.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.25))


# (start, T, H, KVH, D, Dv, R, dtype): chunks from position 0 and mid-stream, across pages and row blocks.
PREFILL = [
    (0, 17, 4, 4, 16, 16, 16, torch.float32),
    (13, 40, 4, 2, 16, 32, 16, torch.bfloat16),
    (70, 9, 4, 1, 64, 64, 64, torch.float32),
    (5, 140, 2, 1, 16, 16, 64, torch.bfloat16),
    (64, 64, 6, 2, 64, 16, 16, torch.bfloat16),
]


@pytest.mark.triton
@pytest.mark.parametrize("start,T,H,KVH,D,Dv,R,dtype", PREFILL)
def test_triton_prefill_matches_naive(start, T, H, KVH, D, Dv, R, dtype, device):
    from tensorfold.kernels.paged_attention import triton_prefill
    pool = Pool([start + T], R, KVH, D, Dv, dtype, device, seed=3)
    q = torch.randn(T, H, D).to(dtype).to(device)
    out = triton_prefill.paged_prefill(q, pool.k, pool.v, pool.tables[0], start, D ** -0.5)
    _close(out, naive.paged_prefill(q, pool.k, pool.v, pool.tables[0], start, D ** -0.5))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_varlen_matches_naive(dtype, device):
    """Streams of different starts and chunk sizes (one empty) packed along rows."""
    from tensorfold.kernels.paged_attention import triton_prefill
    starts, rows = [0, 30, 7, 16], [20, 5, 0, 33]
    H, KVH, D, R = 4, 2, 16, 16
    pool = Pool([s + n for s, n in zip(starts, rows, strict=True)], R, KVH, D, D, dtype, device, seed=4)
    q = torch.randn(sum(rows), H, D).to(dtype).to(device)
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32, device=device)
    st = torch.tensor(starts, dtype=torch.int32, device=device)
    out = triton_prefill.paged_prefill_varlen(q, pool.k, pool.v, pool.tables, cu, st, max(rows), D ** -0.5)
    ref = naive.paged_prefill_varlen(q, pool.k, pool.v, pool.tables, cu, st, D ** -0.5)
    _close(out, ref)
    lo = sum(rows[:3])                                                      # a stream's bits do not see the others
    alone = triton_prefill.paged_prefill(q[lo:], pool.k, pool.v, pool.tables[3], starts[3], D ** -0.5)
    assert torch.equal(out[lo:], alone)


@pytest.mark.parametrize("path", [pytest.param("triton", marks=pytest.mark.triton), "public"])
@pytest.mark.parametrize("lengths,H,KVH,D,Dv,R,dtype", [DECODE[1], DECODE[3], DECODE[4]])
def test_a_gated_decode_is_the_decode_then_sigmoid_mul(path, lengths, H, KVH, D, Dv, R, dtype, device):
    """The gate (halves interleaved with other columns, read in place) applied in the combine launch gives the bits
    of the ungated decode then silu_gate.sigmoid_mul."""
    from tensorfold.kernels.paged_attention import triton_decode
    from tensorfold.kernels.silu_gate import sigmoid_mul
    pool = Pool(lengths, R, KVH, D, Dv, dtype, device, seed=7)
    B = len(lengths)
    q = torch.randn(B, H, D).to(dtype).to(device)
    columns = (torch.randn(B, H, 2 * Dv) * 3).to(dtype).to(device)
    gate = columns[..., Dv:]                                                 # [B, H, Dv], row stride 2·H·Dv
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if path == "triton":
        plain = triton_decode.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.3)
        gated = triton_decode.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.3, gate=gate)
        want = triton_gate_sigmoid_mul(plain.reshape(B, H * Dv), gate)
    else:
        plain = paged_attention.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.3)
        gated = paged_attention.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.3, gate=gate)
        want = sigmoid_mul(plain.reshape(B, H * Dv), gate)
    assert gated.shape == (B, H, Dv) and gated.dtype == dtype
    assert torch.equal(gated.reshape(B, H * Dv), want)


def triton_gate_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    from tensorfold.kernels.silu_gate import triton_gate
    return triton_gate.sigmoid_mul(x, gate)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_gated_decode_at_qwen3_5s_attention_shape():
    """16 query heads over 2 kv heads of 256, bf16, streams of 1 to 2,000 keys: the gated combine's bits are the
    decode's then sigmoid_mul's."""
    from tensorfold.kernels.paged_attention import triton_decode
    lengths = [1, 300, 2000]
    pool = Pool(lengths, 16, 2, 256, 256, torch.bfloat16, "cuda", seed=9)
    q = torch.randn(3, 16, 256).bfloat16().cuda()
    columns = (torch.randn(3, 16, 512) * 3).bfloat16().cuda()
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    plain = triton_decode.paged_decode(q, pool.k, pool.v, pool.tables, lens, 256 ** -0.5)
    gated = triton_decode.paged_decode(q, pool.k, pool.v, pool.tables, lens, 256 ** -0.5, gate=columns[..., 256:])
    assert torch.equal(gated.reshape(3, -1), triton_gate_sigmoid_mul(plain.reshape(3, -1), columns[..., 256:]))


def test_a_bad_gate_is_named(device):
    pool = Pool([20], 16, 2, 16, 16, torch.float32, device)
    q = torch.randn(1, 4, 16, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    for gate in (torch.randn(1, 4, 8, device=device), torch.randn(1, 4, 16, device=device).half()):
        with pytest.raises(ValueError, match=r"gate must be \[1, 4, 16\]"):
            paged_attention.paged_decode(q, pool.k, pool.v, pool.tables, lens, gate=gate)


def test_public_ops_dispatch_and_default_scale(device):
    """The public functions give the backend's result; scale defaults to D^-0.5."""
    pool = Pool([20, 9], 16, 2, 16, 16, torch.float32, device)
    q = torch.randn(2, 4, 16, device=device)
    lens = torch.tensor([20, 9], dtype=torch.int32, device=device)
    _close(paged_attention.paged_decode(q, pool.k, pool.v, pool.tables, lens),
           naive.paged_decode(q, pool.k, pool.v, pool.tables, lens, 0.25))
    qp = torch.randn(5, 4, 16, device=device)
    _close(paged_attention.paged_prefill(qp, pool.k, pool.v, pool.tables[0], 15),
           naive.paged_prefill(qp, pool.k, pool.v, pool.tables[0], 15, 0.25))
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    st = torch.tensor([15], dtype=torch.int32, device=device)
    _close(paged_attention.paged_prefill_varlen(qp, pool.k, pool.v, pool.tables[:1], cu, st),
           naive.paged_prefill(qp, pool.k, pool.v, pool.tables[0], 15, 0.25))


def test_public_ops_name_the_bad_argument(device):
    pool = Pool([20], 16, 2, 16, 16, torch.float32, device)
    q = torch.randn(1, 4, 16, device=device)
    lens = torch.tensor([20], dtype=torch.int32, device=device)
    k, v, tables = pool.k, pool.v, pool.tables
    bad = [
        ("tables", lambda: paged_attention.paged_decode(q, k, v, tables.long(), lens)),
        ("lengths", lambda: paged_attention.paged_decode(q, k, v, tables, lens[:0])),
        ("k_pages", lambda: paged_attention.paged_decode(q, k.half(), v, tables, lens)),
        ("v_pages", lambda: paged_attention.paged_decode(q, k, v[:, :8], tables, lens)),
        ("heads", lambda: paged_attention.paged_decode(torch.randn(1, 3, 16, device=device), k, v, tables, lens)),
        ("q", lambda: paged_attention.paged_decode(q[0], k, v, tables, lens)),
        ("start", lambda: paged_attention.paged_prefill(q, k, v, tables[0], -1)),
        ("table", lambda: paged_attention.paged_prefill(q, k, v, tables[0], 16 * tables.shape[1])),
        ("cu_seqlens", lambda: paged_attention.paged_prefill_varlen(q, k, v, tables, lens, lens, 1)),
        ("max_rows", lambda: paged_attention.paged_prefill_varlen(
            q, k, v, tables, torch.tensor([0, 1], dtype=torch.int32, device=device), lens, -1)),
    ]
    for name, call in bad:
        with pytest.raises(ValueError, match=name):
            call()
