"""hc_fused on a CUDA device at GLM-5's widths (E 4096, m 4, T 2048, bf16 streams, 20 Sinkhorn rounds) against
hc.py's torch form on the same device: post bit for bit, the coefficients within the CPU tests' bound, the block input
the torch collapse of the kernel's pre; a row alone gives its batch bits; hc_pre / hc_post dispatch to the kernels,
sync with the host nowhere and replay from a CUDA graph to the same bits. Skipped without CUDA; run in device sessions
(`pytest -m gpu`)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tensorfold.testing.cuda_graphs import captured, without_host_sync
from tensorfold_glm.hc import HcWeights, collapse, hc_coefficients, hc_mixes, hc_post, hc_pre, spread

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
T, MULT, E, ITERS = 2048, 4, 4096, 20
RMS_EPS, HC_EPS = 1e-6, 1e-6
PRE_POST_RTOL = 1e-6
COMB_ATOL, COMB_RTOL = 1e-6, 4e-6


@pytest.fixture(scope="module")
def block() -> tuple[HcWeights, torch.Tensor, torch.Tensor]:
    """One block's mHC weights (fn bf16; base, scale float32), streams [T, m, E] and a block output [T, E], bf16."""
    g = torch.Generator().manual_seed(0)
    n = (2 + MULT) * MULT
    fn = (torch.randn(n, MULT * E, generator=g) / (MULT * E) ** 0.5).to(torch.bfloat16)
    w = HcWeights(fn=fn.cuda(), base=(torch.randn(n, generator=g) * 0.5).cuda(),
                  scale=(torch.rand(3, generator=g) + 0.5).cuda())
    streams = torch.randn(T, MULT, E, generator=g).to(torch.bfloat16).cuda()
    block_out = torch.randn(T, E, generator=g).to(torch.bfloat16).cuda()
    return w, streams, block_out


def fused() -> ModuleType:
    """hc_fused, imported where the test runs (triton is the gpu extra)."""
    from tensorfold_glm import hc_fused
    return hc_fused


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs() / b.abs()).max().item()


def test_post_is_hc_post_bit_for_bit(block):
    w, streams, block_out = block
    _, post, comb = hc_coefficients(w, hc_mixes(w, streams, RMS_EPS), ITERS, HC_EPS)
    new = fused().post(block_out, streams, post, comb)
    assert torch.equal(new, spread(block_out, streams, post, comb))
    assert torch.equal(hc_post(block_out, streams, post, comb), new)              # hc_post dispatches to it


def test_coefficients_within_the_bound_and_the_block_input_is_their_collapse(block):
    w, streams, _ = block
    mixes = hc_mixes(w, streams, RMS_EPS)
    pre, post, comb = fused().coefficients(mixes, w.base, w.scale, MULT, ITERS, HC_EPS)
    ref_pre, ref_post, ref_comb = hc_coefficients(w, mixes, ITERS, HC_EPS)
    measured = relative(pre, ref_pre), relative(post, ref_post), (comb - ref_comb).abs().max().item()
    bitwise = [(a == b).float().mean().item() for a, b in ((pre, ref_pre), (post, ref_post), (comb, ref_comb))]
    print(f"\nGPU coefficients vs torch on CUDA: pre {measured[0]:.2e} post {measured[1]:.2e} (rel), comb "
          f"{measured[2]:.2e} (abs) {relative(comb, ref_comb):.2e} (rel); equal bits pre/post/comb {bitwise}")
    assert measured[0] <= PRE_POST_RTOL and measured[1] <= PRE_POST_RTOL
    assert measured[2] <= COMB_ATOL and relative(comb, ref_comb) <= COMB_RTOL
    x, post_pre, comb_pre = hc_pre(w, streams, RMS_EPS, ITERS, HC_EPS)            # dispatches to the kernels
    assert torch.equal(post_pre, post) and torch.equal(comb_pre, comb)
    assert torch.equal(x, collapse(pre, streams))
    ref = collapse(ref_pre, streams)
    same = (pre == ref_pre).all(dim=1)
    assert torch.equal(x[same], ref[same])
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), torch.frexp(ref.float().abs())[1] - 8)
    bound = ulp + 8 * 2.0 ** -23 * (ref_pre[:, :, None] * streams.float().abs()).sum(dim=1)
    assert ((x.float() - ref.float()).abs() <= bound).all()
    print(f"block input: rows with pre equal {int(same.sum())}/{T}, values differing "
          f"{int((x != ref).sum())}/{x.numel()}")


def test_a_row_alone_gives_its_bits_in_a_batch(block):
    w, streams, block_out = block
    hc_fused = fused()
    mixes = hc_mixes(w, streams, RMS_EPS)
    pre, post, comb = hc_fused.coefficients(mixes, w.base, w.scale, MULT, ITERS, HC_EPS)
    x, new = hc_fused.collapse(pre, streams), hc_fused.post(block_out, streams, post, comb)
    for row in (0, 1, 15, 16, 1000, T - 1):
        one = slice(row, row + 1)
        alone = hc_fused.coefficients(mixes[one], w.base, w.scale, MULT, ITERS, HC_EPS)
        assert all(torch.equal(a, b[one]) for a, b in zip(alone, (pre, post, comb), strict=True))
        assert torch.equal(hc_fused.collapse(pre[one], streams[one]), x[one])
        assert torch.equal(hc_fused.post(block_out[one], streams[one], post[one], comb[one]), new[one])


def test_no_host_sync_and_a_cuda_graph_replays_the_same_bits(block):
    w, streams, _ = block
    rows = streams[:64].clone()

    def step() -> torch.Tensor:
        x, post, comb = hc_pre(w, rows, RMS_EPS, ITERS, HC_EPS)
        return hc_post(x, rows, post, comb)                                       # an identity block

    eager = step()                                                                # compiles the kernels
    assert torch.equal(without_host_sync(step), eager)                            # a host sync raises
    graph, replayed = captured(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
