"""GLM's MoE on the Triton path (mlp.moe_fused, fused.fuse_moe): the folded layout holds nothing twice and keeps the
reference's values; on the Triton path (triton's interpreter on the CPU, the device with CUDA) the decode step's
`moe_routed` and the prefill's `moe` equal the CPU reference (`route`, the pair-by-pair `routed_experts`, `swiglu`)
within the kernels' tolerances (float32 1e-5, bfloat16 2^-6), with the shared expert folded in as expert N
(n_shared_experts = 1) or apart, group-limited routing and unnormalised weights included; a row's bits do not
depend on its batch; the loader folds for a Triton device only; the identity names the algorithm.

The routing kernel breaks ties as `mlp.choose` does (the lower index), so no row is left out of the comparisons;
its sigmoid and its sum over the chosen scores may differ from torch's in the last float32 bits, which on these
random float32 logits never reorders two experts.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest
import torch
import torch.nn.functional as F

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold.testing.cuda_graphs import captured, without_host_sync
from tensorfold_glm import load as loader
from tensorfold_glm import mlp, plugin
from tensorfold_glm.fused import can_fold, fuse_moe
from tensorfold_glm.mlp import MlpWeights, MoeWeights

CUDA = torch.cuda.is_available()
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
E, N, F_EXPERT, K, SCALING, LIMIT = 64, 16, 32, 4, 2.5, 0.5
# (n_group, topk_group, norm_topk_prob): GLM-5's plain top-k, group-limited, unnormalised
ROUTINGS = [pytest.param((1, 1, True), id="topk"), pytest.param((4, 2, True), id="groups"),
            pytest.param((1, 1, False), id="raw")]


def weights(dtype: torch.dtype, shared_f: int, seed: int = 0, device: str = "cpu") -> MoeWeights:
    """A MoE layer drawn N(0, 1/fan_in), unfused; router and bias float32 as the loader holds them."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(device=device, dtype=dtype)

    return MoeWeights(router=draw(N, E).float(), e_score_correction_bias=(0.1 * torch.randn(N, generator=g)).to(device),
                      gate_up=draw(N, 2 * F_EXPERT, E), down=draw(N, E, F_EXPERT),
                      shared_experts=MlpWeights(draw(shared_f, E), draw(shared_f, E), draw(E, shared_f)))


