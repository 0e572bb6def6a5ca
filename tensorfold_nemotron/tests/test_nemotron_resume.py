"""Kept states of the nemotron family (Mamba2 conv tails and float32 SSM states as fixed states, attention keys and
values as rows, MLP and MoE layers with no state) through the real engine and every tier, on NaN-poisoned pages:

- device tier: a three-turn chat whose turns resume from kept states gives each turn the reply of a fresh engine
  with no prompt cache, bitwise (greedy and seeded); a kept state's fixed states and rows are byte-equal to those
  a cold pass holds at the same row
- host tier: two chats on a device tier too small for both; the evicted state resumes from the host with the
  fresh replies, and a host state put back into a slot reads out byte-equal to it
- disk tier: a chat resumes from states on disk across an engine restart with the fresh replies; the state on
  disk is the image a fresh prefill makes, and put back it reads out byte-equal

And concurrent == solo: eight requests in one engine (all at once, staggered over 3 slots, in windows) each get
the reply they get alone. Every fresh or solo reply is held to HF transformers' logits within 1e-4 (the rig's
oracle). Turn lengths (41, 22, 30 user rows, replies of 8) put the keep points off the SSD grid of 64 and off the
prefill grid of 32.
"""

from __future__ import annotations

import attrs
import pytest
from nemotron_oracle import hf_oracle

from tensorfold.engine.api import Sampling
from tensorfold.memory import StreamMemory
from tensorfold.plugins import load_families
from tensorfold.testing import engine_gates, kit
from tensorfold.testing.engine_gates import Rig, Turn
from tensorfold.tiers import DeviceTier
from tensorfold_nemotron import plugin

RIG = Rig(context=192, chunk=32, min_chunk=8, page_rows=16, max_waiting=4)
REPLY = 8
USERS = (41, 22, 30)
GREEDY = Sampling(temperature=0.0, max_tokens=REPLY)
SEEDED = Sampling(temperature=0.8, top_p=0.9, seed=5, max_tokens=REPLY)
DENSE = {"layers_block_type": ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
                               "linear_attention", "mlp"]}


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 41 + salt * 11) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module", params=["tiny", "dense"])
def subject(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"nemotron-resume-{request.param}")
    plugin.write_tiny(directory, seed=3, **(DENSE if request.param == "dense" else {}))
    return kit.load(load_families(["nemotron"])["nemotron"], directory)


@pytest.fixture(scope="module")
def rig(subject):
    """The engine's shape, every fresh reply held to HF transformers' logits within 1e-4 (the rig's oracle)."""
    return attrs.evolve(RIG, oracle=hf_oracle(subject.checkpoint.directory))


# -- concurrent == solo ------------------------------------------------------------------------------------------

REQUESTS = engine_gates.mixed_requests(tokens)


@pytest.fixture(scope="module")
def alone(subject, rig):
    return engine_gates.alone(subject, rig, REQUESTS)


@pytest.mark.parametrize("parallel, pages, stagger_s", engine_gates.SHAPES, ids=engine_gates.SHAPE_IDS)
def test_concurrent_equals_solo(subject, rig, alone, parallel, pages, stagger_s):
    engine_gates.check_concurrent_equals_solo(subject, rig, REQUESTS, alone, parallel, pages, stagger_s)


# -- the device tier --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_three_turns_resume_from_the_device_and_equal_fresh_runs(subject, rig, sampling):
    def inspect(mem: StreamMemory, tier: DeviceTier, turns: list[Turn]) -> None:
        ats = sorted(s.at for s in tier.states)
        assert any(at % 64 for at in ats) and all(s.fixed for s in tier.states), ats   # off the grid, SSM kept
        for state in tier.states:
            engine_gates.check_device_state(subject, rig, mem, state)

    engine_gates.check_device_resume(subject, rig, sampling, tokens, USERS, inspect=inspect)


# -- the host tier ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_a_chat_pushed_to_the_host_resumes_as_fresh_runs(subject, rig, pages):
    mem, device, host, _, _ = engine_gates.chats_through_host(subject, rig, SEEDED, tokens, pages)
    engine_gates.check_memory(mem, (device, host))
    assert host.states, "the host tier kept nothing"
    for state in host.states:
        engine_gates.check_host_state(subject, rig, mem, host, state)


# -- the disk tier ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_a_chat_resumes_from_disk_across_a_restart_as_fresh_runs(subject, rig, tmp_path, pages):
    engine_gates.check_disk_resume_across_restart(subject, rig, tmp_path, SEEDED, tokens, USERS, pages=pages)


def test_the_state_on_disk_is_a_fresh_prefills_image_and_comes_back_byte_equal(subject, rig, tmp_path):
    # another prompt first: the slot holds its states, not poison
    engine_gates.check_disk_image(subject, rig, tmp_path, SEEDED, tokens, USERS[0], before=tokens(37, 9))
