"""Latency and token statistics of the step loop, for /metrics: fixed-bucket histograms and counters kept as plain
ints, so recording costs a bisect and a few increments and a scrape copies a few short lists.

    clock     every method takes `now` (time.monotonic, read by the caller once per event or step), so tests drive
              it with exact values and a step's tokens share one reading
    writers   `arrived` runs on the submitting thread and only sets one item of a dict the engine thread pops;
              every other method runs on the engine thread, the only writer of the histograms and counters
    readers   a scrape copies each bucket list (one C-level copy) and takes the count from that copy, so a
              histogram's buckets and _count always agree; its _sum may hold one observation more or fewer
    no lock   with a single writer an increment loses nothing, and readers only copy: a lock would cost the
              engine thread on every token and buy the scrape nothing it needs
"""

from __future__ import annotations

from bisect import bisect_left

import attrs

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read these the same way.
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                      120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_ROWS_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's inter-token buckets, with finer ones below its first (10 ms) where GPU decode steps fall.
ITL_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                  0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Queue time is mostly near zero: TTFT's fine low buckets, not the request buckets that start at 0.3 s.
QUEUE_BUCKETS = TTFT_BUCKETS
STEP_BUCKETS = ITL_BUCKETS

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "cancelled", "error")


def _checked(bounds: tuple[float, ...]) -> tuple[float, ...]:
    bounds = tuple(bounds)
    if not bounds or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"bucket bounds must be a non-empty increasing sequence, got {bounds}")
    return bounds


@attrs.frozen
class HistogramSnapshot:
    """One histogram as a scrape saw it: per-bucket counts (the last is above every bound), and the sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        """Observations, all buckets together (Prometheus' _count and the +Inf bucket)."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) per bound, then (inf, count): Prometheus' `le` buckets."""
        running, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@attrs.define
class Histogram:
    """Observations counted per fixed bucket (`le` upper bounds, inclusive) plus their sum; one writer."""

    bounds: tuple[float, ...] = attrs.field(converter=_checked)
    counts: list[int] = attrs.field(init=False)
    sum: float = attrs.field(init=False, default=0.0)

    @counts.default
    def _zeros(self) -> list[int]:
        return [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count `value` in the first bucket whose bound is at least `value`."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        """The counts now (copied in one step) and the sum."""
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum)


@attrs.frozen
class StatsSnapshot:
    """Everything EngineStats counted, as one scrape saw it."""

    ttft: HistogramSnapshot
    itl: HistogramSnapshot
    e2e: HistogramSnapshot
    queue: HistogramSnapshot
    prefill_step: HistogramSnapshot
    decode_step: HistogramSnapshot
    step_rows: HistogramSnapshot
    prompt_tokens: int
    generation_tokens: int
    resumed_tokens: int
    finished: dict[str, int]


class EngineStats:
    """What the step loop reports as it goes: request times, step times, tokens and finish reasons."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.queue = Histogram(QUEUE_BUCKETS)
        self.prefill_step = Histogram(STEP_BUCKETS)
        self.decode_step = Histogram(STEP_BUCKETS)
        self.step_rows = Histogram(STEP_ROWS_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.resumed_tokens = 0
        self.finished_by_reason: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._arrived: dict[str, float] = {}  # request id -> when it was submitted, until it finishes
        self._last: dict[str, float] = {}     # request id -> when its latest token was sampled

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished yet (what the per-request maps hold)."""
        return len(self._arrived)

    def arrived(self, request_id: str, now: float) -> None:
        """A request was queued (before the engine can see it): the start of its TTFT, queue and e2e times."""
        self._arrived[request_id] = now

    def admitted(self, request_id: str, now: float, prompt_tokens: int, resumed_tokens: int) -> None:
        """A request got its slot and pages: its queue time ends; its prompt counts, `resumed_tokens` of it
        resumed from a kept state instead of prefilled."""
        arrived = self._arrived.get(request_id)
        if arrived is not None:
            self.queue.observe(now - arrived)
        self.prompt_tokens += prompt_tokens
        self.resumed_tokens += resumed_tokens

    def token(self, request_id: str, now: float) -> None:
        """A token was sampled for the request: its first closes the TTFT, each later one is an inter-token gap."""
        last = self._last.get(request_id)
        if last is None:
            arrived = self._arrived.get(request_id)
            if arrived is not None:
                self.ttft.observe(now - arrived)
        else:
            self.itl.observe(now - last)
        self._last[request_id] = now
        self.generation_tokens += 1

    def finished(self, request_id: str, reason: str, now: float) -> None:
        """The request ended (`stop`, `length`, `cancelled` or `error`), admitted or not: its e2e time ends."""
        arrived = self._arrived.pop(request_id, None)
        self._last.pop(request_id, None)
        if arrived is not None:
            self.e2e.observe(now - arrived)
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def step(self, prefill_rows: int, decode_rows: int, seconds: float | None) -> None:
        """A step ran: a prefill step when it fed any prompt rows (mixed steps too), else a decode step; `seconds`
        None when its time is not known (a CUDA step the loop did not wait for): its rows count, its time not."""
        rows = prefill_rows + decode_rows
        if rows <= 0:
            return
        if seconds is not None:
            (self.prefill_step if prefill_rows > 0 else self.decode_step).observe(seconds)
        self.step_rows.observe(rows)

    def snapshot(self) -> StatsSnapshot:
        """Every histogram and counter now (read from a scrape while the engine thread writes)."""
        return StatsSnapshot(ttft=self.ttft.snapshot(), itl=self.itl.snapshot(), e2e=self.e2e.snapshot(),
                             queue=self.queue.snapshot(), prefill_step=self.prefill_step.snapshot(),
                             decode_step=self.decode_step.snapshot(), step_rows=self.step_rows.snapshot(),
                             prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
                             resumed_tokens=self.resumed_tokens, finished=dict(self.finished_by_reason))
