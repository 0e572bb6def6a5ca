"""GET /metrics: Prometheus text read from the live engine at scrape time.

One collector per app, in a registry of its own: no module-level metric objects, so two apps in one process
(tests, or a second engine) never share or clash over counters. Every number comes from the objects that own
it (the tiers' `stats()`, the page pool, the slots, the scheduler, the engine's EngineStats); the collector keeps
nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response

from tensorfold.engine.stats import FINISH_REASONS, EngineStats
from tensorfold.service import Service
from tensorfold.tiers.stats import TierStats

PREFIX = "tensorfold"


@attrs.frozen
class TierMetric:
    """One per-tier number: its name, what it means, counter or gauge, and the TierStats field it reads."""

    name: str
    help: str
    counter: bool
    field: str


TIER_METRICS: tuple[TierMetric, ...] = (
    TierMetric("tier_kept", "States taken into the tier (kept there, or moved there from a faster tier).", True,
               "kept"),
    TierMetric("tier_hits", "Requests that resumed from a state of this tier.", True, "hits"),
    TierMetric("tier_misses", "Lookups this tier could not serve.", True, "misses"),
    TierMetric("tier_evicted", "States that left the tier (moved to a slower tier, or dropped).", True, "evicted"),
    TierMetric("tier_refused", "States larger than the tier's budget, never taken in.", True, "refused"),
    TierMetric("prompt_tokens_cached", "Prompt tokens resumed from this tier instead of prefilled.", True,
               "cached_tokens"),
    TierMetric("tier_states", "States the tier holds now.", False, "states"),
    TierMetric("tier_bytes", "Bytes the tier holds now.", False, "bytes"),
    TierMetric("tier_budget_bytes", "Bytes the tier may hold (--prompt-cache-gib, --host-cache-gib).", False,
               "budget"),
)

# The disk tier's own counters (its describe() keys): what a store's operator watches beyond the per-tier ones.
DISK_METRICS: tuple[tuple[str, str, str], ...] = (
    ("disk_read_bytes", "Bytes of kept states read from the rows store.", "disk_read_bytes"),
    ("disk_read_seconds", "Seconds spent reading and verifying kept states from the rows store.",
     "disk_read_seconds"),
    ("disk_written_bytes", "Bytes of kept states written to the rows store.", "disk_written_bytes"),
    ("disk_damaged", "Store files that failed a check (at startup or on a read); their states were forgotten.",
     "disk_damaged"),
    ("disk_failed_reads", "Resumes whose disk read failed its check (the request fell back or prefilled).",
     "disk_failed_reads"),
    ("disk_declined", "Disk states the payoff rule declined: prefilling was predicted cheaper than reading.",
     "disk_declined"),
    ("disk_dropped", "States that never reached the disk: the staging queue was full or shutdown ran out of time.",
     "disk_dropped"),
)


@attrs.frozen
class StatsMetric:
    """One number of EngineStats: its name, what it means, and the StatsSnapshot field it reads."""

    name: str
    help: str
    field: str


# Histograms, seconds unless named otherwise (docs/api.md names the vLLM metric each maps to).
LATENCY_METRICS: tuple[StatsMetric, ...] = (
    StatsMetric("time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", "ttft"),
    StatsMetric("inter_token_latency_seconds", "Seconds between consecutive tokens of one request.", "itl"),
    StatsMetric("e2e_request_latency_seconds", "Seconds from a request's arrival to its end, whatever the reason.",
                "e2e"),
    StatsMetric("request_queue_time_seconds", "Seconds from a request's arrival to its admission (slot and pages).",
                "queue"),
    StatsMetric("prefill_step_seconds", "Seconds per step that fed prompt rows (decode rows may share it).",
                "prefill_step"),
    StatsMetric("decode_step_seconds", "Seconds per step that fed decode rows only.", "decode_step"),
    StatsMetric("step_rows", "Rows (tokens) fed per step, prompt and decode together.", "step_rows"),
)
TOKEN_METRICS: tuple[StatsMetric, ...] = (
    StatsMetric("prompt_tokens", "Prompt tokens of admitted requests, resumed ones included.", "prompt_tokens"),
    StatsMetric("generation_tokens", "Tokens sampled, counted as each is sampled.", "generation_tokens"),
    StatsMetric("prompt_tokens_resumed", "Prompt tokens resumed from a kept state instead of prefilled (all tiers).",
                "resumed_tokens"),
)


def tier_stats(engine: Any) -> list[TierStats]:
    """Every tier's TierStats now, fastest first; empty with every tier off (or an engine that has no tiers,
    such as a wrapper a test puts in front of one)."""
    return [tier.stats() for tier in getattr(engine, "tiers", ())]


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


class EngineCollector(Collector):
    """Reads tiers, pool, slots and queues of one served model each time /metrics is scraped."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        """Every metric, from the live objects (read from the HTTP thread: numbers may be a step old)."""
        info = GaugeMetricFamily(f"{PREFIX}_model_info", "The served model (value always 1).",
                                 labels=["model", "family"])
        info.add_metric([self.service.model_name, self.service.family], 1)
        yield info
        yield from _settled(self._live)

    def _live(self) -> list[Metric]:
        engine = self.service.engine
        return [*self._tiers(tier_stats(engine)), *self._disk(engine),
                *self._requests(getattr(engine, "scheduler", None)), *_latency(self.service.stats),
                *self._memory(getattr(engine, "memory", None))]

    def _disk(self, engine: Any) -> Iterator[Metric]:
        disk = next((tier for tier in getattr(engine, "tiers", ()) if tier.name == "disk"), None)
        if disk is None:
            return
        numbers = disk.describe()
        for name, help_text, key in DISK_METRICS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=numbers[key])

    def _tiers(self, stats: list[TierStats]) -> Iterator[Metric]:
        for metric in TIER_METRICS:
            kind = CounterMetricFamily if metric.counter else GaugeMetricFamily
            family = kind(f"{PREFIX}_{metric.name}", metric.help, labels=["tier"])
            for one in stats:
                family.add_metric([one.tier], getattr(one, metric.field))
            yield family

    def _requests(self, scheduler: Any) -> Iterator[Metric]:
        if scheduler is None:
            return
        yield _gauge("requests_running", "Requests the engine is running (prefilling or decoding).",
                     len(scheduler.running))
        yield _gauge("requests_waiting", "Requests admitted to the engine's queue, waiting for a slot or pages.",
                     len(scheduler.waiting))

    def _memory(self, memory: Any) -> Iterator[Metric]:
        if memory is None:
            return
        for name, help_text, value in _memory_numbers(memory):
            yield _gauge(name, help_text, value)


def _latency(stats: EngineStats | None) -> Iterator[Metric]:
    """The engine's histograms and counters, from one snapshot (none without a recorder)."""
    if stats is None:
        return
    now = stats.snapshot()
    for metric in LATENCY_METRICS:
        histogram = getattr(now, metric.field)
        buckets = [(floatToGoString(bound), count) for bound, count in histogram.cumulative()]
        yield HistogramMetricFamily(f"{PREFIX}_{metric.name}", metric.help, buckets=buckets, sum_value=histogram.sum)
    for metric in TOKEN_METRICS:
        yield CounterMetricFamily(f"{PREFIX}_{metric.name}", metric.help, value=getattr(now, metric.field))
    finished = CounterMetricFamily(f"{PREFIX}_requests_finished", "Requests ended, by finish reason.",
                                   labels=["finished_reason"])
    for reason in (*FINISH_REASONS, *sorted(set(now.finished) - set(FINISH_REASONS))):
        finished.add_metric([reason], now.finished.get(reason, 0))
    yield finished


