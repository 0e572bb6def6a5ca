"""The stateless per-token blocks of GLM-5.3-Flash (hc.py, mlp.py) against HF glm5_next's own modules.

The oracle is a tiny `Glm5NextTextModel` (hidden 64, 4 streams, 3 layers: dense, sparse, sparse; 8 experts
top-2 + 1 shared, swiglu_limit 1.5 so the clamps bite), every weight drawn again (matrices N(0, 1/fan_in), hc
base N(0, 1) and scale U(0.5, 1.5), norm weights 1 + 0.2·N(0, 1), correction bias 0.1·N(0, 1)), and its token
mixers swapped for a stateless stand-in, so HF's own decoder-layer and model code drives the hyper-connections,
norms, MLPs and the final head mix. Each test prints its measured max diffs (`pytest -s`).

Measured (2-core CPU): float32, per layer, the hc block inputs, post, comb, layer outputs and the final hidden
state within 4.4e-6 of HF at |streams| up to ~7 (a few ulp: HF mixes the streams with a batched matmul, we sum in
stream order); the first hc_pre is bitwise HF's; dense MLP bitwise, MoE within 1.2e-6 (tolerance 1e-5 throughout).
bf16 (HF's fp32 keep-list): the whole 3-layer stack bitwise equal to HF with its default grouped_mm experts.

Batch invariance: CPU float32 GEMMs pick kernels by row count, so a row alone and the same row in a batch differ in
the last bits wherever a GEMM spans the rows (hc mixes, router logits, dense and shared MLPs). Everything else is
row by row in a fixed order and is checked bitwise; the whole functions are checked for determinism and for
alone-vs-batch agreement within 1e-6.
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tensorfold_glm.hc import HcWeights, collapse, expand, hc_coefficients, hc_head, hc_mixes, hc_post, hc_pre, rms_norm
from tensorfold_glm.mlp import MlpWeights, MoeWeights, choose, moe, route, routed_experts, swiglu, top_indices

E, MULT, LAYERS, LIMIT, ITERS, HC_EPS, RMS_EPS = 64, 4, 3, 1.5, 20, 1e-6, 1e-5
EXPERTS, TOP_K, SCALING = 8, 2, 2.5
TOL = 1e-5
KEPT_FP32 = ("hc.base", "hc.scale", "mlp.gate.weight", "e_score_correction_bias")


def tiny_config(**fields):
    from transformers import Glm5NextTextConfig
    base = dict(vocab_size=64, hidden_size=E, num_hidden_layers=LAYERS, intermediate_size=128,
                moe_intermediate_size=32, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1,
                routed_scaling_factor=SCALING, swiglu_limit=LIMIT, hc_mult=MULT, hc_sinkhorn_iters=ITERS,
                hc_eps=HC_EPS, rms_norm_eps=RMS_EPS, layer_types=["linear_attention"] * LAYERS,
                mlp_layer_types=["dense", "sparse", "sparse"], linear_num_heads=2, linear_head_dim=16,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=16, v_head_dim=16, index_n_heads=2, index_head_dim=16, pad_token_id=0)
    base.update(fields)
    return Glm5NextTextConfig(**base)


def redraw(module: torch.nn.Module, seed: int) -> None:
    """Every parameter and the correction biases drawn again, in name order, from one generator."""
    generator = torch.Generator().manual_seed(seed)
    tensors = dict(module.named_parameters())
    tensors.update((n, b) for n, b in module.named_buffers() if n.endswith("e_score_correction_bias"))
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
            if name.endswith("hc.scale"):
                value = 0.5 + torch.rand(t.shape, generator=generator)
            elif name.endswith("hc.base"):
                value = noise
            elif name.endswith("e_score_correction_bias"):
                value = 0.1 * noise
            elif t.dim() >= 2:
                value = noise * t.shape[-1] ** -0.5
            else:
                value = 1.0 + 0.2 * noise
            t.copy_(value)


class Mixer(torch.nn.Module):
    """A stateless stand-in for a layer's token mixer: tanh(x Wᵀ)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, hidden_states: torch.Tensor, **_: object) -> torch.Tensor:
        return torch.tanh(F.linear(hidden_states, self.weight))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The tiny HF model (float32, eval) with stand-in mixers; built in a clean directory (HF probes `fla`)."""
    pytest.importorskip("transformers")
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("glm-blocks"))
    try:
        from transformers.models.glm5_next import modeling_glm5_next as hf_glm
        model = hf_glm.Glm5NextTextModel(tiny_config()).eval()
    finally:
        os.chdir(here)
    redraw(model, seed=7)
    generator = torch.Generator().manual_seed(11)
    for layer in model.layers:
        layer.self_attn = Mixer(torch.randn(E, E, generator=generator) * E ** -0.5)
    return SimpleNamespace(model=model, bf16=bf16_copy(model), module=hf_glm)


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model as a bf16 load leaves it: all bf16 but HF's fp32 keep-list (hc base/scale, router, bias)."""
    kept = copy.deepcopy(model).to(torch.bfloat16)
    exact = model.state_dict()
    for name, tensor in (*kept.named_parameters(), *kept.named_buffers()):
        if name.endswith(KEPT_FP32):
            tensor.data = exact[name].clone()
    return kept


