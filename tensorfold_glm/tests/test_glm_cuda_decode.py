"""GLM decode on a CUDA device through the core's graph runner, at the tiny default shape and the shared-indexer
variant (glm_decode_cases.VARIANTS), fp32 and bf16. Skipped without CUDA; run in device sessions (`pytest -m gpu`).
Each test prints what it measured (`-s`).

- graph replay against the per-stream path (`hidden`, the forward without its decode route; glm_decode_cases), each
  step fed its greedy token: logits within glm_decode_cases.TOLERANCE; fp32: every greedy token equal; bf16: equal
  wherever the reference's top two are more than 2 · the bound apart and on at least AGREEMENT of all rows. Where bf16
  rounding flips a near-tied discrete choice (an expert or a DSA pool; FLIPS: the shared-indexer variant, as on the
  CPU the odd one), logits move by more than rounding: there only the tokens are checked.
- concurrent == solo: each stream alone (the graph of 1) and among 6 streams padded to 8 give the same greedy tokens.
- graph replay == eager decode, bit for bit (logits and every state); the step syncs with the host nowhere.
"""

from __future__ import annotations

import pytest
import torch
from glm_decode_cases import TOLERANCE, load_subjects, per_stream, tokens

from tensorfold.testing import cuda_decode
from tensorfold.testing.cuda_decode import Streams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VARIANTS = ["tiny", "shared"]
STREAMS = Streams([list(tokens(24 + 9 * p, p)) for p in range(8)])
STEPS = 16
FLIPS = {("shared", torch.bfloat16)}
AGREEMENT = 0.75            # bf16: the share of rows whose greedy token must equal the reference's
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def subjects(tmp_path_factory):
    return load_subjects(tmp_path_factory.mktemp("glm-cuda-decode"), VARIANTS, list(DTYPES.values()), device="cuda")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_replay_gives_the_per_stream_greedy_tokens(subjects, variant, dtype):
    subject = subjects[variant, dtype]
    worst, agree, rows = cuda_decode.replay_against(
        subject, STREAMS, lambda plan, kv: per_stream(subject.model, plan, kv), TOLERANCE[dtype], STEPS,
        exact_tokens=dtype == torch.float32)
    print(f"\n[glm cuda decode {variant} {dtype}] graph replay vs per stream: max |Δlogit| {worst:.3e}, "
          f"greedy tokens agree on {agree}/{rows} rows")
    assert (variant, dtype) in FLIPS or worst <= TOLERANCE[dtype]
    assert agree >= AGREEMENT * rows


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_stream_alone_and_among_6_gives_the_same_tokens(subjects, variant):
    worst = cuda_decode.alone_and_among(subjects[variant, torch.bfloat16], STREAMS)
    print(f"\n[glm cuda decode {variant}] alone vs among 6: max |Δlogit| {worst:.3e}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_replay_equals_eager_decode(subjects, variant):
    cuda_decode.replay_equals_eager(subjects[variant, torch.bfloat16], STREAMS)


def test_the_decode_step_never_syncs(subjects):
    cuda_decode.never_syncs(subjects["tiny", torch.bfloat16], STREAMS)
