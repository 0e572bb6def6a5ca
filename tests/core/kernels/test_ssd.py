"""The Mamba2 SSD scan kernels (core/tensorfold/kernels/ssd).

CPU: the naive chunked form against the token-by-token recurrence, a float64 truth and HF nemotron_h's own torch
functions (float32 tolerance), resumption at a grid cut and packed streams bit for bit, the step as the recurrence
bit for bit; the public functions validate and dispatch. triton: our decode step against the naive one (in the
interpreter on the CPU), batch invariant bit for bit, padded rows. fla-core, when installed: its adapter against the
naive ops in the interpreter. The shared inputs (`ssd_rows`, `kept`) are imported by test_ssd_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tensorfold.kernels import ssd
from tensorfold.kernels.ssd import fla_backend, naive

FP32_REL = 1e-5         # float32 chunked vs recurrence / truth / HF, relative to the largest |value|


def ssd_rows(T: int, H: int, P: int, G: int, N: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
             seed: int = 0, dt_max: float = 1e-1) -> tuple[torch.Tensor, ...]:
    """Inputs shaped like a Mamba2 mixer's: x [T, H, P], B, C [T, G, N] in `dtype`; dt = softplus(raw + dt_bias)
    [T, H] float32 with dt_bias from Mamba's init (dt in [1e-3, dt_max]); A = -[1, 16] [H] float32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=gen)
    B = torch.randn(T, G, N, generator=gen)
    C = torch.randn(T, G, N, generator=gen)
    bias_dt = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(dt_max), generator=gen))
    dt_bias = bias_dt + torch.log(-torch.expm1(-bias_dt))                          # softplus⁻¹
    dt = F.softplus(torch.randn(T, H, generator=gen) + dt_bias)
    A = -torch.empty(H).uniform_(1, 16, generator=gen)
    return x.to(device, dtype), dt.to(device), A.to(device), B.to(device, dtype), C.to(device, dtype)


