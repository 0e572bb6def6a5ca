"""The conformance kit run on the template family, and shown to catch a family that breaks each contract."""

from __future__ import annotations

import attrs
import pytest
import torch

from tensorfold.testing import kit

PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(70)]


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def test_declarations_are_valid(example, tiny_dir):
    found = kit.check_declarations(example, tiny_dir)
    assert found.layout.bytes_per_token > 0


@pytest.mark.parametrize("at, chunk", [(16, 16), (32, 16), (48, 24), (17, 64)])
def test_resume_is_bitwise(subject, at, chunk):
    size = kit.check_resume_bitwise(subject, PROMPT, at=at, chunk=chunk)
    assert size > subject.declarations.layout.stream_bytes(at)


def test_chunked_matches_one_shot(subject):
    worst = kit.check_chunked(subject, PROMPT, cuts=[5, 17, 40, 64], tolerance=1e-4)
    assert worst < 1e-4


class Leaky:
    """A wrapper model that carries hidden state outside the KvStore — exactly what the kit must catch."""

    def __init__(self, inner):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.steps = 0

    def forward(self, plan, kv):
        self.steps += 1
        return self.inner.forward(plan, kv) + 1e-3 * self.steps


def test_the_kit_catches_state_kept_outside_the_declared_memory(subject):
    import attrs

    leaky = attrs.evolve(subject, model=Leaky(subject.model))
    with pytest.raises(AssertionError, match="resumed logits differ"):
        kit.check_resume_bitwise(leaky, PROMPT, at=32, chunk=16)


def test_the_kit_catches_a_chunking_error(subject):
    import attrs

    class Shifted(Leaky):
        def forward(self, plan, kv):
            out = self.inner.forward(plan, kv)
            return out + (0.5 if len(plan.streams[0].tokens) > 1 and plan.streams[0].start > 0 else 0.0)

    with pytest.raises(AssertionError, match="chunked vs one-shot differ"):
        kit.check_chunked(attrs.evolve(subject, model=Shifted(subject.model)), PROMPT, cuts=[10], tolerance=1e-4)


@pytest.mark.parametrize("page_rows", [4, 16, 64])
def test_paged_equals_window(subject, page_rows):
    kit.check_paged(subject, PROMPT, page_rows=page_rows, chunk=16)


def test_batch_invariance(subject):
    kit.check_batch_invariance(subject, PROMPT)


def test_the_kit_catches_a_batch_dependent_forward(subject):
    import attrs

    class Crowded(Leaky):
        def forward(self, plan, kv):
            return self.inner.forward(plan, kv) * (1 + 1e-6 * len(plan.streams))

    with pytest.raises(AssertionError, match="with 2 streams in the step"):
        kit.check_batch_invariance(attrs.evolve(subject, model=Crowded(subject.model)), PROMPT, sizes=(1, 2))


def test_every_row_in_pieces_matches_one_shot_and_greedy_follows_its_last_row(subject):
    model = subject.model
    one_shot = kit.every_row(model, subject.store(1, len(PROMPT)), PROMPT, cuts=[])
    pieces = kit.every_row(model, subject.store(1, len(PROMPT)), PROMPT, cuts=[9, 30, 31])
    assert one_shot.shape == (len(PROMPT), model.vocab_size) and one_shot.dtype == torch.float32
    assert float((one_shot - pieces).abs().max()) <= 1e-4
    tokens = kit.greedy(model, subject.store(1, len(PROMPT) + 4), PROMPT, steps=4)
    assert len(tokens) == 4 and tokens[0] == int(one_shot[-1].argmax())
    longer = [*PROMPT, *tokens[:3]]
    rows = kit.every_row(model, subject.store(1, len(longer)), longer, cuts=[])
    assert [int(row.argmax()) for row in rows[len(PROMPT) - 1:]] == tokens


def oracle_of(subject, shift: float = 0.0):
    """The example's every-row forward on a fresh store, one shot: what HF transformers would give (plus `shift`)."""
    def oracle(tokens):
        return kit.every_row(subject.model, subject.store(1, len(tokens)), list(tokens), cuts=[]) + shift
    return oracle


def test_a_run_is_held_to_the_oracle_when_the_kit_is_given_one(subject):
    kit.check_resume_bitwise(subject, PROMPT, at=32, chunk=16, oracle=oracle_of(subject))
    with pytest.raises(AssertionError, match=r"^the run kept at 32 \(chunks of 16\): logits differ from the oracle "
                                             r"by 1\.00\de-03 > 1\.0e-04, first at position 69 "):
        kit.check_resume_bitwise(subject, PROMPT, at=32, chunk=16, oracle=oracle_of(subject, 1e-3))
    kit.check_resume_bitwise(subject, PROMPT, at=32, chunk=16, oracle=oracle_of(subject, 1e-3), tolerance=2e-3)
    with pytest.raises(AssertionError, match="^the one-shot run: logits differ from the oracle by .*, first at "
                                             "position 69 "):
        kit.check_chunked(subject, PROMPT, cuts=[10], tolerance=1e-4, oracle=oracle_of(subject, 1e-3))


def test_without_an_oracle_a_run_is_held_to_a_one_shot_pass_in_float32_only(subject):
    fed = [5, 6, 7]
    one_shot = kit.reference_logits(subject, PROMPT, fed)
    rows = kit.every_row(subject.model, subject.store(1, len(PROMPT) + 3), [*PROMPT, *fed], cuts=[])
    assert one_shot.shape == (4, subject.model.vocab_size)
    assert float((one_shot - rows[len(PROMPT) - 1:]).abs().max()) <= 1e-5
    assert kit.check_reference(subject, PROMPT, fed, one_shot) == 0.0
    assert kit.REFERENCE_TOLERANCE == {torch.float32: 1e-4}
    bf16 = attrs.evolve(subject, dtype=torch.bfloat16)
    assert kit.check_reference(bf16, PROMPT, fed, one_shot + 1.0) is None    # bf16: only with a tolerance


def test_the_engine_gates_hold_a_fresh_reply_to_the_oracle(subject):
    from tensorfold.engine.api import Sampling
    from tensorfold.testing.engine_gates import Rig

    sampling = Sampling(temperature=0.0, max_tokens=4)
    good = Rig(context=128, chunk=16, oracle=oracle_of(subject))
    assert len(good.fresh(subject, PROMPT[:40], sampling)) == 4
    bad = Rig(context=128, chunk=16, oracle=oracle_of(subject, 1e-3))
    with pytest.raises(AssertionError, match="^a fresh engine's reply to a 40-token prompt: logits differ from the "
                                             "oracle by .*, first at position 39 "):
        bad.fresh(subject, PROMPT[:40], sampling)
