"""Kimi Delta Attention kernels (core/tensorfold/kernels/kda), CPU path.

The naive ops against HF glm5_next's torch functions (`chunk_kimi_delta_attention`,
`recurrent_kimi_delta_attention`, `Glm5NextTextForgetGate`): the decode step and the gate bit for bit, the chunked
form within 1e-5 of HF's chunked form relative to the output scale (measured about 1e-7); a prefill split on the
absolute grid of 64 equals the one-shot prefill bit for bit; strong decays (the -5 lower bound, and -50 per step)
stay finite and equal to the recurrence; the public functions validate and dispatch. With fla-core installed (and no
CUDA), the fla adapter's glue against the naive ops in triton's interpreter (marked `triton`); the GPU questions are
test_kda_gpu.py's. Run with -s to see the measured differences (`KDA {...}` lines).
"""

from __future__ import annotations

import json

import delta_rule_cases
import pytest
import torch
from kda_cases import kept_state, l2, relative, rows, worst

from tensorfold.kernels import kda
from tensorfold.kernels.kda import fla_backend, naive


def report(**record: object) -> None:
    """Print a measurement (run with -s to see it)."""
    print("KDA " + json.dumps(record), flush=True)


def hf():
    """HF's glm5_next module (imported lazily: transformers is a test-only dependency)."""
    from transformers.models.glm5_next import modeling_glm5_next
    return modeling_glm5_next


def hf_chunk(q, k, v, g, beta, state):
    """HF's torch chunked KDA on one stream (batch 1, chunks from the first row); returns (out, final)."""
    out, final = hf().chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                 initial_state=None if state is None else state[None],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def hf_recurrent(q, k, v, g, beta, state):
    """HF's torch token-by-token KDA on one stream; returns (out, final)."""
    out, final = hf().recurrent_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                     initial_state=None if state is None else state[None],
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


# ---------------------------------------------------------------- naive against HF


@pytest.mark.parametrize(("fresh", "bound"), [(True, -5.0), (False, -0.05)])
def test_chunk_matches_hf_chunk_and_recurrence(fresh, bound):
    T, H, DK, DV = 150, 3, 16, 32
    q, k, v, g, beta = rows(T, H, DK, DV, bound=bound)
    state = None if fresh else kept_state(1, H, DK, DV)[0]
    out, final = naive.chunk_kda(q, k, v, g, beta, state, 0, **l2(DK))
    hf_out, hf_final = hf_chunk(q, k, v, g, beta, state)
    rec_out, rec_final = hf_recurrent(q, k, v, g, beta, state)
    diffs = {"out_vs_hf_chunk": relative(out, hf_out), "state_vs_hf_chunk": relative(final, hf_final),
             "out_vs_hf_recurrent": relative(out, rec_out), "state_vs_hf_recurrent": relative(final, rec_final)}
    report(test="chunk_vs_hf", fresh=fresh, bound=bound, **diffs)
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    assert max(diffs.values()) < 1e-5


@pytest.mark.parametrize("start", [5, 64, 100])
def test_chunk_at_any_start_is_hf_recurrence(start):
    """The absolute grid moves the chunk boundaries; the result stays the recurrence."""
    T, H, DK, DV = 130, 2, 16, 16
    q, k, v, g, beta = rows(T, H, DK, DV, seed=2, bound=-0.05)
    state = kept_state(1, H, DK, DV)[0]
    out, final = naive.chunk_kda(q, k, v, g, beta, state, start, **l2(DK))
    rec_out, rec_final = hf_recurrent(q, k, v, g, beta, state)
    report(test="chunk_start_vs_hf_recurrent", start=start, out=relative(out, rec_out),
           state=relative(final, rec_final))
    assert relative(out, rec_out) < 1e-5
    assert relative(final, rec_final) < 1e-5


