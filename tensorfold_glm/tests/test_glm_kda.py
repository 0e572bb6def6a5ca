"""The KDA layer (tensorfold_glm.kda) against HF's Glm5NextTextLinearAttention, in float32 unless said otherwise.

One HF layer from a tiny Glm5NextTextConfig (hidden 64, 4 heads × 16, conv 4), its weights drawn again (HF's init
is flat) and copied into KdaWeights. Checked: a one-shot prefill of 100 rows against HF's forward without a cache;
a prefill cut at arbitrary points and then a token-by-token decode against HF driven step by step through its
cache (DynamicCache -> LinearAttentionLayer: conv_states[0] [1, C, K], recurrent_states[0] [1, H, D, D]), outputs
and the states it holds; cuts at multiples of 64 bitwise equal to one shot; a garbage slot at start 0; bf16 against
HF in bf16 (conv, A_log, dt_bias kept float32, as HF keeps them); the dispatched form's call of the chunked op
(HF's call of fla) and, on CUDA, its bf16 against HF's. Both gates: the safe gate (lower bound -5, the model's) and
the softplus one. Run with -s for the measured differences (`GLM-KDA {...}` lines).
"""

from __future__ import annotations

import json

import pytest
import torch

from tensorfold_glm.kda import KdaWeights, kimi_delta_attention

E, H, D, K, EPS = 64, 4, 16, 4, 1e-5
C = 3 * H * D
TOLERANCE = 1e-4
GATES = {"safe": -5.0, "softplus": None}


def report(**record: object) -> None:
    """Print a measurement (run with -s to see it)."""
    print("GLM-KDA " + json.dumps(record), flush=True)


def hf_layer(lower_bound: float | None, seed: int = 0):
    """A tiny HF KDA layer (index 0) and its config, every weight drawn again: matrices and the conv
    N(0, 1/fan_in); A_log = log U(0.5, 4); dt_bias = -3 + 0.5·N(0, 1) (most channels keep most of the state,
    some forget fast); o_norm 1 + 0.1·N(0, 1)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention
    config = Glm5NextTextConfig(hidden_size=E, linear_num_heads=H, linear_head_dim=D, linear_conv_kernel_dim=K,
                                linear_lower_bound=lower_bound, rms_norm_eps=EPS, num_hidden_layers=1,
                                layer_types=["linear_attention"])
    layer = Glm5NextTextLinearAttention(config, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_((0.5 + 3.5 * torch.rand(p.shape, generator=gen)).log())
            elif name.endswith("dt_bias"):
                p.copy_(-3.0 + 0.5 * noise)
            elif name == "o_norm.weight":
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
    return layer.eval(), config


def weights(layer) -> KdaWeights:
    """KdaWeights viewing the HF layer's tensors."""
    return KdaWeights(q_proj=layer.q_proj.weight, k_proj=layer.k_proj.weight, v_proj=layer.v_proj.weight,
                      conv=layer.conv1d.weight[:, 0, :], f_a_proj=layer.forget_gate.f_a_proj.weight,
                      f_b_proj=layer.forget_gate.f_b_proj.weight, b_proj=layer.b_proj.weight,
                      g_a_proj=layer.g_a_proj.weight, g_b_proj=layer.g_b_proj.weight, o_proj=layer.o_proj.weight,
                      A_log=layer.forget_gate.A_log, dt_bias=layer.forget_gate.dt_bias, o_norm=layer.o_norm.weight)


def ours(layer, x: torch.Tensor, cuts: list[int], tail: torch.Tensor | None = None,
         state: torch.Tensor | None = None, dispatch: bool | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our layer over x [T, E] in steps [cuts[i], cuts[i+1]); returns (out [T, E], conv tail, state)."""
    w = weights(layer)
    tail = torch.zeros(C, K - 1, dtype=x.dtype, device=x.device) if tail is None else tail
    state = torch.zeros(H, D, D, device=x.device) if state is None else state
    lower_bound = layer.forget_gate.safe_gate_lower_bound
    with torch.no_grad():
        outs = [kimi_delta_attention(w, H, D, K, EPS, lower_bound, x[a:b], a, tail, state, dispatch=dispatch)
                for a, b in zip(cuts, cuts[1:], strict=False)]
    return torch.cat(outs), tail, state


def theirs(layer, config, x: torch.Tensor, cuts: list[int]):
    """HF's layer over x [T, E] in the same steps through its cache; returns (out [T, E], the cache layer)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    with torch.no_grad():
        outs = [layer(x[None, a:b], cache=cache)[0] for a, b in zip(cuts, cuts[1:], strict=False)]
    return torch.cat(outs), cache.layers[0]


def hidden(T: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)).to(dtype)


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("gate", sorted(GATES))
def test_one_shot_prefill_matches_hf(gate):
    layer, config = hf_layer(GATES[gate])
    x = hidden(100)
    out, tail, state = ours(layer, x, [0, 100])
    with torch.no_grad():
        expected = layer(x[None])[0]                                               # no cache
    their_out, cached = theirs(layer, config, x, [0, 100])
    assert torch.equal(their_out, expected)                                        # HF: a cache changes no bits
    diffs = {"out": worst(out, expected), "state": worst(state, cached.recurrent_states[0][0])}
    report(test="one_shot", gate=gate, out_scale=float(expected.abs().max()), **diffs)
    assert out.shape == (100, E) and out.dtype == torch.float32
    assert float(expected.std()) > 0.1                                             # not a flat layer
    assert diffs["out"] < TOLERANCE and diffs["state"] < TOLERANCE
    assert torch.equal(tail, cached.conv_states[0][0][:, 1:])                      # HF keeps K columns, we K-1


