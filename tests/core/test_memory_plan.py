"""The memory plan prices streams and pages from the Layout alone and refuses with the numbers."""

from __future__ import annotations

from tensorfold.layout import FixedState, LayerLayout, Layout, RowState
from tensorfold.memory_plan import GIB, page_bytes, plan_memory

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


def test_auto_parallel_takes_what_fits_up_to_eight():
    stream = 4 * 256 * PER_TOKEN + FIXED
    plan, _ = plan_memory(LAYOUT, context=1024, page_rows=256, budget_bytes=3 * stream + 5, parallel=None)
    assert plan.parallel == 3
    plan, _ = plan_memory(LAYOUT, context=1024, page_rows=256, budget_bytes=GIB, parallel=None)
    assert plan.parallel == 8


def test_a_fixed_parallel_that_does_not_fit_is_refused_by_name():
    stream = 4 * 256 * PER_TOKEN + FIXED
    plan, refusals = plan_memory(LAYOUT, context=1024, page_rows=256, budget_bytes=3 * stream, parallel=8)
    assert plan is None
    assert refusals[0].startswith("--parallel 8 needs 4.5 MiB of KV at --context 1024, the budget is 1.7 MiB: "
                                  "serve --parallel 3 or lower --context")


def test_not_even_one_stream_is_refused():
    plan, refusals = plan_memory(LAYOUT, context=1 << 20, page_rows=256, budget_bytes=1 << 20, parallel=None)
    assert plan is None and "one stream needs" in refusals[0] and "--kv-gib" in refusals[0]
