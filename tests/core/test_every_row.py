"""StreamStep.every_row, as every installed family answers it: a share asking for every row gets each row's logits
(equal to forward_all's), in plan order among the other shares' last rows, and a sampled row is bitwise the one a
step without every_row returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold.testing.fixtures import one_thread  # noqa: F401  (autouse: a tiny model gains nothing from threads)

FAMILIES = sorted(load_families().keys())
CONTEXT = 64


def devices() -> list:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])]


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 29 + salt * 13) % 200 + 3 for i in range(n))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", FAMILIES)
def test_every_row_returns_each_rows_logits(name: str, device: str, tmp_path: Path):
    family = load_families([name])[name]
    family.make_tiny(tmp_path, seed=0)
    subject = kit.load(family, tmp_path, device=device)
    shares = [StreamStep(0, 0, tokens(9, 1), sample=True), StreamStep(1, 0, tokens(12, 2), sample=False,
                                                                     every_row=True),
              StreamStep(2, 0, tokens(7, 3), sample=True, every_row=True), StreamStep(3, 0, tokens(5, 4), sample=False)]
    plan = StepPlan(shares)
    assert (plan.logit_rows, plan.sampled) == (1 + 12 + 7, 2)
    got = subject.model.forward(plan, subject.store(4, CONTEXT))
    assert tuple(got.shape) == (plan.logit_rows, subject.model.vocab_size) and got.dtype == torch.float32
    plain = StepPlan([StreamStep(s.slot, s.start, s.tokens, sample=s.sample) for s in shares])
    last = subject.model.forward(plain, subject.store(4, CONTEXT))
    assert torch.equal(got[[0, 19]], last)  # the sampled rows, as a step without every_row has them
    for share, (a, b) in ((shares[1], (1, 13)), (shares[2], (13, 20))):
        alone = subject.model.forward_all(StepPlan([StreamStep(0, 0, share.tokens)]), subject.store(1, CONTEXT))
        torch.testing.assert_close(got[a:b], alone, rtol=1e-5, atol=1e-5)
