"""The gated delta rule kernels (core/tensorfold/kernels/gated_delta).

CPU: the naive ops agree bit for bit with tensorfold_qwen.gdn (the family's reference), keep every stream's bits
independent of the others, and match the token-by-token recurrence; the public functions validate and dispatch.
triton: our fused decode step against the naive one (in the interpreter on the CPU, on the GPU there), batch
invariant bit for bit. fla-core, when installed: its adapter against the naive ops in the interpreter (CPU), and on
the GPU the questions docs/kernels.md asks — closeness in fp32 and bf16, resumption from a kept state,
determinism, one stream alone vs inside a varlen batch. GPU tests print `GDN {json}` lines: run with -s, or read
$OUT/gdn-tests.jsonl.
"""

from __future__ import annotations

import delta_rule_cases
import pytest
import torch
from gdn_cases import kept_state, l2, qwen_prepared, relative, rows, worst

from tensorfold.kernels import gated_delta
from tensorfold.kernels.gated_delta import fla_backend, naive

# ---------------------------------------------------------------- naive: the reference, bitwise with the family's


@pytest.mark.parametrize("start", [0, 37, 64, 130])
def test_naive_chunk_matches_qwen_bitwise(start):
    from tensorfold_qwen import gdn
    T, NK, NV, DK, DV = 150, 2, 4, 16, 8
    q, k, v, g, beta = rows(T, NK, NV, DK, DV)
    state = kept_state(1, NV, DK, DV)[0]
    out, final = naive.chunk_gated_delta(q, k, v, g, beta, state, start, **l2(DK))
    qq, kk = qwen_prepared(q, k, NV, DK ** -0.5)
    theirs = state.clone()
    expected = gdn.chunked(qq, kk, v, g, beta, theirs, start)
    assert torch.equal(out, expected)
    assert torch.equal(final, theirs)


def test_naive_chunk_takes_prepared_q_bitwise():
    """The default (scale 1, no l2norm) takes q, k as the family prepares them, already repeated to NV heads."""
    from tensorfold_qwen import gdn
    T, NK, NV, DK, DV = 70, 1, 2, 8, 8
    q, k, v, g, beta = rows(T, NK, NV, DK, DV, seed=3)
    qq, kk = qwen_prepared(q, k, NV, DK ** -0.5)
    out, final = naive.chunk_gated_delta(qq, kk, v, g, beta, None, 5)
    theirs = torch.zeros(NV, DK, DV)
    assert torch.equal(out, gdn.chunked(qq, kk, v, g, beta, theirs, 5))
    assert torch.equal(final, theirs)


def test_naive_varlen_is_each_stream_alone_bitwise():
    T, NK, NV, DK, DV = 210, 2, 4, 16, 8
    q, k, v, g, beta = rows(T, NK, NV, DK, DV)
    cu, starts = [0, 70, 70, 75, 210], [0, 9, 37, 100]
    state = kept_state(4, NV, DK, DV)
    out, final = naive.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts, **l2(DK))
    for n in range(4):
        a, b = cu[n], cu[n + 1]
        alone, alone_final = naive.chunk_gated_delta(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[n],
                                                     starts[n], **l2(DK))
        assert torch.equal(out[a:b], alone)
        assert torch.equal(final[n], alone_final)
    assert torch.equal(final[1], state[1])                                         # an empty stream keeps its state


def test_naive_step_matches_qwen_bitwise_and_leaves_other_slots():
    from tensorfold_qwen import gdn
    B, NK, NV, DK, DV = 3, 2, 4, 16, 8
    q, k, v, g, beta = rows(B, NK, NV, DK, DV, seed=4)
    states = kept_state(6, NV, DK, DV)
    pool = states.clone()
    slots = [5, 0, 2]
    out = naive.recurrent_gated_delta_step(q, k, v, g, beta, pool, torch.tensor(slots), **l2(DK))
    for i, slot in enumerate(slots):
        qq, kk = qwen_prepared(q[i:i + 1], k[i:i + 1], NV, DK ** -0.5)
        theirs = states[slot].clone()
        assert torch.equal(out[i], gdn.recurrent_step(qq[0], kk[0], v[i], g[i], beta[i], theirs))
        assert torch.equal(pool[slot], theirs)
    untouched = [s for s in range(6) if s not in slots]
    assert torch.equal(pool[untouched], states[untouched])