def hc_weights(hc) -> HcWeights:
    return HcWeights(fn=hc.fn.detach(), base=hc.base.detach(), scale=hc.scale.detach())


def mlp_weights(mlp) -> MlpWeights:
    return MlpWeights(gate_proj=mlp.gate_proj.weight.detach(), up_proj=mlp.up_proj.weight.detach(),
                      down_proj=mlp.down_proj.weight.detach())


def moe_weights(mlp) -> MoeWeights:
    return MoeWeights(router=mlp.gate.weight.detach(), e_score_correction_bias=mlp.gate.e_score_correction_bias,
                      gate_up=mlp.experts.gate_up_proj.detach(), down=mlp.experts.down_proj.detach(),
                      shared_experts=mlp_weights(mlp.shared_experts))


def ffn(layer, x: torch.Tensor) -> torch.Tensor:
    if hasattr(layer.mlp, "experts"):
        return moe(moe_weights(layer.mlp), x, TOP_K, SCALING, True, 1, 1, LIMIT)
    return swiglu(mlp_weights(layer.mlp), x, LIMIT)


def ours(model, embeds: torch.Tensor) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Our functions driving the same layers: final hidden state [T, E] and per-layer intermediates."""
    streams = expand(embeds, MULT)
    seen = []
    for layer in model.layers:
        record = {}
        for block, hc, norm in (("attn", layer.attn_hc, layer.input_layernorm),
                                ("ffn", layer.ffn_hc, layer.post_attention_layernorm)):
            x, post, comb = hc_pre(hc_weights(hc), streams, RMS_EPS, ITERS, HC_EPS)
            record.update({f"{block}_input": x, f"{block}_post": post, f"{block}_comb": comb})
            x = rms_norm(x, norm.weight.detach(), RMS_EPS)
            out = layer.self_attn(x) if block == "attn" else ffn(layer, x)
            streams = hc_post(out, streams, post, comb)
        record["out"] = streams
        seen.append(record)
    return rms_norm(hc_head(streams), model.norm.weight.detach(), RMS_EPS), seen


def theirs(model, embeds: torch.Tensor) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """HF's model forward, with hooks recording each hyper-connection's (post, comb, block input) and each layer."""
    seen = [{} for _ in model.layers]
    hooks = []
    for i, layer in enumerate(model.layers):
        for block in ("attn", "ffn"):
            def keep(_m, _a, result, i=i, block=block):
                post, comb, x = result
                seen[i].update({f"{block}_input": x[0], f"{block}_post": post[0], f"{block}_comb": comb[0]})
            hooks.append(getattr(layer, f"{block}_hc").register_forward_hook(keep))
        hooks.append(layer.register_forward_hook(lambda _m, _a, result, i=i: seen[i].update(out=result[0][0])))
    try:
        with torch.no_grad():
            final = model(inputs_embeds=embeds[None], use_cache=False).last_hidden_state[0]
    finally:
        for hook in hooks:
            hook.remove()
    return final, seen


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_layers_hc_and_head_match_hf(hf):
    """Expand, hc pre/post around both blocks of 3 layers, the final stream mean and norm, vs HF's model."""
    embeds = torch.randn(12, E, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        final, mine = ours(hf.model, embeds)
    ref, hers = theirs(hf.model, embeds)
    worst = {key: max(max_diff(m[key], h[key]) for m, h in zip(mine, hers, strict=True)) for key in hers[0]}
    worst["final"] = max_diff(final, ref)
    print("\nmax |diff| vs HF:", {k: f"{v:.1e}" for k, v in worst.items()},
          f"at |streams| up to {max(h['out'].abs().max().item() for h in hers):.1f}")
    assert all(v <= TOL for v in worst.values()), worst
    first = ("attn_input", "attn_post", "attn_comb")       # same streams in: HF's exact order, so the same bits
    assert all(torch.equal(mine[0][key], hers[0][key]) for key in first)
    comb = mine[-1]["ffn_comb"]
    assert max_diff(comb.sum(-1), torch.ones(())) < 1e-3 and max_diff(comb.sum(-2), torch.ones(())) < 1e-5
    assert mine[-1]["ffn_post"].std() > 0.1 and comb.std() > 0.01        # the mixes are not flat
    assert ref.std() > 0.5


def test_rms_norm_is_plain_weight(hf):
    """Glm5NextTextRMSNorm scales by w, not Qwen's zero-centred 1 + w."""
    x = torch.randn(9, E, generator=torch.Generator().manual_seed(2))
    norm = hf.model.norm
    with torch.no_grad():
        ref = norm(x)
    got = rms_norm(x, norm.weight.detach(), RMS_EPS)
    assert torch.equal(got, ref)
    assert max_diff(rms_norm(x, 1.0 + norm.weight.detach(), RMS_EPS), ref) > 0.5
    head = hf.module.Glm5NextTextHyperHead()
    streams = torch.randn(9, MULT, E, generator=torch.Generator().manual_seed(3))
    assert torch.equal(hc_head(streams), head(streams[None])[0])


def test_dense_mlp_clamps_and_matches_hf(hf):
    mlp = hf.model.layers[0].mlp
    assert not hasattr(mlp, "experts")
    x = torch.randn(16, E, generator=torch.Generator().manual_seed(4))
    w = mlp_weights(mlp)
    gate, up = F.linear(x, w.gate_proj), F.linear(x, w.up_proj)
    assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()     # all three clamps bite
    with torch.no_grad():
        ref = mlp(x)
    got = swiglu(w, x, LIMIT)
    diff = max_diff(got, ref)
    print(f"\ndense MLP max |diff| {diff:.1e}; clamped gate {(gate > LIMIT).float().mean():.0%}, "
          f"up {(up.abs() > LIMIT).float().mean():.0%}")
    assert diff <= TOL
    assert max_diff(swiglu(w, x, None), ref) > 1e-2                                 # the clamp changes the output


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_moe_matches_hf(hf, implementation):
    """Routing (sigmoid, correction bias, normalised unbiased weights × scaling) and the clamped experts."""
    mlp = hf.model.layers[1].mlp
    w = moe_weights(mlp)
    x = torch.randn(32, E, generator=torch.Generator().manual_seed(5))
    default, mlp.experts.config._experts_implementation = mlp.experts.config._experts_implementation, implementation
    try:
        with torch.no_grad():
            _, ref_weights, ref_chosen = mlp.gate(x)
            ref = mlp(x)
    finally:
        mlp.experts.config._experts_implementation = default
    weights, chosen = route(w, x, TOP_K, SCALING, True)
    unbiased = choose(torch.sigmoid(F.linear(x, w.router)), torch.zeros(EXPERTS), TOP_K, 1, 1)
    assert (unbiased != chosen).any(), "the correction bias must change a choice for this test to mean anything"
    order = ref_chosen.argsort(dim=-1)
    assert torch.equal(chosen, ref_chosen.gather(1, order))
    weight_diff = max_diff(weights, ref_weights.gather(1, order))
    gate_up = torch.einsum("te,tkfe->tkf", x, w.gate_up[chosen])
    gate, up = gate_up.chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (up.abs() > LIMIT).any()                        # routed clamps bite
    got = moe(w, x, TOP_K, SCALING, True, 1, 1, LIMIT)
    diff = max_diff(got, ref)
    print(f"\nMoE ({implementation}) max |diff| {diff:.1e}, weights {weight_diff:.1e}; "
          f"{(unbiased != chosen).any(-1).sum().item()}/32 rows routed differently by the bias")
    assert weight_diff <= 1e-6 and diff <= TOL


def test_moe_group_limited_matches_hf(hf):
    """n_group 2 / topk_group 1: both experts come from the group whose two best biased scores sum highest."""
    config = tiny_config(n_group=2, topk_group=1)
    config._experts_implementation = "grouped_mm"
    mlp = hf.module.Glm5NextTextMoE(config).eval()
    redraw(mlp, seed=8)
    w = moe_weights(mlp)
    x = torch.randn(32, E, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, _, ref_chosen = mlp.gate(x)
        ref = mlp(x)
    _, chosen = route(w, x, TOP_K, SCALING, True, n_group=2, topk_group=1)
    assert torch.equal(chosen, ref_chosen.sort(dim=-1).values)
    assert torch.equal(chosen[:, 0] // 4, chosen[:, 1] // 4)                           # one group per row
    plain = route(w, x, TOP_K, SCALING, True)[1]
    assert (plain != chosen).any()                                                      # the group limit bites
    diff = max_diff(moe(w, x, TOP_K, SCALING, True, 2, 1, LIMIT), ref)
    print(f"\ngroup-limited MoE max |diff| {diff:.1e}")
    assert diff <= TOL


def test_router_ties_go_to_the_lower_index():
    """Ours breaks ties by index; torch.topk (HF) agrees on untied rows but not always on ties."""
    tied = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1, 0.5, 0.9, 0.2]])
    assert top_indices(tied, 2).tolist() == [[1, 3]]
    assert choose(tied, torch.zeros(8), 4, 1, 1).tolist() == [[0, 1, 3, 6]]
    print(f"\ntorch.topk on the tie picks {sorted(torch.topk(tied, 2).indices[0].tolist())}, ours [1, 3]")
    scores = torch.rand(2000, 288, generator=torch.Generator().manual_seed(9))
    ref = torch.topk(scores, 8, dim=-1, sorted=False).indices.sort(dim=-1).values
    assert torch.equal(choose(scores, torch.zeros(288), 8, 1, 1), ref)


