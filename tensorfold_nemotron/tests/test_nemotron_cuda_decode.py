"""Nemotron-H decode on a CUDA device through the core's graph runner, in bf16, at the tiny default shape (M E * M -)
and a mid-size MoE (hidden 1024, 8 layers M E M * E M E M, 32 experts top-6, Mamba2 16 heads x 64, 4 groups, state
128, GQA 8/2 x 128). Skipped without CUDA; run in device sessions (`pytest -m gpu`). Each test prints what it
measured (`-s`).

- graph replay against the eager one-stream `forward`, each step fed the forward's greedy token, in fp32 and bf16:
  logits within LOGIT_TOLERANCE; fp32: every greedy token equal; bf16: equal wherever the forward's top two are more
  than 2 · LOGIT_TOLERANCE apart and on at least AGREEMENT of all rows (random weights give flat logits: the top two
  of about a fifth of the rows lie within 0.06, a few bf16 ulps). Not bitwise: a one-token `forward` runs the
  conv's prefill kernel, dense attention and one-row GEMMs; the step runs the conv's update kernel (another
  summation order), the paged Triton decode (fp32 scores) and B-row GEMMs.
- concurrent == solo: each stream alone (the graph of 1) and among 6 streams padded to 8 give the same greedy
  tokens, each run following its own (as qwen's decode test holds it). Not bitwise: the decode kernels are batch
  invariant by construction, but cuBLAS picks another GEMM kernel for 1 row than for 8 at the mid-size widths
  (docs/families/nemotron.md).
- graph replay == eager decode, bit for bit; and the step syncs with the host nowhere
  (torch.cuda.set_sync_debug_mode("error")).
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.plugins import load_families
from tensorfold.testing import cuda_decode, kit
from tensorfold.testing.cuda_decode import Streams
from tensorfold_nemotron import plugin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

M, E, A = "linear_attention", "moe", "full_attention"
MID = dict(vocab_size=4096, hidden_size=1024, layers_block_type=[M, E, M, A, E, M, E, M],
           num_attention_heads=8, num_key_value_heads=2, head_dim=128,
           mamba_num_heads=16, mamba_head_dim=64, n_groups=4, ssm_state_size=128, conv_kernel=4,
           n_routed_experts=32, num_experts_per_tok=6, n_group=1, topk_group=1, moe_intermediate_size=256,
           moe_shared_expert_intermediate_size=512, routed_scaling_factor=2.5)
SHAPES = {"tiny": {}, "mid-moe": MID}
STREAMS = Streams([[(i * (17 + 6 * p) + 5 * p) % 500 + 3 for i in range(24 + 9 * p)] for p in range(8)])
STEPS = 24
# fp32: ulps through other summation orders; bf16: a few bf16 ulps of the activations carried to unit-scale logits
LOGIT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25}
MOE_BF16_TOLERANCE = 1.0    # bf16 with 32 experts: a routing near-tie picks another expert in one of the two paths
AGREEMENT = 0.75            # bf16: the share of rows whose greedy token must equal the forward's
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module", params=list(SHAPES))
def loaded(request, tmp_path_factory):
    """(shape name, {dtype: the model loaded on the GPU})."""
    directory = tmp_path_factory.mktemp(f"nemotron-cuda-decode-{request.param}")
    plugin.write_tiny(directory, seed=5, **SHAPES[request.param])
    family = load_families(["nemotron"])["nemotron"]
    return request.param, {dtype: kit.load(family, directory, dtype=dtype, device="cuda") for dtype in DTYPES.values()}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_graph_replay_gives_the_eager_forwards_greedy_tokens(loaded, dtype):
    shape, subject = loaded[0], loaded[1][dtype]
    tolerance = MOE_BF16_TOLERANCE if (shape, dtype) == ("mid-moe", torch.bfloat16) else LOGIT_TOLERANCE[dtype]
    worst, agree, rows = cuda_decode.replay_against(subject, STREAMS, subject.model.forward, tolerance, STEPS,
                                                    exact_tokens=dtype == torch.float32)
    print(f"\n[nemotron cuda decode {shape} {dtype}] graph replay vs eager forward: max |Δlogit| {worst:.3e}, "
          f"greedy tokens agree on {agree}/{rows} rows")
    assert worst <= tolerance
    assert agree >= AGREEMENT * rows


def test_a_stream_alone_and_among_6_gives_the_same_tokens(loaded):
    """6 streams in one step (the graph of 8, 2 rows padded) vs each alone (the graph of 1), each run following its
    own greedy tokens: the same tokens, step after step."""
    shape, subject = loaded[0], loaded[1][torch.bfloat16]
    worst = cuda_decode.alone_and_among(subject, STREAMS)
    print(f"\n[nemotron cuda decode {shape}] alone vs among 6: max |Δlogit| {worst:.3e}")


def test_graph_replay_equals_eager_decode(loaded):
    """The same steps by eager decode and by graph replay: logits and every state bit for bit."""
    cuda_decode.replay_equals_eager(loaded[1][torch.bfloat16], STREAMS)


def test_the_decode_step_never_syncs(loaded):
    """A batch of 8 (3 streams, 5 rows padded) through `decode` under set_sync_debug_mode("error"), after a warm
    call that compiles the kernels."""
    cuda_decode.never_syncs(loaded[1][torch.bfloat16], STREAMS)
