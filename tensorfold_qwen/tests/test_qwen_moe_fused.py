"""The MoE's fused GPU path (mlp.moe_fused, fused.fuse_moe): its layout holds nothing twice and keeps the
reference's bits; on the Triton path (triton's interpreter on the CPU, the device with CUDA) it equals the
reference `moe` within the kernels' tolerances (float32 1e-5, bfloat16 2^-6), with the shared expert folded into the
grouped experts (shared F == F, Qwen3.5-35B-A3B's case) or apart; a row's bits do not depend on its batch; the
loader builds it only for a Triton device; the identity names it.

Rows whose router has a tie at the k-th place are left out of the comparisons with `moe`: the fused path gives a
tie to the lowest index, torch's CPU topk (the reference's) to its own choice.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from tensorfold.kernels.moe import TILES
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold.testing.cuda_graphs import captured, without_host_sync
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights
from tensorfold_qwen import load as loader
from tensorfold_qwen import mlp, plugin
from tensorfold_qwen.config import QwenConfig
from tensorfold_qwen.fused import can_fold, fuse_moe
from tensorfold_qwen.mlp import MlpWeights, MoeWeights

CUDA = torch.cuda.is_available()
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
E, N, F_EXPERT, K = 64, 16, 32, 4


def weights(dtype: torch.dtype, shared_f: int, seed: int = 0, device: str = "cpu") -> MoeWeights:
    """A MoE layer drawn N(0, 1/fan_in), unfused (as the reference holds it)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(device=device, dtype=dtype)

    return MoeWeights(router=draw(N, E), gate_up=draw(N, 2 * F_EXPERT, E), down=draw(N, E, F_EXPERT),
                      shared=MlpWeights(draw(shared_f, E), draw(shared_f, E), draw(E, shared_f)),
                      shared_gate=draw(1, E), top_k=K)