def same_row(alone: torch.Tensor, batched: torch.Tensor) -> bool:
    """Bitwise on the GPU. torch's CPU elementwise kernels run a vectorised body and a scalar tail, so where a row
    falls in the batch (and the machine's vector width) may move its last bits there: within 1e-6 on the CPU."""
    if alone.device.type == "cuda":
        return torch.equal(alone, batched)
    return alone.dtype == batched.dtype and torch.allclose(alone.float(), batched.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_by_row_parts_are_batch_invariant(hf, dtype):
    """A row alone gives the same bits as inside a batch for everything but the GEMMs."""
    layer = hf.model.layers[1]
    hc = hc_weights(layer.attn_hc)
    g = torch.Generator().manual_seed(10)
    streams = torch.randn(7, MULT, E, generator=g).to(dtype)
    mixes = hc_mixes(hc, streams, RMS_EPS)
    pre, post, comb = hc_coefficients(hc, mixes, ITERS, HC_EPS)
    out = torch.randn(7, E, generator=g).to(dtype)
    whole = (collapse(pre, streams), hc_post(out, streams, post, comb), hc_head(streams))
    w = moe_weights(layer.mlp)
    w = MoeWeights(w.router, w.e_score_correction_bias, w.gate_up.to(dtype), w.down.to(dtype), w.shared_experts)
    x = torch.randn(7, E, generator=g).to(dtype)
    weights, chosen = route(w, x, TOP_K, SCALING, True)
    routed = routed_experts(w, x, weights, chosen, LIMIT)
    for t in (0, 3, 6):
        one = slice(t, t + 1)
        p, q, c = hc_coefficients(hc, mixes[one], ITERS, HC_EPS)
        assert same_row(p, pre[one]) and same_row(q, post[one]) and same_row(c, comb[one])
        alone = (collapse(p, streams[one]), hc_post(out[one], streams[one], q, c), hc_head(streams[one]))
        assert all(same_row(a, b[one]) for a, b in zip(alone, whole, strict=True))
        assert same_row(routed_experts(w, x[one], weights[one], chosen[one], LIMIT), routed[one])


def test_whole_functions_deterministic_and_near_batch_invariant(hf):
    """Same call twice -> same bits; a row alone vs in a batch -> within 1e-6 (GEMMs may differ in the last bits)."""
    layer = hf.model.layers[1]
    hc, dense, sparse = hc_weights(layer.attn_hc), mlp_weights(hf.model.layers[0].mlp), moe_weights(layer.mlp)
    g = torch.Generator().manual_seed(12)
    streams, x = torch.randn(9, MULT, E, generator=g), torch.randn(9, E, generator=g)
    calls = {"hc_pre": lambda s, v: hc_pre(hc, s, RMS_EPS, ITERS, HC_EPS)[0],
             "swiglu": lambda s, v: swiglu(dense, v, LIMIT),
             "moe": lambda s, v: moe(sparse, v, TOP_K, SCALING, True, 1, 1, LIMIT)}
    report = {}
    for name, call in calls.items():
        whole = call(streams, x)
        assert torch.equal(whole, call(streams, x))
        alone = torch.cat([call(streams[t:t + 1], x[t:t + 1]) for t in range(9)])
        report[name] = (max_diff(alone, whole), torch.equal(alone, whole))
        assert report[name][0] <= 1e-6
    print("\nalone vs batch (max |diff|, bitwise):", report)


def test_bf16_follows_hf_dtype_order(hf):
    """At a bf16 load (fp32 keep-list) the whole stack — hc in fp32 with HF's casts, clamped bf16 MLPs, fp32
    router, routed sum in fp32 rounded once (HF's default grouped_mm) — gives HF's bits here; asserted with a
    one-ulp margin, since bf16 GEMMs of other row counts may round differently on other CPUs."""
    embeds = torch.randn(16, E, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    with torch.no_grad():
        final, mine = ours(hf.bf16, embeds)
    ref, hers = theirs(hf.bf16, embeds)
    assert final.dtype == ref.dtype == torch.bfloat16
    assert mine[1]["ffn_post"].dtype == torch.float32 and mine[1]["ffn_input"].dtype == torch.bfloat16
    same = (final == ref).float().mean().item()
    print(f"\nbf16 final: {same:.2%} of elements bitwise equal to HF, max |diff| {max_diff(final, ref):.1e}")
    assert same >= 0.99 and max_diff(final, ref) <= 2 ** -7 * ref.abs().max().item()
    assert all(torch.equal(mine[0][key], hers[0][key]) for key in ("attn_input", "attn_post", "attn_comb"))