def kept(S: int, H: int, P: int, N: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    """States such as streams keep after some hundred tokens: modest entries, float32 [S, H, P, N]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(S, H, P, N, generator=gen) * 0.1).to(device)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), 1e-30)


def pieces(t: tuple[torch.Tensor, ...], a: int, b: int) -> tuple[torch.Tensor, ...]:
    """Rows a:b of the per-row inputs (x, dt, A, B, C: A is per head, kept whole)."""
    x, dt, A, B, C = t
    return x[a:b], dt[a:b], A, B[a:b], C[a:b]


# ---------------------------------------------------------------- naive: the reference


@pytest.mark.parametrize("start", [0, 23, 64, 200])
@pytest.mark.parametrize("dt_max", [1e-1, 1.0], ids=["slow", "fast"])
def test_chunk_is_the_recurrence(start, dt_max):
    """The chunked form (any start, so any place on the grid) is the token-by-token recurrence within FP32_REL."""
    rows = ssd_rows(150, 4, 8, 2, 16, seed=2, dt_max=dt_max)
    state = kept(1, 4, 8, 16)[0]
    y, final = naive.chunk_ssd(*rows, state, start)
    ry, rfinal = naive.recurrent_ssd(*rows, state)
    assert relative(y, ry) < FP32_REL and relative(final, rfinal) < FP32_REL


def test_float64_math_is_a_truth():
    """float64 chunked and float64 recurrence agree to 1e-12; float32 chunked is within FP32_REL of them."""
    x, dt, A, B, C = ssd_rows(200, 2, 8, 1, 16, seed=3)
    state = kept(1, 2, 8, 16)[0]
    y64, f64 = naive.chunk_ssd(x.double(), dt, A, B.double(), C.double(), state, 5, math_dtype=torch.float64)
    r64, rf64 = naive.recurrent_ssd(x.double(), dt, A, B.double(), C.double(), state, math_dtype=torch.float64)
    assert y64.dtype == f64.dtype == torch.float64
    assert relative(y64, r64) < 1e-12 and relative(f64, rf64) < 1e-12
    y, final = naive.chunk_ssd(x, dt, A, B, C, state, 5)
    assert relative(y, y64) < FP32_REL and relative(final, f64) < FP32_REL


def test_naive_matches_hf_nemotron_h_torch_functions():
    """HF's mamba2_chunk_scan (D, dt_bias, softplus off: dt comes prepared) and mamba2_selective_state_update (the
    torch fallbacks) compute the same scan: within FP32_REL (they chunk and order sums differently)."""
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    T, H, P, G, N = 150, 4, 8, 2, 16
    x, dt, A, B, C = ssd_rows(T, H, P, G, N, seed=4)
    state = kept(1, H, P, N)[0]
    y, final = naive.chunk_ssd(x, dt, A, B, C, state)
    hy, hfinal = hf.mamba2_chunk_scan(x[None], dt[None], A, B[None], C[None], chunk_size=64,
                                      initial_states=state[None], return_final_states=True)
    assert relative(y, hy[0]) < FP32_REL and relative(final, hfinal[0]) < FP32_REL
    pool, theirs = state[None].clone(), state[None].clone()
    step = naive.ssd_step(x[:1], dt[:1], A, B[:1], C[:1], pool, [0])
    hstep = hf.mamba2_selective_state_update(theirs, x[:1], dt[:1, :, None].expand(-1, -1, P),
                                             A[:, None, None].expand(-1, P, N), B[:1], C[:1])
    assert relative(step, hstep) < FP32_REL and relative(pool, theirs) < FP32_REL


@pytest.mark.parametrize("start", [0, 37])
def test_resume_at_grid_cuts_is_bitwise(start):
    """Prefill split at absolute positions on the 64 grid (in three pieces) gives the one-shot y and state bit for
    bit; a cut off the grid agrees within FP32_REL."""
    assert naive.CHUNK == ssd.CHUNK == 64
    T = 300
    rows = ssd_rows(T, 4, 8, 2, 16, seed=5)
    state = kept(1, 4, 8, 16)[0]
    one, one_final = naive.chunk_ssd(*rows, state, start)
    cuts = [0, 128 - start, 256 - start, T]
    ys, s = [], state
    for a, b in zip(cuts, cuts[1:], strict=False):
        y, s = naive.chunk_ssd(*pieces(rows, a, b), s, start + a)
        ys.append(y)
    assert torch.equal(torch.cat(ys), one) and torch.equal(s, one_final)
    head, kept_state = naive.chunk_ssd(*pieces(rows, 0, 77), state, start)
    tail, final = naive.chunk_ssd(*pieces(rows, 77, T), kept_state, start + 77)
    assert relative(torch.cat([head, tail]), one) < FP32_REL and relative(final, one_final) < FP32_REL


def test_packed_is_each_stream_alone_bitwise():
    T, H, P, G, N = 260, 4, 8, 2, 16
    rows = ssd_rows(T, H, P, G, N, seed=6)
    cu, starts = [0, 70, 70, 75, 260], [0, 9, 37, 100]
    state = kept(4, H, P, N)
    y, final = naive.chunk_ssd(*rows, state, cu_seqlens=cu, starts=starts)
    for n in range(4):
        a, b = cu[n], cu[n + 1]
        alone, alone_final = naive.chunk_ssd(*pieces(rows, a, b), state[n], starts[n])
        assert torch.equal(y[a:b], alone) and torch.equal(final[n], alone_final)
    assert torch.equal(final[1], state[1])                                         # an empty stream keeps its state
    fresh, _ = naive.chunk_ssd(*rows, None, cu_seqlens=cu, starts=starts)
    assert torch.equal(fresh[75:], naive.chunk_ssd(*pieces(rows, 75, 260), None, 100)[0])


def test_step_is_the_recurrence_bitwise_and_leaves_other_slots():
    """The naive step over T tokens is recurrent_ssd bit for bit (one arithmetic); other slots are untouched; a
    prefill followed by steps continues the stream (within FP32_REL of one recurrence)."""
    T, H, P, G, N = 20, 4, 8, 2, 16
    x, dt, A, B, C = ssd_rows(T, H, P, G, N, seed=7)
    states = kept(5, H, P, N)
    pool = states.clone()
    ys = torch.stack([naive.ssd_step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], pool, [3])[0]
                      for t in range(T)])
    ry, rfinal = naive.recurrent_ssd(x, dt, A, B, C, states[3])
    assert torch.equal(ys, ry) and torch.equal(pool[3], rfinal)
    assert torch.equal(pool[[0, 1, 2, 4]], states[[0, 1, 2, 4]])
    y, kept_state = naive.chunk_ssd(x[:12], dt[:12], A, B[:12], C[:12], states[3])
    pool = kept_state[None].clone()
    tail = torch.stack([naive.ssd_step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], pool, [0])[0]
                        for t in range(12, T)])
    assert relative(torch.cat([y, tail]), ry) < FP32_REL and relative(pool[0], rfinal) < FP32_REL


def test_bf16_inputs_give_bf16_y_and_float32_state():
    x, dt, A, B, C = ssd_rows(70, 2, 8, 1, 16, dtype=torch.bfloat16, seed=8)
    y, final = ssd.chunk_ssd(x, dt, A, B, C)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    ref, ref_final = naive.chunk_ssd(x.float(), dt, A, B.float(), C.float())
    assert torch.equal(y, ref.bfloat16()) and torch.equal(final, ref_final)        # math in float32 from the inputs


# ---------------------------------------------------------------- the public functions: validation and dispatch


def test_cpu_dispatches_to_naive_bitwise():
    rows = ssd_rows(80, 4, 8, 2, 16)
    state = kept(2, 4, 8, 16)
    assert ssd.chunk_backend("cpu") == ssd.step_backend("cpu") == "naive"
    ours = ssd.chunk_ssd(*rows, state, cu_seqlens=[0, 30, 80], starts=[3, 0])
    ref = naive.chunk_ssd(*rows, state, cu_seqlens=[0, 30, 80], starts=[3, 0])
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    one = ssd.chunk_ssd(*rows, state[0], 70)
    assert one[1].shape == (4, 8, 16)
    assert all(torch.equal(a, b) for a, b in zip(one, naive.chunk_ssd(*rows, state[0], 70), strict=True))
    a, b = state.clone(), state.clone()
    out = ssd.ssd_step(*pieces(rows, 0, 2), a, [1, 0])
    assert torch.equal(out, naive.ssd_step(*pieces(rows, 0, 2), b, [1, 0])) and torch.equal(a, b)


def test_without_fla_cuda_falls_back_to_ours(monkeypatch):
    from tensorfold.kernels.backend import triton_installed
    monkeypatch.setattr(fla_backend, "_ops", lambda: None)
    assert not fla_backend.available()
    assert ssd.chunk_backend("cuda") == "naive"
    assert ssd.step_backend("cuda") == ("triton" if triton_installed() else "naive")
    with pytest.raises(RuntimeError, match="fla-core"):
        ssd.chunk_ssd(*ssd_rows(4, 2, 8, 1, 16), backend="fla")


CHUNK_MISTAKES = {
    "x rank": lambda a: a.update(x=a["x"][:, 0]),
    "groups": lambda a: a.update(B=torch.randn(6, 3, 16), C=torch.randn(6, 3, 16)),
    "B vs C": lambda a: a.update(C=a["C"][:, :, :8]),
    "dt shape": lambda a: a.update(dt=a["dt"][:, :2]),
    "dt dtype": lambda a: a.update(dt=a["dt"].double()),
    "A dtype": lambda a: a.update(A=a["A"].bfloat16()),
    "x dtype vs B": lambda a: a.update(x=a["x"].bfloat16()),
    "state size": lambda a: a.update(B=torch.randn(6, 2, 512), C=torch.randn(6, 2, 512)),
    "state dtype": lambda a: a.update(initial_state=kept(1, 4, 8, 16)[0].bfloat16()),
    "state shape": lambda a: a.update(initial_state=kept(1, 4, 16, 8)[0]),
    "batched state for one stream": lambda a: a.update(initial_state=kept(1, 4, 8, 16)),
    "starts without cu_seqlens": lambda a: a.update(starts=[0]),
    "cu_seqlens not to T": lambda a: a.update(cu_seqlens=[0, 5]),
    "backend": lambda a: a.update(backend="cuda-magic"),
}
STEP_MISTAKES = {
    "pool shape": lambda a: a.update(states=kept(4, 4, 16, 8)),
    "pool dtype": lambda a: a.update(states=kept(4, 4, 8, 16).double()),
    "slots count": lambda a: a.update(slots=[0, 1]),
    "repeated slot": lambda a: a.update(slots=[1, 1, -1]),
    "slot out of range": lambda a: a.update(slots=[0, 1, 4]),
    "backend": lambda a: a.update(backend="cuda-magic"),
}


def _refused(op, mistake, **args) -> None:
    mistake(args)
    with pytest.raises(ValueError):
        op(**args)


@pytest.mark.parametrize("mistake", sorted(CHUNK_MISTAKES))
def test_chunk_refuses_bad_inputs(mistake):
    x, dt, A, B, C = ssd_rows(6, 4, 8, 2, 16)
    _refused(ssd.chunk_ssd, CHUNK_MISTAKES[mistake], x=x, dt=dt, A=A, B=B, C=C)


@pytest.mark.parametrize("mistake", sorted(STEP_MISTAKES))
def test_step_refuses_bad_inputs(mistake):
    x, dt, A, B, C = ssd_rows(3, 4, 8, 2, 16)
    _refused(ssd.ssd_step, STEP_MISTAKES[mistake], x=x, dt=dt, A=A, B=B, C=C, states=kept(4, 4, 8, 16),
             slots=[0, 1, 2])


# ---------------------------------------------------------------- triton: our decode step


def _triton_step(*args):
    from tensorfold.kernels.ssd import triton_step
    return triton_step.ssd_step(*args)


@pytest.mark.triton
@pytest.mark.parametrize("shape", [(4, 8, 2, 16), (2, 24, 1, 40), (8, 16, 8, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_step_matches_naive(device, shape, dtype):
    """Within 1e-5 relative in float32 (state and y), y within 1e-2 relative in bf16 (its rounding)."""
    H, P, G, N = shape
    rows = ssd_rows(3, H, P, G, N, device, dtype, seed=9)
    states = kept(5, H, P, N, device)
    slots = torch.tensor([4, 0, 2], device=device)
    ref_pool, pool = states.clone(), states.clone()
    ref = naive.ssd_step(*rows, ref_pool, slots)
    out = _triton_step(*rows, pool, slots)
    assert out.dtype == dtype and out.shape == (3, H, P)
    assert relative(pool, ref_pool) < FP32_REL
    assert relative(out, ref) < (FP32_REL if dtype == torch.float32 else 1e-2)
    assert torch.equal(pool[[1, 3]], states[[1, 3]])


@pytest.mark.triton
def test_triton_step_is_batch_invariant_bitwise(device):
    """One stream alone and the same stream inside batches of 4 and 7 (in another slot, at another place) give the
    same bits, twice."""
    H, P, G, N = 4, 32, 2, 64
    rows = ssd_rows(7, H, P, G, N, device, seed=10)
    states = kept(8, H, P, N, device)
    alone_pool = states.clone()
    alone = _triton_step(*pieces(rows, 3, 4), alone_pool, [6])
    for Bt, slots in ((4, [1, 2, 5, 6]), (7, [0, 1, 2, 6, 3, 4, 5])):
        for _ in range(2):
            pool = states.clone()
            out = _triton_step(*pieces(rows, 0, Bt), pool, slots)
            assert torch.equal(out[3], alone[0]) and torch.equal(pool[6], alone_pool[6])


@pytest.mark.parametrize("path", ["naive", pytest.param("triton", marks=pytest.mark.triton)])
def test_step_padded_rows_touch_no_state(path, device):
    """A negative slot is a padded row of a captured batch: zero output, no slot's state read or written."""
    dev = device if path == "triton" else "cpu"
    rows = ssd_rows(3, 4, 8, 2, 16, dev, seed=11)
    states = kept(4, 4, 8, 16, dev)
    padded, live_only = states.clone(), states.clone()
    out = ssd.ssd_step(*rows, padded, torch.tensor([-1, 2, -1], device=dev), backend=path)
    alone = ssd.ssd_step(*pieces(rows, 1, 2), live_only, torch.tensor([2], device=dev), backend=path)
    assert torch.equal(out[1:2].cpu(), alone.cpu())
    assert torch.equal(out[[0, 2]].cpu(), torch.zeros(2, 4, 8))
    assert torch.equal(padded.cpu(), live_only.cpu())