def test_step_is_hf_recurrence_bitwise():
    """The decode step does HF's recurrent arithmetic op for op: token by token it equals HF bit for bit."""
    T, H, DK, DV = 20, 3, 16, 8
    q, k, v, g, beta = rows(T, H, DK, DV, seed=3)
    state = kept_state(1, H, DK, DV)
    pool = state.clone()
    steps = torch.stack([naive.recurrent_kda_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                  pool, [0], **l2(DK))[0] for t in range(T)])
    rec_out, rec_final = hf_recurrent(q, k, v, g, beta, state[0])
    assert torch.equal(steps, rec_out)
    assert torch.equal(pool[0], rec_final)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_gate_is_hf_forget_gate_bitwise(lower_bound):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    H, DK, E, T = 3, 8, 32, 7
    config = Glm5NextTextConfig(hidden_size=E, linear_num_heads=H, linear_head_dim=DK, linear_lower_bound=lower_bound,
                                num_hidden_layers=1)
    gate = hf().Glm5NextTextForgetGate(config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in (gate.f_a_proj.weight, gate.f_b_proj.weight):
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        gate.A_log.copy_(torch.empty(H).uniform_(0.5, 4.0, generator=gen).log())
        gate.dt_bias.copy_(torch.randn(H * DK, generator=gen) * 0.5)
        x = torch.randn(1, T, E, generator=gen) * 3
        expected = gate(x)[0]                                                      # [T, H, DK]
        f = gate.f_b_proj(gate.f_a_proj(x))[0]
    b = torch.randn(T, H, generator=gen)
    g, beta = kda.kda_gate(f, b, gate.A_log, gate.dt_bias, lower_bound)
    assert g.shape == (T, H, DK) and g.dtype == torch.float32
    assert torch.equal(g, expected)
    assert torch.equal(beta, torch.sigmoid(b))
    if lower_bound is not None:
        assert (g > lower_bound).all() and (g < 0).all()


# ---------------------------------------------------------------- resumption, the grid, strong decays


def test_split_on_the_grid_is_one_shot_bitwise():
    """Steps cut at multiples of 64 run exactly the one-shot prefill's blocks: same bits, outputs and states."""
    T, H, DK, DV = 200, 2, 16, 16
    q, k, v, g, beta = rows(T, H, DK, DV, seed=5, bound=-0.05)
    state = kept_state(1, H, DK, DV)[0]
    for origin in (0, 64):                                                         # one-shot from position origin
        one, one_final = naive.chunk_kda(q, k, v, g, beta, state, origin, **l2(DK))
        cuts = [0, 64, 128, T] if origin == 0 else [0, 64, 192, T]                 # absolute cuts origin + c
        outs, kept = [], state
        for a, b in zip(cuts, cuts[1:], strict=False):
            out, kept = naive.chunk_kda(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], kept, origin + a, **l2(DK))
            outs.append(out)
        assert torch.equal(torch.cat(outs), one)
        assert torch.equal(kept, one_final)


def test_split_anywhere_is_one_shot_within_rounding():
    T, H, DK, DV = 200, 2, 16, 16
    q, k, v, g, beta = rows(T, H, DK, DV, seed=6, bound=-0.05)
    one, one_final = naive.chunk_kda(q, k, v, g, beta, **l2(DK))
    largest = 0.0
    for cuts in ([0, 30, T], [0, 1, 77, 78, 150, T]):
        outs, kept = [], None
        for a, b in zip(cuts, cuts[1:], strict=False):
            out, kept = naive.chunk_kda(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], kept, a, **l2(DK))
            outs.append(out)
        largest = max(largest, relative(torch.cat(outs), one), relative(kept, one_final))
    report(test="split_anywhere", relative=largest)
    assert largest < 1e-5


@pytest.mark.parametrize("per_step", [-5.0, -50.0, -1e-4])
def test_extreme_decays_stay_finite_and_exact(per_step):
    """A chunk's cumulative decay reaches 64·per_step (-320, -3200): the pairwise form never forms exp(+G)."""
    T, H, DK, DV = 140, 2, 16, 16
    q, k, v, _, beta = rows(T, H, DK, DV, seed=7)
    g = torch.full((T, H, DK), per_step)
    g[:, :, ::2] = -1e-3                                                           # slow channels beside fast ones
    state = kept_state(1, H, DK, DV)[0]
    out, final = naive.chunk_kda(q, k, v, g, beta, state, 9, **l2(DK))
    rec_out, rec_final = hf_recurrent(q, k, v, g, beta, state)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert relative(out, rec_out) < 1e-5
    assert relative(final, rec_final) < 1e-5


