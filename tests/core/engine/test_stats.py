"""EngineStats on a driven clock: each request time lands in the bucket its exact duration names (`le` bounds are
inclusive), a request's first token is its TTFT and every later one an inter-token gap, steps split into prefill and
decode, and a scrape running beside the writer sees counts that only grow and agree with their buckets."""

from __future__ import annotations

import threading

import pytest

from tensorfold.engine.stats import (
    FINISH_REASONS,
    ITL_BUCKETS,
    QUEUE_BUCKETS,
    REQUEST_BUCKETS,
    STEP_BUCKETS,
    STEP_ROWS_BUCKETS,
    TTFT_BUCKETS,
    EngineStats,
    Histogram,
    HistogramSnapshot,
)


def only(bounds: tuple[float, ...], **at: int) -> tuple[int, ...]:
    """Per-bucket counts that are zero but for `at` ({"b0_5": 2} puts 2 in the bucket of bound 0.5; "inf" the
    last)."""
    counts = [0] * (len(bounds) + 1)
    for key, count in at.items():
        index = len(bounds) if key == "inf" else bounds.index(float(key[1:].replace("_", ".")))
        counts[index] = count
    return tuple(counts)


def test_a_value_counts_in_the_first_bucket_whose_bound_is_at_least_it():
    histogram = Histogram((1.0, 2.0, 4.0))
    for value in (0.5, 1.0, 1.5, 4.0, 8.0, 0.0):
        histogram.observe(value)
    now = histogram.snapshot()
    assert now.counts == (3, 1, 1, 1)
    assert now.cumulative() == [(1.0, 3), (2.0, 4), (4.0, 5), (float("inf"), 6)]
    assert now.count == 6 and now.sum == 15.0


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)])
def test_bounds_must_be_increasing(bounds):
    with pytest.raises(ValueError, match="increasing"):
        Histogram(bounds)


def test_the_buckets_are_vllms_with_finer_inter_token_ones():
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert REQUEST_BUCKETS[0] == 0.3 and REQUEST_BUCKETS[-1] == 7680.0 and len(REQUEST_BUCKETS) == 21
    assert ITL_BUCKETS[:5] == (0.001, 0.0025, 0.005, 0.0075, 0.01) and ITL_BUCKETS[-1] == 80.0
    assert QUEUE_BUCKETS == TTFT_BUCKETS and STEP_BUCKETS == ITL_BUCKETS
    assert STEP_ROWS_BUCKETS == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def test_one_request_through_every_method():
    stats = EngineStats()
    stats.arrived("a", 10.0)
    stats.admitted("a", 10.5, prompt_tokens=12, resumed_tokens=4)
    stats.token("a", 11.0)
    stats.token("a", 11.25)
    stats.token("a", 11.5)
    assert stats.in_flight == 1
    stats.finished("a", "length", 12.0)
    now = stats.snapshot()
    assert now.queue.counts == only(QUEUE_BUCKETS, b0_5=1) and now.queue.sum == 0.5
    assert now.ttft.counts == only(TTFT_BUCKETS, b1_0=1) and now.ttft.sum == 1.0
    assert now.itl.counts == only(ITL_BUCKETS, b0_3=2) and now.itl.sum == 0.5
    assert now.e2e.counts == only(REQUEST_BUCKETS, b2_0=1) and now.e2e.sum == 2.0
    assert (now.prompt_tokens, now.resumed_tokens, now.generation_tokens) == (12, 4, 3)
    assert now.finished == {"stop": 0, "length": 1, "cancelled": 0, "error": 0}
    assert stats.in_flight == 0


def test_many_requests_count_one_ttft_each_and_one_gap_per_later_token():
    stats = EngineStats()
    requests, tokens = 5, 7
    for r in range(requests):
        stats.arrived(f"r{r}", 0.0)
        stats.admitted(f"r{r}", 0.0, prompt_tokens=10 + r, resumed_tokens=0)
    for t in range(tokens):
        for r in range(requests):
            stats.token(f"r{r}", 1.0 + t * 0.0625)
    for r in range(requests):
        stats.finished(f"r{r}", FINISH_REASONS[r % 4], 2.0)
    now = stats.snapshot()
    assert now.ttft.count == requests and now.ttft.counts == only(TTFT_BUCKETS, b1_0=requests)
    assert now.itl.count == requests * (tokens - 1) and now.itl.counts == only(ITL_BUCKETS, b0_075=30)
    assert now.generation_tokens == requests * tokens == now.ttft.count + now.itl.count
    assert now.e2e.count == now.queue.count == requests
    assert now.prompt_tokens == sum(10 + r for r in range(requests))
    assert now.finished == {"stop": 2, "length": 1, "cancelled": 1, "error": 1}
    assert stats.in_flight == 0