def test_chunk_is_the_recurrence():
    """The chunked form (any start) is the token-by-token recurrence, up to float32 rounding."""
    T, NK, NV, DK, DV = 140, 1, 2, 16, 8
    q, k, v, g, beta = rows(T, NK, NV, DK, DV, seed=5)
    state = kept_state(1, NV, DK, DV)
    pool = state.clone()
    steps = torch.stack([naive.recurrent_gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                          beta[t:t + 1], pool, [0], **l2(DK))[0]
                         for t in range(T)])
    for start in (0, 23):
        out, final = naive.chunk_gated_delta(q, k, v, g, beta, state[0], start, **l2(DK))
        assert worst(out, steps) < 2e-5
        assert worst(final, pool[0]) < 2e-5


def test_resume_from_kept_state_matches_one_shot():
    T, NK, NV, DK, DV = 200, 2, 4, 16, 8
    q, k, v, g, beta = rows(T, NK, NV, DK, DV, seed=6)
    one, one_final = naive.chunk_gated_delta(q, k, v, g, beta, **l2(DK))
    for cut in (64, 77):
        head, kept = naive.chunk_gated_delta(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], **l2(DK))
        tail, final = naive.chunk_gated_delta(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], kept, cut,
                                              **l2(DK))
        assert worst(torch.cat([head, tail]), one) < 2e-5
        assert worst(final, one_final) < 2e-5


def test_float64_math_is_a_truth():
    T, NK, NV, DK, DV = 100, 1, 2, 8, 8
    q, k, v, g, beta = rows(T, NK, NV, DK, DV, seed=7)
    out32, _ = naive.chunk_gated_delta(q, k, v, g, beta, **l2(DK))
    out64, final64 = naive.chunk_gated_delta(q.double(), k.double(), v.double(), g, beta, **l2(DK),
                                             math_dtype=torch.float64)
    assert out64.dtype == final64.dtype == torch.float64
    assert worst(out32, out64) < 1e-5


# ---------------------------------------------------------------- the public functions: validation and dispatch


def test_cpu_dispatches_to_naive_bitwise():
    T, NK, NV, DK, DV = 80, 2, 4, 16, 8
    q, k, v, g, beta = rows(T, NK, NV, DK, DV)
    state = kept_state(2, NV, DK, DV)
    assert gated_delta.chunk_backend("cpu") == gated_delta.step_backend("cpu") == "naive"
    ours = gated_delta.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=[0, 30, 80], starts=[3, 0],
                                         **l2(DK))
    ref = naive.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=[0, 30, 80], starts=[3, 0], **l2(DK))
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    one = gated_delta.chunk_gated_delta(q, k, v, g, beta, state[0], 70, **l2(DK))     # one stream: [NV, DK, DV]
    assert one[1].shape == (NV, DK, DV)
    assert all(torch.equal(a, b) for a, b in zip(one, naive.chunk_gated_delta(q, k, v, g, beta, state[0], 70,
                                                                              **l2(DK)), strict=True))
    a, b = state.clone(), state.clone()
    out = gated_delta.recurrent_gated_delta_step(q[:2], k[:2], v[:2], g[:2], beta[:2], a, [1, 0])
    assert torch.equal(out, naive.recurrent_gated_delta_step(q[:2], k[:2], v[:2], g[:2], beta[:2], b, [1, 0]))
    assert torch.equal(a, b)


def test_without_fla_cuda_falls_back_to_ours(monkeypatch):
    from tensorfold.kernels.backend import triton_installed
    monkeypatch.setattr(fla_backend, "_ops", lambda: None)
    assert not fla_backend.available()
    assert gated_delta.chunk_backend("cuda") == "naive"
    assert gated_delta.step_backend("cuda") == ("triton" if triton_installed() else "naive")
    q, k, v, g, beta = rows(4, 1, 1, 8, 8)
    with pytest.raises(RuntimeError, match="fla-core"):
        gated_delta.chunk_gated_delta(q, k, v, g, beta, backend="fla")