def test_step_after_chunk_continues_the_stream():
    """Prefill in chunks, then decode token by token: the same as one-shot over all rows."""
    T, P, H, DK, DV = 90, 70, 2, 16, 16
    q, k, v, g, beta = rows(T, H, DK, DV, seed=8, bound=-0.05)
    one, one_final = naive.chunk_kda(q, k, v, g, beta, **l2(DK))
    head, kept = naive.chunk_kda(q[:P], k[:P], v[:P], g[:P], beta[:P], **l2(DK))
    pool = kept[None].clone()
    tail = [naive.recurrent_kda_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], pool, [0],
                                     **l2(DK))[0] for t in range(P, T)]
    assert relative(torch.cat([head, torch.stack(tail)]), one) < 1e-5
    assert relative(pool[0], one_final) < 1e-5


def test_float64_math_is_a_truth():
    T, H, DK, DV = 100, 2, 16, 16
    q, k, v, g, beta = rows(T, H, DK, DV, seed=9)
    out32, final32 = naive.chunk_kda(q, k, v, g, beta, **l2(DK))
    out64, final64 = naive.chunk_kda(q.double(), k.double(), v.double(), g, beta, **l2(DK),
                                     math_dtype=torch.float64)
    assert out64.dtype == final64.dtype == torch.float64
    assert relative(out32, out64) < 1e-5 and relative(final32, final64) < 1e-5


def test_bf16_inputs_compute_in_float32():
    T, H, DK, DV = 70, 2, 16, 16
    q, k, v, g, beta = rows(T, H, DK, DV, seed=10, dtype=torch.bfloat16)
    out, final = kda.chunk_kda(q, k, v, g, beta, None, 3, **l2(DK))
    ref, ref_final = naive.chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), None, 3, **l2(DK))
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert torch.equal(out, ref.bfloat16()) and torch.equal(final, ref_final)


# ---------------------------------------------------------------- packed streams, the step's pool


def test_varlen_is_each_stream_alone_bitwise():
    T, H, DK, DV = 210, 2, 16, 8
    q, k, v, g, beta = rows(T, H, DK, DV, seed=11)
    cu, starts = [0, 70, 70, 75, 210], [0, 9, 37, 100]
    state = kept_state(4, H, DK, DV)
    out, final = kda.chunk_kda(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts, **l2(DK))
    for n in range(4):
        a, b = cu[n], cu[n + 1]
        alone, alone_final = naive.chunk_kda(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[n], starts[n],
                                             **l2(DK))
        assert torch.equal(out[a:b], alone)
        assert torch.equal(final[n], alone_final)
    assert torch.equal(final[1], state[1])                                         # an empty stream keeps its state


def test_step_updates_only_its_slots():
    B, H, DK, DV = 3, 2, 16, 8
    q, k, v, g, beta = rows(B, H, DK, DV, seed=12)
    states = kept_state(6, H, DK, DV)
    pool = states.clone()
    out = kda.recurrent_kda_step(q, k, v, g, beta, pool, torch.tensor([5, -1, 2]), **l2(DK))
    for i, slot in ((0, 5), (2, 2)):
        alone = states[slot:slot + 1].clone()
        assert torch.equal(out[i], naive.recurrent_kda_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1],
                                                            beta[i:i + 1], alone, [0], **l2(DK))[0])
        assert torch.equal(pool[slot], alone[0])
    assert torch.equal(out[1], torch.zeros(H, DV))                                 # the padded row
    untouched = [0, 1, 3, 4]
    assert torch.equal(pool[untouched], states[untouched])


# ---------------------------------------------------------------- the public functions: validation and dispatch


def test_public_functions_are_the_naive_ones_bitwise():
    T, H, DK, DV = 80, 2, 16, 8
    q, k, v, g, beta = rows(T, H, DK, DV, seed=13)
    state = kept_state(1, H, DK, DV)[0]
    ours = kda.chunk_kda(q, k, v, g, beta, state, 70, **l2(DK))
    ref = naive.chunk_kda(q, k, v, g, beta, state, 70, **l2(DK))
    assert ours[0].shape == (T, H, DV) and ours[1].shape == (H, DK, DV)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