def rows(T: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def reference(w: MoeWeights, x: torch.Tensor, routing: tuple[int, int, bool]) -> torch.Tensor:
    """`moe`'s CPU path: torch routing, each (row, expert) pair its own GEMM, the shared expert added."""
    n_group, topk_group, norm = routing
    mix, chosen = mlp.route(w, x, K, SCALING, norm, n_group, topk_group)
    return mlp.routed_experts(w, x, mix, chosen, LIMIT) + mlp.swiglu(w.shared_experts, x, LIMIT)


def fused_call(w: MoeWeights, x: torch.Tensor, routing: tuple[int, int, bool], kind: str) -> torch.Tensor:
    """The decode step's `moe_routed`, or the prefill's `moe`."""
    n_group, topk_group, norm = routing
    call = mlp.moe_routed if kind == "decode" else mlp.moe
    return call(w, x, K, SCALING, norm, n_group, topk_group, LIMIT)


def shares_storage(view: torch.Tensor, whole: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


# ---- the layout -------------------------------------------------------------------------------------------------

def test_the_folded_layout_holds_the_same_tensors_once():
    w = weights(torch.float32, F_EXPERT)
    assert can_fold(w)
    fused = fuse_moe(w)
    assert fuse_moe(fused) is fused
    assert fused.experts_gate_up.shape == (N + 1, 2 * F_EXPERT, E)
    assert fused.experts_down.shape == (N + 1, E, F_EXPERT)
    for name in ("router", "e_score_correction_bias", "gate_up", "down"):
        assert torch.equal(getattr(fused, name), getattr(w, name)), name
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(fused.shared_experts, name), getattr(w.shared_experts, name)), name
    for view in (fused.gate_up, fused.shared_experts.gate_proj, fused.shared_experts.up_proj):
        assert shares_storage(view, fused.experts_gate_up) and view.is_contiguous()
    for view in (fused.down, fused.shared_experts.down_proj):
        assert shares_storage(view, fused.experts_down) and view.is_contiguous()
    x = rows(9, torch.float32, seed=1)
    assert torch.equal(mlp.moe(fused, x, K, SCALING, True, 1, 1, LIMIT), mlp.moe(w, x, K, SCALING, True, 1, 1, LIMIT))


def test_a_wider_shared_expert_is_not_folded():
    w = weights(torch.float32, 2 * F_EXPERT)                 # n_shared_experts = 2
    assert not can_fold(w)
    with pytest.raises(ValueError, match="cannot fold"):
        fuse_moe(w)


# ---- the Triton path (interpreter on the CPU) ---------------------------------------------------------------

@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Triton path on the CPU tensors: the packages routed to their Triton forms, run by the interpreter."""
    if CUDA:
        pytest.skip("with CUDA the device is tested (the gpu case)")
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    import tensorfold.kernels.moe as moe_package
    from tensorfold.kernels.moe import routing, triton_moe, triton_routing
    from tensorfold.testing.triton_interpreter import interpreter_fixes
    if not all(isinstance(kernel, InterpretedFunction)
               for kernel in (triton_moe._gate_up_kernel, triton_routing._sigmoid_route_kernel)):
        pytest.skip("triton was imported for the compiler before this test (run it in its own process)")
    for module in (mlp, moe_package, routing):
        monkeypatch.setattr(module, "use_triton", lambda tensor: True)
    with interpreter_fixes():
        yield


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shared_f", [F_EXPERT, 2 * F_EXPERT], ids=["folded", "apart"])
@pytest.mark.parametrize("T, kind", [(1, "decode"), (9, "decode"), (40, "prefill")])
def test_the_fused_path_is_the_reference_within_tolerance(triton_path, T, kind, shared_f, routing, dtype):
    w = weights(dtype, shared_f, seed=T)
    fused = fuse_moe(w) if can_fold(w) else w
    x = rows(T, dtype, seed=100 + T)
    got = fused_call(fused, x, routing, kind)
    assert got.dtype == dtype and got.shape == (T, E)
    torch.testing.assert_close(got, reference(w, x, routing), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_rows_bits_do_not_depend_on_its_batch(triton_path, kind):
    """Within a kind: a row alone, in a slice and in the whole batch gives the same bits (bf16, folded, groups)."""
    w = fuse_moe(weights(torch.bfloat16, F_EXPERT, seed=7))
    x = rows(24, torch.bfloat16, seed=8)
    routing = (4, 2, True)
    whole = fused_call(w, x, routing, kind)
    assert torch.equal(whole, fused_call(w, x, routing, kind))
    for t in (0, 13, 23):
        assert torch.equal(fused_call(w, x[t:t + 1], routing, kind)[0], whole[t]), t
    assert torch.equal(fused_call(w, x[5:14], routing, kind), whole[5:14])


# ---- the loader and the identity ------------------------------------------------------------------------------

def test_the_loader_folds_for_a_triton_device_only(tmp_path):
    """On the CPU the layers load as before; where Triton runs (stood in for here) every MoE layer gets the folded
    layout, holding the same values. The CPU reference's logits over it agree to float32 rounding, not bitwise (the
    CPU's BLAS may round a product by its operand's address, and the stacked copies sit elsewhere)."""
    family = load_families(["glm"])["glm"]
    plugin.write_tiny(tmp_path, seed=3)
    plain = kit.load(family, tmp_path)
    moe_layers = [layer.ffn for layer in plain.model.weights.layers if isinstance(layer.ffn, MoeWeights)]
    assert moe_layers and all(ffn.experts_gate_up is None for ffn in moe_layers)
    fused = kit.load_as_for_triton(family, tmp_path, loader)
    for mine, theirs in zip(fused.model.weights.layers, plain.model.weights.layers, strict=True):
        if not isinstance(theirs.ffn, MoeWeights):
            continue
        assert mine.ffn.experts_gate_up is not None
        for name in ("router", "e_score_correction_bias", "gate_up", "down"):
            assert torch.equal(getattr(mine.ffn, name), getattr(theirs.ffn, name)), name
        pairs = zip(attrs.astuple(mine.ffn.shared_experts), attrs.astuple(theirs.ffn.shared_experts), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    plan = StepPlan((StreamStep(0, 0, tuple(range(3, 20))),))
    torch.testing.assert_close(fused.model.forward(plan, fused.store(1, 32)),
                               plain.model.forward(plan, plain.store(1, 32)), rtol=0.0, atol=1e-5)


def test_the_identity_names_the_fused_experts():
    one = plugin.family_identity(plugin.TINY_CONFIG, torch.bfloat16)["experts"]
    two = plugin.family_identity({**plugin.TINY_CONFIG, "n_shared_experts": 2}, torch.bfloat16)["experts"]
    assert one != two
    assert all("routing kernel" in fact and "float32" in fact for fact in (one, two))
    assert "shared expert as expert N" in one and "shared expert apart" in two


# ---- the GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_f", [F_EXPERT, 2 * F_EXPERT], ids=["folded", "apart"])
def test_gpu_fused_path(dtype, shared_f):
    """On the device against the CPU reference (within tolerance), a row alone equal to it in the batch wherever
    cuBLAS gives its router row the same bits (the rest is ours: routing and experts read only the row), no sync,
    and a CUDA graph replay equal to an eager call."""
    cpu = weights(dtype, shared_f, seed=3)
    w = weights(dtype, shared_f, seed=3, device="cuda")
    w = fuse_moe(w) if can_fold(w) else w
    routing = (4, 2, True)
    for T, kind in ((1, "decode"), (8, "decode"), (64, "prefill")):
        x = rows(T, dtype, seed=T, device="cuda")
        got = fused_call(w, x, routing, kind)
        torch.testing.assert_close(got.cpu(), reference(cpu, x.cpu(), routing), rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype])
        for t in (0, T - 1):
            alone = fused_call(w, x[t:t + 1], routing, kind)[0]
            if torch.equal(F.linear(x[t:t + 1].float(), w.router)[0], F.linear(x.float(), w.router)[t]):
                assert torch.equal(alone, got[t]), (T, kind, t)
            else:
                torch.testing.assert_close(alone, got[t], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    static = rows(8, dtype, seed=30, device="cuda")
    fused_call(w, static, routing, "decode")
    without_host_sync(lambda: fused_call(w, static, routing, "decode"))
    graph, out = captured(lambda: fused_call(w, static, routing, "decode"))
    for seed in (31, 32):
        static.copy_(rows(8, dtype, seed=seed, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_call(w, static, routing, "decode")), seed