CHUNK_MISTAKES = {
    **delta_rule_cases.CHUNK_MISTAKES,
    "heads": lambda a: a.update(v=torch.randn(6, 3, 8)),
    "g shape": lambda a: a.update(g=a["g"][:, :2]),
    "state dtype": lambda a: a.update(initial_state=kept_state(1, 4, 8, 8)[0].bfloat16()),
    "state shape": lambda a: a.update(initial_state=kept_state(3, 4, 8, 8)),
    "batched state for one stream": lambda a: a.update(initial_state=kept_state(1, 4, 8, 8)),
    "backend": lambda a: a.update(backend="cuda-magic"),
}
STEP_MISTAKES = delta_rule_cases.STEP_MISTAKES


@pytest.mark.parametrize("mistake", sorted(CHUNK_MISTAKES))
def test_chunk_refuses_bad_inputs(mistake):
    q, k, v, g, beta = rows(6, 2, 4, 8, 8)
    delta_rule_cases.assert_refused(gated_delta.chunk_gated_delta, CHUNK_MISTAKES[mistake], q=q, k=k, v=v, g=g,
                                    beta=beta)


@pytest.mark.parametrize("mistake", sorted(STEP_MISTAKES))
def test_step_refuses_bad_inputs(mistake):
    q, k, v, g, beta = rows(3, 2, 4, 8, 8)
    delta_rule_cases.assert_refused(gated_delta.recurrent_gated_delta_step, STEP_MISTAKES[mistake], q=q, k=k, v=v,
                                    g=g, beta=beta, states=kept_state(4, 4, 8, 8), slots=[0, 1, 2])


# ---------------------------------------------------------------- triton: our fused decode step


def _triton_step(*args, **kwargs):
    from tensorfold.kernels.gated_delta import triton_recurrent
    return triton_recurrent.recurrent_gated_delta_step(*args, **kwargs)