# ---------------------------------------------------------------- fla in the interpreter (CPU): the adapter's glue


@pytest.mark.triton
def test_fla_adapter_in_the_interpreter(fla_interpreted):
    """q = C, k = B, v = x·dt, g = dt·A, scale 1, state_v_first states in and out, slots, zero-row alignment: fla's
    chunked and recurrent simple GLA through the adapter agree with the naive ops within FP32_REL (the interpreter
    computes dots in plain float32), and a stream's bits are the same alone and inside a varlen batch."""
    fla_interpreted(fla_backend, "fla.ops.simple_gla")
    H, P, G, N = 4, 16, 2, 32
    cu, starts = [0, 70, 75, 75, 205], [0, 37, 5, 100]
    rows = ssd_rows(cu[-1], H, P, G, N, seed=12)
    state = kept(4, H, P, N)
    ref, ref_final = naive.chunk_ssd(*rows, state, cu_seqlens=cu, starts=starts)
    for align in (False, True):
        out, final = fla_backend.chunk_ssd(*rows, state, cu_seqlens=cu, starts=starts, align_grid=align)
        assert relative(out, ref) < FP32_REL and relative(final, ref_final) < FP32_REL
        assert torch.equal(final[2], state[2])                                     # the empty stream
    alone, alone_final = fla_backend.chunk_ssd(*pieces(rows, 75, 205), state[3])
    out, final = fla_backend.chunk_ssd(*rows, state, cu_seqlens=cu, starts=starts)
    assert torch.equal(alone, out[75:]) and torch.equal(alone_final, final[3])
    pool, ref_pool, slots = kept(6, H, P, N), kept(6, H, P, N), [5, 1, 3]
    step = fla_backend.ssd_step(*pieces(rows, 0, 3), pool, slots)
    ref_step = naive.ssd_step(*pieces(rows, 0, 3), ref_pool, slots)
    assert relative(step, ref_step) < FP32_REL and relative(pool, ref_pool) < FP32_REL
    assert torch.equal(pool[[0, 2, 4]], ref_pool[[0, 2, 4]])