def test_a_request_ended_while_waiting_has_an_e2e_time_and_nothing_else():
    stats = EngineStats()
    stats.arrived("w", 3.0)
    stats.finished("w", "cancelled", 3.25)
    now = stats.snapshot()
    assert now.e2e.counts == only(REQUEST_BUCKETS, b0_3=1)
    assert now.queue.count == now.ttft.count == now.itl.count == 0
    assert now.prompt_tokens == now.generation_tokens == 0
    assert now.finished["cancelled"] == 1 and stats.in_flight == 0


def test_a_request_never_seen_arriving_counts_its_tokens_and_reason_but_no_request_times():
    stats = EngineStats()
    stats.admitted("x", 1.0, prompt_tokens=3, resumed_tokens=0)
    stats.token("x", 2.0)
    stats.token("x", 2.5)
    stats.finished("x", "abort", 3.0)
    now = stats.snapshot()
    assert now.queue.count == now.ttft.count == now.e2e.count == 0
    assert now.itl.counts == only(ITL_BUCKETS, b0_5=1) and now.generation_tokens == 2
    assert now.finished == {"stop": 0, "length": 0, "cancelled": 0, "error": 0, "abort": 1}


def test_a_finished_request_starts_over_when_its_id_comes_again():
    stats = EngineStats()
    for start in (0.0, 100.0):
        stats.arrived("same", start)
        stats.token("same", start + 0.5)
        stats.finished("same", "stop", start + 1.0)
    now = stats.snapshot()
    assert now.ttft.counts == only(TTFT_BUCKETS, b0_5=2) and now.itl.count == 0


def test_steps_split_into_prefill_and_decode_and_count_their_rows():
    stats = EngineStats()
    stats.step(prefill_rows=128, decode_rows=3, seconds=0.02)
    stats.step(prefill_rows=7, decode_rows=0, seconds=0.5)
    stats.step(prefill_rows=0, decode_rows=4, seconds=0.005)
    stats.step(prefill_rows=0, decode_rows=0, seconds=1.0)  # nothing ran: not a step
    now = stats.snapshot()
    assert now.prefill_step.counts == only(STEP_BUCKETS, b0_025=1, b0_5=1) and now.prefill_step.sum == 0.52
    assert now.decode_step.counts == only(STEP_BUCKETS, b0_005=1) and now.decode_step.sum == 0.005
    assert now.step_rows.counts == only(STEP_ROWS_BUCKETS, b8=2, b256=1) and now.step_rows.sum == 142


def test_a_step_of_unknown_time_counts_its_rows_and_no_time():
    stats = EngineStats()
    stats.step(prefill_rows=64, decode_rows=0, seconds=None)  # a CUDA prefill chunk the loop did not wait for
    now = stats.snapshot()
    assert now.prefill_step.counts == only(STEP_BUCKETS) and now.prefill_step.sum == 0
    assert now.step_rows.counts == only(STEP_ROWS_BUCKETS, b64=1) and now.step_rows.sum == 64


def test_a_snapshot_does_not_move_with_later_records():
    stats = EngineStats()
    stats.step(0, 1, 0.01)
    before = stats.snapshot()
    stats.step(0, 1, 0.01)
    stats.finished("z", "stop", 0.0)
    assert before.decode_step.count == 1 and before.finished["stop"] == 0
    assert stats.snapshot().decode_step.count == 2


def test_scrapes_beside_the_writer_see_counts_that_agree_and_only_grow():
    stats = EngineStats()
    requests, tokens = 8, 2000
    done = threading.Event()

    def write() -> None:
        for r in range(requests):
            stats.arrived(f"r{r}", 0.0)
        for t in range(tokens):
            for r in range(requests):
                stats.token(f"r{r}", t * 0.001)
            stats.step(0, requests, 0.001)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    seen: list[tuple[int, int, int]] = []
    while not done.is_set():
        now = stats.snapshot()
        for histogram in (now.itl, now.ttft, now.decode_step):
            assert histogram.cumulative()[-1][1] == histogram.count
        seen.append((now.itl.count, now.decode_step.count, now.step_rows.count))
    writer.join()
    assert all(a <= b for earlier, later in zip(seen, seen[1:], strict=False) for a, b in zip(earlier, later,
                                                                                            strict=True))
    final = stats.snapshot()
    assert final.itl.count == requests * (tokens - 1) and final.ttft.count == requests
    assert final.decode_step.count == final.step_rows.count == tokens
    assert final.generation_tokens == requests * tokens


def test_snapshot_counts_add_up():
    snapshot = HistogramSnapshot((1.0, 2.0), (1, 0, 2), 7.5)
    assert snapshot.count == 3 and snapshot.cumulative()[-1] == (float("inf"), 3)
