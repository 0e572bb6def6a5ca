"""A pure-SSM family (toy_ssm: conv tails and float32 SSM states, no row state at all) through the kit and the
engine gates: the Layout is served, a float32 state in a bf16 model keeps its dtype, no page is ever taken; and
two broken twins (a conv tail never updated, a state rounded to bf16 between steps), which every run agrees with
itself about, fail the resume check and the gates because a run is now held to a one-shot pass."""

from __future__ import annotations

import pytest
import torch
import toy_ssm

from tensorfold.engine.api import Sampling
from tensorfold.testing import engine_gates, kit
from tensorfold.testing.engine_gates import Rig

PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(70)]
RIG = Rig(context=192, chunk=32, min_chunk=8, page_rows=16, max_waiting=4)
SEEDED = Sampling(temperature=0.8, top_p=0.9, seed=5, max_tokens=8)
USERS = (48, 24, 40)
BROKEN = [toy_ssm.FrozenConv, toy_ssm.RoundedState]


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 41 + salt * 11) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module")
def subjects(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy-ssm")
    found = {dtype: toy_ssm.subject(root / str(dtype), dtype) for dtype in (torch.float32, torch.bfloat16)}
    for broken in BROKEN:
        found[broken] = toy_ssm.subject(root / broken.__name__, broken=broken)
    return found


def test_a_layout_of_fixed_states_alone_is_declared_and_priced(subjects):
    bf16 = subjects[torch.bfloat16]
    kit.check_declarations(bf16.family, bf16.checkpoint.directory, torch.bfloat16)
    layout = bf16.declarations.layout
    assert all(layer.rows == () for layer in layout.layers) and layout.bytes_per_token == 0
    assert [(s.name, s.dtype) for s in layout.layers[0].fixed] == [("conv", "bfloat16"), ("ssm", "float32")]
    assert layout.fixed_bytes == 2 * (48 * 3 * 2 + 4 * 8 * 8 * 4) == layout.stream_bytes(10**6)
    assert bf16.declarations.image.rows == () and len(bf16.declarations.image.own) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("at, chunk", [(16, 16), (40, 20), (17, 64)])
def test_resume_is_bitwise_and_the_run_is_a_one_shot_pass(subjects, dtype, at, chunk):
    subject = subjects[dtype]
    assert kit.check_resume_bitwise(subject, PROMPT, at=at, chunk=chunk) > subject.declarations.layout.fixed_bytes
    assert subject.model.w["lm_head.weight"].dtype == dtype
    kv = subject.store(1, 8)
    assert kv.fixed(0, "ssm", 0, dtype=torch.float32).dtype == torch.float32   # whatever the model's dtype


def test_chunked_and_paged_agree(subjects):
    subject = subjects[torch.float32]
    assert kit.check_chunked(subject, PROMPT, cuts=[1, 9, 33, 64], tolerance=1e-4) < 1e-4
    kit.check_paged(subject, PROMPT, page_rows=16, chunk=32)


@pytest.mark.slow
def test_the_engine_gates_pass_and_no_page_is_ever_taken(subjects, tmp_path):
    subject = subjects[torch.float32]
    seen = []

    def inspect(mem, tier, turns):
        assert mem.pool is None and isinstance(mem.kv, engine_gates.PagedStore)   # pages asked for, none needed
        for state in tier.states:
            assert state.pages == () and state.tail == ()
            engine_gates.check_device_state(subject, RIG, mem, state)
        seen.append(len(tier.states))

    engine_gates.check_device_resume(subject, RIG, SEEDED, tokens, USERS, inspect=inspect)
    assert seen and seen[0] >= len(USERS)
    mem, device, host, _, _ = engine_gates.chats_through_host(subject, RIG, SEEDED, tokens)
    assert mem.pool is None and host.hits >= 1
    for state in host.states:
        engine_gates.check_host_state(subject, RIG, mem, host, state)
    engine_gates.check_disk_resume_across_restart(subject, RIG, tmp_path, SEEDED, tokens, USERS)


def test_concurrent_equals_solo(subjects):
    subject = subjects[torch.float32]
    requests = engine_gates.mixed_requests(tokens)[:4]
    solo = engine_gates.alone(subject, RIG, requests)
    engine_gates.check_concurrent_equals_solo(subject, RIG, requests, solo, parallel=3, pages=True, stagger_s=0.0)


# -- broken twins: each agrees with itself, so only a reference shows them ------------------------------------------

@pytest.mark.parametrize("broken", BROKEN, ids=lambda b: b.__name__)
def test_the_resume_check_catches_a_state_wrong_the_same_way_on_both_sides(subjects, broken):
    subject = subjects[broken]
    kit.check_resume_bitwise(subject, PROMPT, at=32, chunk=16, tolerance=float("inf"))   # bitwise with itself
    with pytest.raises(AssertionError, match=r"^the run kept at 32 \(chunks of 16\): logits differ from a one-shot "
                                             r"pass by .*, first at position \d+ "):
        kit.check_resume_bitwise(subject, PROMPT, at=32, chunk=16)
    with pytest.raises(AssertionError, match="chunked vs one-shot differ"):
        kit.check_chunked(subject, PROMPT, cuts=[16, 32], tolerance=1e-4)


@pytest.mark.parametrize("broken", BROKEN, ids=lambda b: b.__name__)
def test_the_engine_gates_catch_a_state_wrong_the_same_way_on_both_sides(subjects, broken, tmp_path):
    subject = subjects[broken]
    caught = r"^a fresh engine's reply to a 48-token prompt: logits differ from a one-shot pass by .*, first at "
    with pytest.raises(AssertionError, match=caught):
        engine_gates.check_device_resume(subject, RIG, SEEDED, tokens, USERS)
    with pytest.raises(AssertionError, match=caught):
        engine_gates.check_disk_resume_across_restart(subject, RIG, tmp_path, SEEDED, tokens, USERS)
    with pytest.raises(AssertionError, match="a fresh engine's reply to a 40-token prompt"):
        engine_gates.alone(subject, RIG, engine_gates.mixed_requests(tokens)[:1])