@pytest.mark.parametrize("gate", sorted(GATES))
def test_split_prefill_then_decode_matches_hf_cache(gate):
    """Prefill cut at arbitrary points, then 10 tokens one by one: each step's rows and the states after the
    last step against HF stepped the same way through its cache, and against our own one-shot."""
    layer, config = hf_layer(GATES[gate], seed=2)
    T = 110
    x = hidden(T, seed=3)
    cuts = [0, 1, 37, 64, 99, 100, *range(101, T + 1)]
    out, tail, state = ours(layer, x, cuts)
    their_out, cached = theirs(layer, config, x, cuts)
    one, one_tail, one_state = ours(layer, x, [0, T])
    diffs = {"out_vs_hf": worst(out, their_out), "state_vs_hf": worst(state, cached.recurrent_states[0][0]),
             "out_vs_one_shot": worst(out, one), "state_vs_one_shot": worst(state, one_state)}
    report(test="split_then_decode", gate=gate, **diffs)
    assert max(diffs.values()) < TOLERANCE
    assert torch.equal(tail, cached.conv_states[0][0][:, 1:])                      # the same projections
    assert worst(tail, one_tail) < 1e-5            # a 1-row projection is not bitwise the 110-row one's row (CPU GEMM)


def test_state_after_one_step_is_hf_cache():
    """After a prefill and one decode step (HF's recurrent and causal_conv1d_update path), the states we keep
    are what HF's cache holds."""
    layer, config = hf_layer(-5.0, seed=4)
    x = hidden(41, seed=5)
    _, tail, state = ours(layer, x, [0, 40, 41])
    _, cached = theirs(layer, config, x, [0, 40, 41])
    assert torch.equal(tail, cached.conv_states[0][0][:, 1:])
    assert worst(state, cached.recurrent_states[0][0]) < 1e-5


def test_grid_cuts_are_one_shot_bitwise():
    """Steps cut at multiples of 64 run exactly the one-shot's chunks: the states, and here the outputs too."""
    layer, _ = hf_layer(-5.0, seed=6)
    x = hidden(150, seed=7)
    one, one_tail, one_state = ours(layer, x, [0, 150])
    out, tail, state = ours(layer, x, [0, 64, 128, 150])
    assert torch.equal(state, one_state) and torch.equal(tail, one_tail)
    assert torch.equal(out, one)


def test_start_zero_ignores_what_the_slot_held():
    layer, _ = hf_layer(None, seed=8)
    x = hidden(70, seed=9)
    fresh = ours(layer, x, [0, 70])
    dirty = ours(layer, x, [0, 70], tail=torch.full((C, K - 1), 7.0), state=torch.full((H, D, D), -3.0))
    assert all(torch.equal(a, b) for a, b in zip(fresh, dirty, strict=True))


def bf16_layer(seed: int):
    """The HF layer loaded in bf16 as HF loads it: conv weight, A_log, dt_bias kept float32."""
    layer, config = hf_layer(-5.0, seed=seed)
    layer = layer.to(torch.bfloat16)
    with torch.no_grad():
        for p in (layer.conv1d.weight, layer.forget_gate.A_log, layer.forget_gate.dt_bias):
            p.data = p.data.float()
    return layer, config


def test_bf16_tracks_hf_bf16():
    """In bf16 (conv weight, A_log, dt_bias float32, as HF keeps them at a bf16 load) both sides round the same
    activations; they differ by the chunk grid and bf16 noise only."""
    layer, config = bf16_layer(seed=10)
    x = hidden(90, seed=11, dtype=torch.bfloat16)
    cuts = [0, 50, 89, 90]                                                          # a prefill, a decode step
    out, tail, state = ours(layer, x, cuts)
    their_out, cached = theirs(layer, config, x, cuts)
    scale = float(their_out.float().abs().max())
    diffs = {"out_relative": worst(out, their_out) / scale, "state": worst(state, cached.recurrent_states[0][0])}
    report(test="bf16", **diffs)
    assert out.dtype == torch.bfloat16 and tail.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert torch.equal(tail, cached.conv_states[0][0][:, 1:])
    assert diffs["out_relative"] < 2e-2 and diffs["state"] < 2e-2