@pytest.mark.triton
@pytest.mark.parametrize("shape", [(2, 4, 16, 8), (1, 2, 32, 48), (2, 2, 24, 40)], ids=str)
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "prepared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_step_matches_naive(device, shape, l2norm, dtype):
    NK, NV, DK, DV = shape
    B = 3
    q, k, v, g, beta = rows(B, NK, NV, DK, DV, device, dtype, seed=8)
    states = kept_state(5, NV, DK, DV, device)
    slots = torch.tensor([4, 0, 2], device=device)
    ref_pool, pool = states.clone(), states.clone()
    scale = DK ** -0.5 if l2norm else 0.3
    ref = naive.recurrent_gated_delta_step(q, k, v, g, beta, ref_pool, slots, qk_l2norm=l2norm, scale=scale)
    out = _triton_step(q, k, v, g, beta, pool, slots, qk_l2norm=l2norm, scale=scale)
    assert out.dtype == dtype and out.shape == (B, NV, DV)
    assert worst(pool, ref_pool) < 1e-5
    assert relative(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(pool[[1, 3]], states[[1, 3]])


@pytest.mark.triton
def test_triton_step_is_batch_invariant_bitwise(device):
    """One stream alone and the same stream inside batches of 4 and 7 (in another slot, at another place) give the
    same bits, twice."""
    NK, NV, DK, DV = 2, 4, 32, 64
    q, k, v, g, beta = rows(7, NK, NV, DK, DV, device, seed=9)
    states = kept_state(8, NV, DK, DV, device)
    alone_pool = states.clone()
    alone = _triton_step(q[3:4], k[3:4], v[3:4], g[3:4], beta[3:4], alone_pool, [6], **l2(DK))
    for B, slots in ((4, [1, 2, 5, 6]), (7, [0, 1, 2, 6, 3, 4, 5])):
        for _ in range(2):
            pool = states.clone()
            out = _triton_step(q[:B], k[:B], v[:B], g[:B], beta[:B], pool, slots, **l2(DK))
            assert torch.equal(out[3], alone[0])
            assert torch.equal(pool[6], alone_pool[6])


@pytest.mark.triton
def test_triton_step_through_dispatch(device):
    q, k, v, g, beta = rows(2, 1, 2, 16, 16, device, seed=10)
    a, b = kept_state(3, 2, 16, 16, device), kept_state(3, 2, 16, 16, device)
    out = gated_delta.recurrent_gated_delta_step(q, k, v, g, beta, a, [2, 0], backend="triton")
    ref = naive.recurrent_gated_delta_step(q, k, v, g, beta, b, [2, 0])
    assert worst(out, ref) < 1e-5 and worst(a, b) < 1e-5


# ---------------------------------------------------------------- fla in the interpreter (CPU): the adapter's glue


@pytest.mark.triton
def test_fla_adapter_in_the_interpreter(fla_interpreted):
    """Layout, g, scale, l2norm, states in and out, slots, zero-row alignment: fla's chunked and recurrent ops
    through the adapter agree with the naive ones (the interpreter computes dots in plain float32), and a stream's
    bits are the same alone and inside a varlen batch."""
    fla_interpreted(fla_backend)
    NK, NV, DK, DV = 1, 2, 32, 16
    cu, starts = [0, 70, 75, 75, 205], [0, 37, 5, 100]
    q, k, v, g, beta = rows(cu[-1], NK, NV, DK, DV, seed=11)
    state = kept_state(4, NV, DK, DV)
    ref, ref_final = naive.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts, **l2(DK))
    out, final = fla_backend.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts,
                                               **l2(DK))
    assert worst(out, ref) < 1e-5 and worst(final, ref_final) < 1e-5
    aligned, aligned_final = fla_backend.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts,
                                                           **l2(DK), align_grid=True)
    assert worst(aligned, ref) < 1e-5 and worst(aligned_final, ref_final) < 1e-5
    assert torch.equal(final[2], state[2])                                         # the empty stream
    alone, alone_final = fla_backend.chunk_gated_delta(q[75:], k[75:], v[75:], g[75:], beta[75:], state[3],
                                                       **l2(DK))
    assert torch.equal(alone, out[75:]) and torch.equal(alone_final, final[3])
    one, one_final = fla_backend.chunk_gated_delta(q[75:], k[75:], v[75:], g[75:], beta[75:], state[3], 100,
                                                   align_grid=True, **l2(DK))
    assert worst(one, ref[75:]) < 1e-5 and worst(one_final, ref_final[3]) < 1e-5
    pool, ref_pool, slots = kept_state(6, NV, DK, DV), kept_state(6, NV, DK, DV), [5, 1, 3]
    step = fla_backend.recurrent_gated_delta_step(q[:3], k[:3], v[:3], g[:3], beta[:3], pool, slots,
                                                  **l2(DK))
    ref_step = naive.recurrent_gated_delta_step(q[:3], k[:3], v[:3], g[:3], beta[:3], ref_pool, slots,
                                                **l2(DK))
    assert worst(step, ref_step) < 1e-5 and worst(pool, ref_pool) < 1e-5
    assert torch.equal(pool[[0, 2, 4]], ref_pool[[0, 2, 4]])




@pytest.mark.parametrize("path", ["naive", pytest.param("triton", marks=pytest.mark.triton)])
def test_step_padded_rows_touch_no_state(path, device):
    """A negative slot is a padded row of a captured batch: zero output, no slot's state read or written."""
    dev = device if path == "triton" else "cpu"
    B, NK, NV, DK, DV = 3, 2, 4, 16, 8
    q, k, v, g, beta = (t.to(dev) for t in rows(B, NK, NV, DK, DV, seed=9))
    states = kept_state(4, NV, DK, DV).to(dev)
    padded, live_only = states.clone(), states.clone()
    out = gated_delta.recurrent_gated_delta_step(q, k, v, g, beta, padded, torch.tensor([-1, 2, -1]).to(dev),
                                                 backend=path, **l2(DK))
    alone = gated_delta.recurrent_gated_delta_step(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], live_only,
                                                   torch.tensor([2]).to(dev), backend=path, **l2(DK))
    assert torch.equal(out[1:2].cpu(), alone.cpu())
    assert torch.equal(out[[0, 2]].cpu(), torch.zeros(2, NV, DV))
    assert torch.equal(padded.cpu(), live_only.cpu())


def test_step_rejects_repeated_live_slots_but_not_repeated_pads():
    B, NK, NV, DK, DV = 3, 2, 4, 16, 8
    q, k, v, g, beta = rows(B, NK, NV, DK, DV, seed=9)
    states = kept_state(4, NV, DK, DV)
    gated_delta.recurrent_gated_delta_step(q, k, v, g, beta, states, [-1, 1, -1], **l2(DK))
    with pytest.raises(ValueError, match="distinct"):
        gated_delta.recurrent_gated_delta_step(q, k, v, g, beta, states, [1, 1, -1], **l2(DK))