CHUNK_MISTAKES = {
    **delta_rule_cases.CHUNK_MISTAKES,
    "v heads": lambda a: a.update(v=torch.randn(6, 3, 8)),
    "g per head only": lambda a: a.update(g=a["g"][..., 0]),
    "beta shape": lambda a: a.update(beta=a["beta"][:, :1]),
    "state dtype": lambda a: a.update(initial_state=kept_state(1, 2, 8, 8)[0].bfloat16()),
    "state shape": lambda a: a.update(initial_state=kept_state(1, 2, 8, 4)[0]),
    "batched state for one stream": lambda a: a.update(initial_state=kept_state(1, 2, 8, 8)),
    "backend": lambda a: a.update(backend="fla"),
}
STEP_MISTAKES = {
    **delta_rule_cases.STEP_MISTAKES,
    "slot tensor dtype": lambda a: a.update(slots=torch.tensor([0.0, 1.0, 2.0])),
    "g per head only": lambda a: a.update(g=a["g"][..., 0]),
}


@pytest.mark.parametrize("mistake", sorted(CHUNK_MISTAKES))
def test_chunk_refuses_bad_inputs(mistake):
    q, k, v, g, beta = rows(6, 2, 8, 8)
    delta_rule_cases.assert_refused(kda.chunk_kda, CHUNK_MISTAKES[mistake], q=q, k=k, v=v, g=g, beta=beta)


@pytest.mark.parametrize("mistake", sorted(STEP_MISTAKES))
def test_step_refuses_bad_inputs(mistake):
    q, k, v, g, beta = rows(3, 2, 8, 8)
    delta_rule_cases.assert_refused(kda.recurrent_kda_step, STEP_MISTAKES[mistake], q=q, k=k, v=v, g=g, beta=beta,
                                    states=kept_state(4, 2, 8, 8), slots=[0, 1, 2])


# ---------------------------------------------------------------- fla in the interpreter (CPU): the adapter's glue


@pytest.mark.triton
def test_fla_adapter_in_the_interpreter(fla_interpreted):
    """Layout, g, scale, l2norm, states in and out, an empty stream, zero-row alignment, slots with padded rows,
    the in-place pool kernel: fla's ops through the adapter agree with the naive ones (the interpreter computes
    dots in plain float32), and a stream's bits are the same alone and inside a varlen batch. (safe_gate uses a
    gather the interpreter lacks: GPU only.)"""
    fla_interpreted(fla_backend, "fla.ops.kda.fused_recurrent")
    H, DK, DV = 2, 32, 16
    cu, starts = [0, 70, 75, 75, 205], [0, 37, 5, 100]
    q, k, v, g, beta = rows(cu[-1], H, DK, DV, seed=11, bound=-0.5)
    state = kept_state(4, H, DK, DV)
    ref, ref_final = naive.chunk_kda(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts, **l2(DK))
    out, final = fla_backend.chunk_kda(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts, **l2(DK))
    assert worst(out, ref) < 1e-5 and worst(final, ref_final) < 1e-5
    aligned, aligned_final = fla_backend.chunk_kda(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts,
                                                   align_grid=True, **l2(DK))
    assert worst(aligned, ref) < 1e-5 and worst(aligned_final, ref_final) < 1e-5
    assert torch.equal(final[2], state[2]) and torch.equal(aligned_final[2], state[2])       # the empty stream
    alone, alone_final = fla_backend.chunk_kda(q[75:], k[75:], v[75:], g[75:], beta[75:], state[3], **l2(DK))
    assert torch.equal(alone, out[75:]) and torch.equal(alone_final, final[3])
    slots = [5, -1, 1, 3, -1]
    ref_pool = kept_state(6, H, DK, DV)
    ref_step = naive.recurrent_kda_step(q[:5], k[:5], v[:5], g[:5], beta[:5], ref_pool, slots, **l2(DK))
    for in_place in (False, True):
        pool = kept_state(6, H, DK, DV)
        step = fla_backend.recurrent_kda_step(q[:5], k[:5], v[:5], g[:5], beta[:5], pool, torch.tensor(slots),
                                              in_place=in_place, **l2(DK))
        assert worst(step, ref_step) < 1e-5 and worst(pool, ref_pool) < 1e-5
        assert torch.equal(step[[1, 4]], torch.zeros_like(step[[1, 4]]))
        assert torch.equal(pool[[0, 2, 4]], ref_pool[[0, 2, 4]])