def _memory_numbers(memory: Any) -> list[tuple[str, str, float]]:
    numbers = [("slots", "Stream slots (--parallel).", memory.slots.count),
               ("slots_free", "Stream slots not in use.", memory.slots.free),
               ("kv_bytes", "Bytes of the KV store: pages (or windows) and every slot's fixed states.",
                memory.kv.nbytes)]
    pool = memory.pool
    if pool is not None:
        numbers += [("pool_pages", "Pages in the pool.", pool.total),
                    ("pool_page_rows", "Rows (tokens) per page.", pool.page_rows),
                    ("pool_pages_free", "Pages on the free list.", pool.free),
                    ("pool_pages_available", "Free pages no lease has reserved.", pool.available),
                    ("pool_pages_leased", "Pages held by running streams' leases.", pool.leased),
                    ("pool_pages_kept", "Pages held by kept states and by no lease.", pool.kept),
                    ("kv_cache_usage_ratio", "Fraction of the pool's pages held by running streams or kept states.",
                     (pool.total - pool.free) / pool.total)]
    return numbers


def _settled(read: Callable[[], list[Metric]], tries: int = 5) -> list[Metric]:
    """`read()`, again when the engine thread changed a dict or set while it was being walked (RuntimeError)."""
    for _ in range(tries - 1):
        try:
            return read()
        except RuntimeError:
            continue
    return read()


def metrics_endpoint(service: Service):
    """The /metrics handler over a registry of its own holding one EngineCollector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(service))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics
