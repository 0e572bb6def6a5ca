"""The memory plan prices streams and pages from the Layout alone and refuses with the numbers."""

from __future__ import annotations

from tensorfold.engine.graphs import batch_sizes
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState
from tensorfold.memory_plan import AUTO_PARALLEL_MAX, GIB, auto_parallel, page_bytes, plan_memory

LAYOUT = Layout([LayerLayout("attention", rows=[RowState("k", (2, 64), "bfloat16"),
                                                RowState("v", (2, 64), "bfloat16")]),
                 LayerLayout("gdn", fixed=[FixedState("state", (4, 64, 64), "float32")])])
PER_TOKEN = 2 * 2 * 64 * 2
FIXED = 4 * 64 * 64 * 4


def test_page_and_stream_bytes_follow_the_formula():
    plan, refusals = plan_memory(LAYOUT, context=1000, page_rows=256, budget_bytes=GIB, parallel=2)
    assert refusals == []
    assert plan.page_bytes == page_bytes(LAYOUT, 256) == 256 * PER_TOKEN
    assert plan.window_pages == 4 and plan.stream_bytes == 4 * 256 * PER_TOKEN + FIXED
    assert plan.pages == 8 and plan.kv_bytes == 8 * 256 * PER_TOKEN + 2 * FIXED


def test_auto_parallel_takes_what_fits_up_to_the_largest_captured_decode_batch():
    stream = 4 * 256 * PER_TOKEN + FIXED
    plan, _ = plan_memory(LAYOUT, context=1024, page_rows=256, budget_bytes=3 * stream + 5, parallel=None)
    assert plan.parallel == 3
    plan, _ = plan_memory(LAYOUT, context=1024, page_rows=256, budget_bytes=GIB, parallel=None)
    assert GIB // stream == 1820 and plan.parallel == AUTO_PARALLEL_MAX == 256
    assert plan.pages == 256 * 4 and plan.kv_bytes == 256 * stream
    assert batch_sizes(10**6)[-1] == AUTO_PARALLEL_MAX    # past it, decode steps would run without a graph


def test_auto_parallel_is_bounded_by_the_rows_one_step_carries():
    plan, _ = plan_memory(LAYOUT, context=1024, page_rows=256, budget_bytes=GIB, parallel=None, step_rows=100)
    assert plan.parallel == 100
    assert auto_parallel(fits=7, step_rows=100) == 7 and auto_parallel(fits=10**6) == 256


def test_a_stream_of_fixed_states_alone_takes_no_pages_and_auto_fills_the_budget():
    """A pure-SSM Layout: 37 KB a stream, whatever the context; auto is no longer 8."""
    ssm = Layout([LayerLayout("ssm", fixed=[FixedState("conv", (48, 3), "bfloat16"),
                                             FixedState("ssm", (8, 16, 16), "float32")])] * 4)
    assert ssm.fixed_bytes == 4 * (48 * 3 * 2 + 8 * 16 * 16 * 4) == 33920
    plan, refusals = plan_memory(ssm, context=1 << 20, page_rows=256, budget_bytes=100 * 33920 + 5, parallel=None)
    assert refusals == [] and plan.parallel == 100
    assert plan.page_bytes == 0 and plan.pages == 0 and plan.window_pages == 0
    assert plan.stream_bytes == 33920 and plan.kv_bytes == 100 * 33920
    plan, _ = plan_memory(ssm, context=4096, page_rows=256, budget_bytes=GIB, parallel=None)
    assert plan.parallel == 256 and plan.pages == 0
    plan, _ = plan_memory(ssm, context=4096, page_rows=256, budget_bytes=GIB, parallel=1000)
    assert plan.parallel == 1000 and plan.kv_bytes == 1000 * 33920


def test_a_fixed_parallel_that_does_not_fit_is_refused_by_name():
    stream = 4 * 256 * PER_TOKEN + FIXED
    plan, refusals = plan_memory(LAYOUT, context=1024, page_rows=256, budget_bytes=3 * stream, parallel=8)
    assert plan is None
    assert refusals[0].startswith("--parallel 8 needs 4.5 MiB of KV at --context 1024, the budget is 1.7 MiB: "
                                  "serve --parallel 3 or lower --context")


def test_not_even_one_stream_is_refused():
    plan, refusals = plan_memory(LAYOUT, context=1 << 20, page_rows=256, budget_bytes=1 << 20, parallel=None)
    assert plan is None and "one stream needs" in refusals[0] and "--kv-gib" in refusals[0]