def rows(T: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def untied(w: MoeWeights, x: torch.Tensor) -> torch.Tensor:
    """[T] bool: rows whose router logits' k-th and (k+1)-th largest differ."""
    top = F.linear(x, w.router).float().sort(dim=-1, descending=True).values
    return top[:, w.top_k - 1] != top[:, w.top_k]


def shares_storage(view: torch.Tensor, whole: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


# ---- the layout -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shared_f", [F_EXPERT, 48], ids=["folded", "apart"])
def test_the_fused_layout_holds_the_same_tensors_once(shared_f):
    w = weights(torch.float32, shared_f)
    fold = can_fold(w.shared, w.down)
    assert fold == (shared_f == F_EXPERT)
    fused = fuse_moe(w, fold)
    assert fuse_moe(fused, fold) is fused
    for name in ("router", "shared_gate", "gate_up", "down"):
        assert torch.equal(getattr(fused, name), getattr(w, name)), name
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(fused.shared, name), getattr(w.shared, name)), name
    rows_in = N + 1 + (0 if fold else 2 * shared_f)
    assert fused.inputs.shape == (rows_in, E)
    assert shares_storage(fused.router, fused.inputs) and shares_storage(fused.shared_gate, fused.inputs)
    if fold:
        assert fused.experts_gate_up.shape == (N + 1, 2 * F_EXPERT, E)
        assert fused.experts_down.shape == (N + 1, E, F_EXPERT)
        for view in (fused.gate_up, fused.shared.gate_proj, fused.shared.up_proj):
            assert shares_storage(view, fused.experts_gate_up) and view.is_contiguous()
        for view in (fused.down, fused.shared.down_proj):
            assert shares_storage(view, fused.experts_down) and view.is_contiguous()
    else:
        assert fused.experts_gate_up is None and fused.experts_down is None
        assert shares_storage(fused.shared.gate_proj, fused.inputs)
        assert shares_storage(fused.shared.up_proj, fused.inputs)
    x = rows(9, torch.float32, seed=1)
    assert torch.equal(mlp.moe(fused, x), mlp.moe(w, x))                  # the views keep the reference's bits


def test_a_shared_expert_of_another_size_is_not_folded():
    w = weights(torch.float32, 48)
    with pytest.raises(ValueError, match="cannot fold"):
        fuse_moe(w, fold=True)


# ---- the Triton path (interpreter on the CPU) ---------------------------------------------------------------

@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Triton path on the CPU tensors: the packages routed to their Triton forms, run by the interpreter."""
    if CUDA:
        pytest.skip("with CUDA the device is tested (the gpu cases)")
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    import tensorfold.kernels.moe as moe_package
    import tensorfold.kernels.silu_gate as gate_package
    from tensorfold.kernels.moe import routing, triton_moe, triton_routing
    from tensorfold.testing.triton_interpreter import interpreter_fixes
    if not all(isinstance(kernel, InterpretedFunction)
               for kernel in (triton_moe._gate_up_kernel, triton_routing._route_kernel)):
        pytest.skip("triton was imported for the compiler before this test (run it in its own process)")
    for module in (mlp, moe_package, routing, gate_package):
        monkeypatch.setattr(module, "use_triton", lambda tensor: True)
    with interpreter_fixes():
        yield


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_f", [F_EXPERT, 48], ids=["folded", "apart"])
@pytest.mark.parametrize("T, kind", [(1, "decode"), (9, "decode"), (40, "prefill")])
def test_the_fused_path_is_the_reference_within_tolerance(triton_path, T, kind, shared_f, dtype):
    w = weights(dtype, shared_f, seed=T)
    fused = fuse_moe(w, can_fold(w.shared, w.down))
    x = rows(T, dtype, seed=100 + T)
    got = mlp.moe_routed(fused, x, kind)
    expected = mlp.moe(w, x)
    keep = untied(w, x)
    assert got.dtype == dtype and got.shape == (T, E) and keep.float().mean() >= 0.5
    torch.testing.assert_close(got[keep], expected[keep], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_rows_bits_do_not_depend_on_its_batch(triton_path, kind):
    """Within a kind: a row alone, in a slice and in the whole batch gives the same bits (bf16, folded)."""
    w = fuse_moe(weights(torch.bfloat16, F_EXPERT, seed=7), fold=True)
    x = rows(24, torch.bfloat16, seed=8)
    whole = mlp.moe_routed(w, x, kind)
    assert torch.equal(whole, mlp.moe_routed(w, x, kind))
    for t in (0, 13, 23):
        assert torch.equal(mlp.moe_routed(w, x[t:t + 1], kind)[0], whole[t]), t
    assert torch.equal(mlp.moe_routed(w, x[5:14], kind), whole[5:14])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layer_and_the_next_norm_in_one_launch_keep_the_bits(triton_path, dtype):
    """mlp.moe_then_norm (folded): the next norm's output and the residual bit for bit those of moe_fused then
    rms_norm with the residual (Triton's); where the shared expert is apart it declines (None)."""
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    w = fuse_moe(weights(dtype, F_EXPERT, seed=3), fold=True)
    x, residual = rows(5, dtype, seed=31), rows(5, dtype, seed=32)
    norm_weight = rows(1, dtype, seed=33)[0] * 0.1
    got = mlp.moe_then_norm(w, x, residual, norm_weight, 1e-6)
    want = triton_rmsnorm.rms_norm(mlp.moe_fused(w, x), norm_weight, 1e-6, zero_centred=True, residual=residual)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    apart = fuse_moe(weights(dtype, 48, seed=3), fold=False)
    assert mlp.moe_then_norm(apart, x, residual, norm_weight, 1e-6) is None


# ---- the loader and the identity ------------------------------------------------------------------------------

def write_checkpoint(directory, shared_f: int) -> None:
    """The tiny MoE checkpoint, with the shared expert's intermediate size `shared_f`."""
    changes = {**plugin.TINY_CONFIG, **plugin.TINY_MOE_CHANGES, "shared_expert_intermediate_size": shared_f}
    config = write_tiny_config(directory, changes)
    write_tiny_weights(directory, loader.expected_shapes(QwenConfig.from_dict(config)), plugin.draw, seed=5)


def test_the_loader_fuses_for_a_triton_device_only(tmp_path):
    """On the CPU the layers load as before; where Triton runs (stood in for here) every MoE layer gets the fused
    layout, the shared expert folded when its size is the experts', holding the same values. The reference's
    logits agree to float32 rounding, not bitwise: the CPU's BLAS may round a product by its operand's address
    (the checkpoint's mapped tensors are not 64-byte aligned, the stacked copies are)."""
    family = load_families(["qwen"])["qwen"]
    plan = StepPlan((StreamStep(0, 0, tuple(range(3, 20))),))
    for shared_f in (32, 64):
        directory = tmp_path / str(shared_f)
        directory.mkdir()
        write_checkpoint(directory, shared_f)
        plain = kit.load(family, directory)
        assert all(layer.ffn.inputs is None for layer in plain.model.weights.layers)
        fused = kit.load_as_for_triton(family, directory, loader)
        for mine, theirs in zip(fused.model.weights.layers, plain.model.weights.layers, strict=True):
            assert mine.ffn.inputs is not None
            assert (mine.ffn.experts_gate_up is not None) == (shared_f == 32)
            for name in ("router", "shared_gate", "gate_up", "down"):
                assert torch.equal(getattr(mine.ffn, name), getattr(theirs.ffn, name)), name
            assert all(torch.equal(getattr(mine.ffn.shared, name), getattr(theirs.ffn.shared, name))
                       for name in ("gate_proj", "up_proj", "down_proj"))
        torch.testing.assert_close(fused.model.forward(plan, fused.store(1, 32)),
                                   plain.model.forward(plan, plain.store(1, 32)), rtol=0.0, atol=1e-5)


def test_the_identity_names_the_fused_experts():
    folded = {**plugin.TINY_CONFIG, **plugin.TINY_MOE_CHANGES, "shared_expert_intermediate_size": 32}
    apart = {**plugin.TINY_CONFIG, **plugin.TINY_MOE_CHANGES}
    facts = [plugin.family_identity(config, torch.bfloat16)["experts"] for config in (folded, apart)]
    assert facts[0] != facts[1]
    assert "shared expert as expert N" in facts[0] and "routing kernel" in facts[1]
    assert all(TILES in fact for fact in facts)                     # the decode and prefill tiles named
    assert "experts" not in plugin.family_identity(plugin.TINY_CONFIG, torch.bfloat16)


# ---- the GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_f", [F_EXPERT, 48], ids=["folded", "apart"])
def test_gpu_fused_path(dtype, shared_f):
    """On the device: within tolerance of `moe` (both on the GPU); a row alone equal to it in the batch wherever
    cuBLAS gives its input GEMM row the same bits (the rest is ours: routing and experts read only the row); no
    sync; a CUDA graph replay equal to an eager call."""
    w = weights(dtype, shared_f, seed=3, device="cuda")
    fused = fuse_moe(w, can_fold(w.shared, w.down))
    for T, kind in ((1, "decode"), (8, "decode"), (64, "prefill")):
        x = rows(T, dtype, seed=T, device="cuda")
        got, expected, keep = mlp.moe_routed(fused, x, kind), mlp.moe(w, x), untied(w, x)
        torch.testing.assert_close(got[keep], expected[keep], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        for t in (0, T - 1):
            alone = mlp.moe_routed(fused, x[t:t + 1], kind)[0]
            if torch.equal(F.linear(x[t:t + 1], fused.inputs)[0], F.linear(x, fused.inputs)[t]):
                assert torch.equal(alone, got[t]), (T, kind, t)
            else:
                torch.testing.assert_close(alone, got[t], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    static = rows(8, dtype, seed=30, device="cuda")
    mlp.moe_routed(fused, static)
    without_host_sync(lambda: mlp.moe_routed(fused, static))
    graph, out = captured(lambda: mlp.moe_routed(fused, static))
    for seed in (31, 32):
        static.copy_(rows(8, dtype, seed=seed, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mlp.moe_routed(fused, static)), seed
