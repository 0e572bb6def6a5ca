"""The device tier on the qwen family (GDN fixed states + gated attention rows): a three-turn conversation whose
turns resume from kept states gives each turn the reply of a fresh engine with no prompt cache, bitwise, and a
kept state's fixed states and rows are byte-equal to those a cold pass holds at the same row."""

from __future__ import annotations

import pytest
import torch

from tensorfold.engine.api import Request, Sampling
from tensorfold.memory import StreamMemory
from tensorfold.plugins import load_families
from tensorfold.testing import engine_gates, kit
from tensorfold.testing.engine_gates import Rig, Turn
from tensorfold.tiers import DeviceTier
from tensorfold_qwen import plugin

RIG = Rig(context=192, chunk=32, min_chunk=8, page_rows=16, max_waiting=4)
REPLY = 8
USERS = (41, 22, 30)


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 41 + salt * 11) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module", params=["dense", "moe"])
def subject(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"qwen-resume-{request.param}")
    plugin.write_tiny(directory, seed=3, moe=request.param == "moe")
    return kit.load(load_families(["qwen"])["qwen"], directory)


def cold_state_at(subject, prompt, starts, at: int):
    """Drive a fresh engine's steps by hand until its one stream stands at `at`; its fixed states and rows."""
    mem = RIG.memory(subject)
    eng = RIG.engine(subject, mem)
    eng.submit(Request("cold", prompt, Sampling(temperature=0.0, max_tokens=1), lambda e: None, starts=starts))
    with torch.inference_mode():
        eng._take_inbox(block=False)
        eng._step()
        (stream,) = eng.scheduler.running
        while stream.position < at:
            eng._step()
    assert stream.position == at
    kv, slot = mem.kv, stream.claim.slot
    fixed = {(i, s.name): kv.fixed(i, s.name, slot).clone() for i, layer in enumerate(kv.layout.layers)
             for s in layer.fixed}
    rows = {(i, s.name): kv.rows(i, s.name, slot, at).clone() for i, layer in enumerate(kv.layout.layers)
            for s in layer.rows}
    return fixed, rows


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0, max_tokens=REPLY),
                                      Sampling(temperature=0.8, top_p=0.9, seed=5, max_tokens=REPLY)],
                         ids=["greedy", "seeded"])
def test_three_turns_resume_and_equal_fresh_runs(subject, sampling):
    def inspect(mem: StreamMemory, tier: DeviceTier, turns: list[Turn]) -> None:
        # the state kept at the end of turn 1's prompt is what a cold pass of turn 3 holds at that row
        state = next(s for s in tier.states if s.at == len(turns[0][0]))
        assert state.fixed, "the qwen family declares fixed states"
        engine_gates.check_kept_state(mem, state, *cold_state_at(subject, turns[2][0], turns[2][1], state.at))

    engine_gates.check_device_resume(subject, RIG, sampling, tokens, USERS, rewind=False, inspect=inspect)
