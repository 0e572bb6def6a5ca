"""The step budget: a step carries the prefill chunks of several streams up to --max-step-rows, never fewer than one."""

from __future__ import annotations

from tensorfold.engine.api import Request, Sampling
from tensorfold.engine.scheduler import Scheduler
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.testing import kit


def scheduler_for(subject, step_rows, parallel=4, context=128, page_rows=16) -> Scheduler:
    pages = parallel * -(-context // page_rows)
    store = PagedStore(subject.declarations.layout, parallel, pages, page_rows)
    memory = StreamMemory(store, SlotPool(parallel), PagePool(pages, page_rows))
    return Scheduler(memory, context, prefill_chunk=16, step_rows=step_rows)


def planned_rows(scheduler: Scheduler, prompts: list[tuple[int, ...]]) -> list[int]:
    for n, prompt in enumerate(prompts):
        scheduler.waiting.append(Request(f"r{n}", prompt, Sampling(max_tokens=4), lambda event: None))
    assert len(scheduler.admit()) == len(prompts)
    plan, streams = scheduler.plan()
    return [len(share.tokens) for share in plan.streams]


def test_a_step_carries_chunks_of_several_streams_up_to_the_budget(example, tiny_dir):
    subject = kit.load(example, tiny_dir)
    prompts = [tuple(range(3, 3 + 40))] * 4
    # each stream's next chunk is 16 rows (the grid); a budget of 48 takes three of the four streams
    assert planned_rows(scheduler_for(subject, 48), prompts) == [16, 16, 16]
    assert planned_rows(scheduler_for(subject, 64), prompts) == [16, 16, 16, 16]


def test_the_oldest_prefill_chunk_goes_whatever_the_budget(example, tiny_dir):
    subject = kit.load(example, tiny_dir)
    assert planned_rows(scheduler_for(subject, 1), [tuple(range(3, 43))] * 2) == [16]


def test_without_a_budget_a_step_carries_one_chunks_worth(example, tiny_dir):
    subject = kit.load(example, tiny_dir)
    scheduler = scheduler_for(subject, None)
    assert scheduler.step_rows == 16
    assert planned_rows(scheduler, [tuple(range(3, 43))] * 3) == [16]