def _raw_gate(B: int, NV: int, device: str, dtype: torch.dtype, seed: int):
    """Raw projections a, b [B, NV] (the model's dtype) and a layer's A_log, dt_bias [NV]."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(B, NV, generator=gen).to(device, dtype)
    b = torch.randn(B, NV, generator=gen).to(device, dtype)
    A_log = torch.empty(NV).uniform_(0, 2.7, generator=gen).to(device, dtype)
    dt_bias = torch.randn(NV, generator=gen).to(device, dtype)
    return a, b, A_log, dt_bias


def test_naive_gated_step_is_the_unfused_step_bitwise():
    """The gate computed from raw projections, then the step with q/k normalised: the models' own arithmetic."""
    NK, NV, DK, DV = 2, 4, 16, 8
    q, k, v, _, _ = rows(3, NK, NV, DK, DV, seed=13)
    a, b, A_log, dt_bias = _raw_gate(3, NV, "cpu", torch.float32, seed=14)
    states = kept_state(4, NV, DK, DV)
    fused_pool, unfused_pool = states.clone(), states.clone()
    slots = torch.tensor([3, -1, 1])
    out = gated_delta.recurrent_gated_delta_step_gated(q, k, v, a, b, A_log, dt_bias, fused_pool, slots,
                                                       scale=DK ** -0.5, backend="naive")
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    expected = naive.recurrent_gated_delta_step(q, k, v, g, torch.sigmoid(b).float(), unfused_pool, slots,
                                                **l2(DK))
    assert torch.equal(out, expected) and torch.equal(fused_pool, unfused_pool)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_gated_step_matches_naive(device, dtype):
    NK, NV, DK, DV = 2, 4, 32, 16
    q, k, v, _, _ = rows(3, NK, NV, DK, DV, device, dtype, seed=15)
    a, b, A_log, dt_bias = _raw_gate(3, NV, device, dtype, seed=16)
    a[0, 0], a[1, 1], a[2, 2] = 25.0, -18.0, 0.0                                    # softplus's three branches
    states = kept_state(4, NV, DK, DV, device)
    ref_pool, pool = states.clone(), states.clone()
    slots = torch.tensor([2, 0, -1], device=device)
    args = (q, k, v, a, b, A_log, dt_bias)
    ref = gated_delta.recurrent_gated_delta_step_gated(*args, ref_pool, slots, scale=DK ** -0.5, backend="naive")
    out = gated_delta.recurrent_gated_delta_step_gated(*args, pool, slots, scale=DK ** -0.5, backend="triton")
    assert worst(pool, ref_pool) < 1e-5
    assert relative(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(pool[[1, 3]], states[[1, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_from_terms_is_the_gate_bitwise(device, dtype):
    """The gate's per-layer factors computed once (gate_terms) give the bits of the gate computed in the step
    (written out here as the models wrote it), from a and b cut out of one projection as the batched step cuts
    them, on this device (a bf16 a is promoted to float32 inside the add, exactly)."""
    NV = 16
    proj, _, A_log, dt_bias = _raw_gate(9, 3 * NV, device, dtype, seed=17)
    proj[0, 0], proj[1, NV + 1], proj[2, 2] = 25.0, -18.0, 0.0                     # softplus's three branches
    a, b, A_log, dt_bias = proj[:, NV:2 * NV], proj[:, 2 * NV:], A_log[:NV], dt_bias[:NV]
    g, beta = gated_delta.gdn_gate_from_terms(a, b, *gated_delta.gate_terms(A_log, dt_bias))
    expected_g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    assert g.dtype == beta.dtype == torch.float32
    assert torch.equal(g, expected_g) and torch.equal(beta, torch.sigmoid(b).float())
    assert all(torch.equal(x, y) for x, y in zip(gated_delta.gdn_gate(a, b, A_log, dt_bias), (g, beta), strict=True))
    with pytest.raises(ValueError, match="float32"):
        gated_delta.gdn_gate_from_terms(a, b, A_log.bfloat16(), dt_bias.float())