def recording_chunk_op(monkeypatch) -> list[tuple[tuple, dict]]:
    """Every call the layer makes to kernels/kda's chunked op (the real op still runs), in order."""
    import tensorfold_glm.kda
    from tensorfold.kernels.kda import chunk_kda
    calls: list[tuple[tuple, dict]] = []

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return chunk_kda(*args, **kwargs)

    monkeypatch.setattr(tensorfold_glm.kda, "chunk_kda", recorded)
    return calls


def test_dispatched_prefill_hands_the_op_what_hf_hands_fla(monkeypatch):
    """The dispatched form (a bf16 model on CUDA; forced here, where kernels/kda's op is the naive one) hands the
    chunked op q, k, v and beta in bf16 as the conv and the sigmoid give them, g float32, l2norm and scale
    DK^-0.5 left to the op: HF's call of fla's chunk_kda. On the CPU that gives the reference form's bits."""
    from tensorfold_glm.kda import causal_conv
    layer, _ = bf16_layer(seed=12)
    x = hidden(90, seed=13, dtype=torch.bfloat16)
    cuts = [0, 50, 89, 90]                                                          # two prefills, a decode step
    calls = recording_chunk_op(monkeypatch)
    out, tail, state = ours(layer, x, cuts, dispatch=True)
    assert len(calls) == 2                                                          # the 1-row step: recurrent
    for (q, k, v, g, beta, *_), options in calls:
        assert q.dtype == k.dtype == v.dtype == beta.dtype == torch.bfloat16 and g.dtype == torch.float32
        assert options == {"scale": D ** -0.5, "qk_l2norm": True}
    assert [call[0][6] for call in calls] == [0, 50]
    w = weights(layer)
    with torch.no_grad():
        projected = torch.cat([torch.nn.functional.linear(x[:50], p) for p in (w.q_proj, w.k_proj, w.v_proj)], -1)
        raw = causal_conv(projected, w.conv, torch.zeros(C, K - 1, dtype=torch.bfloat16)).view(50, 3, H, D)
        beta = torch.sigmoid(torch.nn.functional.linear(x[:50], w.b_proj))
    (q, k, v, _, b, _, _), _ = calls[0]
    assert torch.equal(q, raw[:, 0]) and torch.equal(k, raw[:, 1]) and torch.equal(v, raw[:, 2])   # not normalised
    assert torch.equal(b, beta)
    reference = ours(layer, x, cuts, dispatch=False)
    assert len(calls) == 2                                                          # the reference calls no op
    assert all(torch.equal(a, b) for a, b in zip((out, tail, state), reference, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_cuda_tracks_hf_bf16_on_cuda(monkeypatch):
    """On CUDA a bf16 layer runs the dispatched op (fla-core's chunk_kda when installed) from bf16 q, k, v, as HF
    does (through fla when installed there too): both within the CPU bf16 test's bound of HF."""
    layer, config = bf16_layer(seed=10)
    layer = layer.cuda()
    x = hidden(200, seed=11, dtype=torch.bfloat16).cuda()
    cuts = [0, 130, 199, 200]                                                       # two prefills, a decode step
    calls = recording_chunk_op(monkeypatch)
    out, _, state = ours(layer, x, cuts)
    assert [call[0][0].dtype for call in calls] == [torch.bfloat16] * 2
    their_out, cached = theirs(layer, config, x, cuts)
    scale = float(their_out.float().abs().max())
    diffs = {"out_relative": worst(out, their_out) / scale, "state": worst(state, cached.recurrent_states[0][0])}
    report(test="bf16_cuda", **diffs)
    assert diffs["out_relative"] < 2e-2 and diffs["state"] < 2e-2


def test_refuses_misshapen_states():
    layer, _ = hf_layer(-5.0)
    w, x = weights(layer), hidden(3)
    with pytest.raises(ValueError, match="conv_tail"):
        kimi_delta_attention(w, H, D, K, EPS, -5.0, x, 0, torch.zeros(C, K), torch.zeros(H, D, D))
    with pytest.raises(ValueError, match="state"):
        kimi_delta_attention(w, H, D, K, EPS, -5.0, x, 0, torch.zeros(C, K - 1), torch.zeros(H, D, D).double())
    with pytest.raises(ValueError, match="conv weight"):
        kimi_delta_attention(w, H, D, K + 1, EPS, -5.0, x, 0, torch.zeros(C, K), torch.zeros(H, D, D))
