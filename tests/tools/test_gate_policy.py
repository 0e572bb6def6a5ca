"""The gate's own copy of the keep policy (tools/gate/policy.py) agrees with the engine's, case by case: cuts with
cuts.py, marks with the server's starts.py, keep points with tiers/policy.py. Two writings of one rule that
agree are the gate's reason to trust its predicted resume rows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gate.policy import KeepModel, Shape, cuts_of, shape
from tensorfold.cuts import plan_cuts
from tensorfold.server.starts import keep_marks
from tensorfold.tiers.policy import keep_points

ROLES = st.sampled_from(["system", "developer", "user", "assistant"])


def test_the_cut_rule_on_the_engines_worked_example():
    assert cuts_of(1000, (50, 300, 330, 950), 400, 100) == (50, 300, 330, 730, 950, 1000)


@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, 3000), starts=st.lists(st.integers(-5, 3005), max_size=12),
       grid=st.integers(1, 700), min_chunk=st.integers(1, 300))
def test_cuts_agree_with_the_engine(length, starts, grid, min_chunk):
    assert cuts_of(length, starts, grid, min_chunk) == plan_cuts(length, starts, grid, min_chunk)


@st.composite
def shapes(draw):
    """A prompt of some messages, each start proven or not, the history end proven or not."""
    roles = draw(st.lists(ROLES, min_size=1, max_size=8))
    sizes = draw(st.lists(st.integers(1, 400), min_size=len(roles), max_size=len(roles)))
    header = draw(st.integers(1, 5))
    ends = [sum(sizes[: i + 1]) for i in range(len(roles))]
    proven = draw(st.lists(st.booleans(), min_size=len(roles), max_size=len(roles)))
    length = ends[-1] + header
    prompt = tuple(range(length))
    prefixes = [prompt[:end] if ok else (-1,) * end for end, ok in zip(ends, proven, strict=True)]
    return shape(prompt, prefixes, roles)


@settings(max_examples=300, deadline=None)
@given(request=shapes(), grid=st.integers(16, 700), min_chunk=st.integers(1, 300), data=st.data())
def test_marks_and_keep_points_agree_with_the_server_and_the_engine(request: Shape, grid, min_chunk, data):
    messages = [{"role": role, "content": ""} for role in request.roles]
    positions = {i: at for i, at in enumerate((*request.message_starts[1:], request.history_end), start=1)
                 if at is not None}
    marks = keep_marks(messages, positions)
    history, system, rewind = request.marks()
    assert (marks.history or len(request.prompt), marks.system, marks.rewind) == (history, system, rewind)
    cuts = cuts_of(len(request.prompt), request.starts, grid, min_chunk)
    start = data.draw(st.sampled_from((0, *cuts[:-1])))
    engine = keep_points(cuts, len(request.prompt), marks.history, marks.system, marks.rewind, start, min_chunk)
    assert request.keep_points(cuts, start, min_chunk) == set(engine)


def test_a_next_turn_resumes_at_the_history_end_and_an_edit_at_the_rewind_cut():
    model = KeepModel(grid=512, min_chunk=16)
    # system [0, 100), user [100, 200), generated turn from 200, prompt end 203
    first = shape(tuple(range(203)), [tuple(range(100)), tuple(range(200))], ["system", "user"])
    assert model.resume_row(first) == 0
    model.after(first, 0)
    assert sorted(k.at for k in model.kept) == [100, 200]
    # the next turn: its history to 200 is the first turn's, then the reply and a new user message
    second = shape(tuple(range(303)), [tuple(range(100)), tuple(range(200)), tuple(range(230)), tuple(range(300))],
                   ["system", "user", "assistant", "user"])
    assert model.resume_row(second) == 200
    edited = shape((*range(100), *range(1000, 1103)), [tuple(range(100)), (*range(100), *range(1000, 1100))],
                   ["system", "user"])
    assert model.resume_row(edited) == 100
    model.drop_all()
    assert model.resume_row(second) == 0
