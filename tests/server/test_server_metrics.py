"""GET /metrics on a real server: Prometheus text whose tier counters move exactly as a resumed turn says they
should (usage.cached_tokens == the device tier's prompt_tokens_cached_total step, a miss on the host tier for each
lookup it did not serve), and pool numbers that add up. States moving device → host → evicted are checked by the
reuse gate's eviction scenario (tests/tools)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tensorfold.engine.stats import EngineStats
from tensorfold.server import build_app
from tensorfold.testing.process import serving

TIER_COUNTERS = ("tier_kept", "tier_hits", "tier_misses", "tier_evicted", "tier_refused", "prompt_tokens_cached")
TIER_GAUGES = ("tier_states", "tier_bytes", "tier_budget_bytes")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "prefill_step_seconds", "decode_step_seconds", "step_rows")
SYSTEM = "You are a careful assistant who answers every question in full sentences, with reasons. " * 3


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample name and labels → value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def tier(samples: dict, name: str, which: str = "device") -> float:
    """A per-tier sample; counters carry the _total suffix."""
    for suffix in ("_total", ""):
        key = (f"tensorfold_{name}{suffix}", (("tier", which),))
        if key in samples:
            return samples[key]
    raise KeyError(f"{name}{{tier={which}}} not in /metrics")


def plain(samples: dict, name: str) -> float:
    """A sample without labels."""
    return samples[(f"tensorfold_{name}", ())]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("metrics")
    subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", "example", str(directory / "m")],
                   check=True, capture_output=True)
    args = ["--family", "example", "--model", str(directory / "m"), "--context", "1024", "--page-rows", "16",
            "--prefill-chunk", "128", "--min-chunk", "16", "--parallel", "2", "--host-cache-gib", "0.01"]
    with serving(args, directory / "server.log", env={"TF_KV_POISON": "1"}) as url:
        yield url


def metrics(base: str) -> dict:
    reply = httpx.get(f"{base}/metrics", timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return scrape(reply.text)


def bucket(samples: dict, name: str, le: str) -> float:
    """A histogram's cumulative bucket `le` (as Prometheus writes the bound)."""
    return samples[(f"tensorfold_{name}_bucket", (("le", le),))]


def idle(base: str) -> dict:
    """/metrics once the engine has nothing running (a finished stream is freed just after its last event)."""
    deadline = time.monotonic() + 10
    while True:
        samples = metrics(base)
        if plain(samples, "requests_running") == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_a_resumed_turn_moves_the_tier_counters_by_what_usage_says(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    before = idle(base)
    assert all(tier(before, name, which) == 0 for name in TIER_COUNTERS for which in ("device", "host")), before
    assert tier(before, "tier_budget_bytes") == 2**30 and tier(before, "tier_states") == 0
    assert tier(before, "tier_budget_bytes", "host") == int(0.01 * 2**30)
    assert plain(before, "pool_pages_free") == plain(before, "pool_pages") > 0
    assert plain(before, "slots") == plain(before, "slots_free") == 2

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why is the sky blue?"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0, seed=1)
    after_first = idle(base)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert tier(after_first, "tier_misses") == 1 and tier(after_first, "tier_hits") == 0
    kept = tier(after_first, "tier_kept")
    assert kept >= 1 and tier(after_first, "tier_states") == kept
    assert 0 < tier(after_first, "tier_bytes") <= tier(after_first, "tier_budget_bytes")
    assert plain(after_first, "pool_pages_kept") > 0
    assert plain(after_first, "pool_pages_free") + plain(after_first, "pool_pages_kept") == plain(after_first,
                                                                                                  "pool_pages")

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And why is the sunset red?"}]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0, seed=1)
    after = idle(base)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert tier(after, "tier_hits") == 1 and tier(after, "tier_misses") == 1
    assert tier(after, "prompt_tokens_cached") == cached
    assert tier(after, "tier_misses", "host") == 2 and tier(after, "tier_hits", "host") == 0  # one lookup each
    assert tier(after, "tier_kept", "host") == tier(after, "tier_states", "host") == 0  # the device had room
    assert tier(after, "tier_kept") > kept
    assert tier(after, "tier_states") == tier(after, "tier_kept") - tier(after, "tier_evicted")
    assert tier(after, "tier_evicted") == tier(after, "tier_refused") == 0
    assert plain(after, "requests_waiting") == 0 and plain(after, "slots_free") == 2
    assert (("tensorfold_model_info", (("family", "example"), ("model", "m"))) in after)


def test_every_documented_metric_is_served_and_documented(base):
    names = {name for name, _ in metrics(base)}
    text = httpx.get(f"{base}/metrics", timeout=10).text
    families = {family.name for family in text_string_to_metric_families(text)}  # histograms by their own name
    docs = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    for name in sorted(families):
        assert f"`{name}" in docs, f"{name} is served but not documented in docs/api.md"
    for name in TIER_COUNTERS:
        assert f"tensorfold_{name}_total" in names
    for name in TIER_GAUGES:
        assert f"tensorfold_{name}" in names


def test_the_latency_metrics_export_what_the_recorder_holds(loaded):
    stats = EngineStats()
    stats.arrived("a", 0.0)
    stats.arrived("b", 1.0)
    stats.admitted("a", 0.25, prompt_tokens=9, resumed_tokens=2)
    for at in (1.0, 1.5, 2.0):
        stats.token("a", at)
    stats.step(prefill_rows=7, decode_rows=0, seconds=0.5)
    stats.step(prefill_rows=0, decode_rows=1, seconds=0.005)
    stats.finished("a", "length", 3.0)
    stats.finished("b", "cancelled", 3.0)
    with TestClient(build_app(attrs.evolve(loaded.service, stats=stats))) as http:
        text = http.get("/metrics").text
    kinds = {family.name: family.type for family in text_string_to_metric_families(text)}
    samples = scrape(text)
    for name in HISTOGRAMS:
        assert kinds[f"tensorfold_{name}"] == "histogram"
        assert samples[(f"tensorfold_{name}_bucket", (("le", "+Inf"),))] == plain(samples, f"{name}_count")
    assert plain(samples, "time_to_first_token_seconds_count") == 1
    assert plain(samples, "time_to_first_token_seconds_sum") == 1.0
    assert bucket(samples, "time_to_first_token_seconds", "0.75") == 0
    assert bucket(samples, "time_to_first_token_seconds", "1.0") == 1
    assert plain(samples, "inter_token_latency_seconds_count") == 2
    assert bucket(samples, "inter_token_latency_seconds", "0.4") == 0
    assert bucket(samples, "inter_token_latency_seconds", "0.5") == 2
    assert bucket(samples, "request_queue_time_seconds", "0.25") == 1
    assert plain(samples, "e2e_request_latency_seconds_count") == 2  # the one ended while waiting has one too
    assert [bucket(samples, "e2e_request_latency_seconds", le) for le in ("1.5", "2.0", "2.5", "5.0")] == [0, 1, 1, 2]
    assert plain(samples, "request_queue_time_seconds_count") == 1
    assert plain(samples, "prefill_step_seconds_count") == plain(samples, "decode_step_seconds_count") == 1
    assert bucket(samples, "decode_step_seconds", "0.0025") == 0
    assert bucket(samples, "decode_step_seconds", "0.005") == 1
    assert bucket(samples, "step_rows", "1.0") == 1 and bucket(samples, "step_rows", "8.0") == 2
    assert plain(samples, "step_rows_sum") == 8
    for name in ("prompt_tokens", "generation_tokens", "prompt_tokens_resumed"):
        assert kinds[f"tensorfold_{name}"] == "counter"
    assert (plain(samples, "prompt_tokens_total"), plain(samples, "generation_tokens_total"),
            plain(samples, "prompt_tokens_resumed_total")) == (9, 3, 2)
    finished = {dict(labels)["finished_reason"]: value for (name, labels), value in samples.items()
                if name == "tensorfold_requests_finished_total"}
    assert finished == {"stop": 0, "length": 1, "cancelled": 1, "error": 0}


def test_kv_cache_usage_is_the_share_of_pages_held(loaded):
    with TestClient(build_app(loaded.service)) as http:
        samples = scrape(http.get("/metrics").text)
    held = plain(samples, "pool_pages") - plain(samples, "pool_pages_free")
    assert plain(samples, "kv_cache_usage_ratio") == held / plain(samples, "pool_pages")


def test_without_a_recorder_there_are_no_latency_metrics(loaded):
    with TestClient(build_app(attrs.evolve(loaded.service, stats=None))) as http:
        names = {family.name for family in text_string_to_metric_families(http.get("/metrics").text)}
    assert "tensorfold_slots" in names
    assert not names & {f"tensorfold_{name}" for name in (*HISTOGRAMS, "prompt_tokens", "requests_finished")}


def test_two_apps_in_one_process_each_report_their_own_engine(loaded):
    other = attrs.evolve(loaded.service, model_name="other")
    with TestClient(build_app(loaded.service)) as one, TestClient(build_app(other)) as two:
        first, second = scrape(one.get("/metrics").text), scrape(two.get("/metrics").text)
    assert ("tensorfold_model_info", (("family", "example"), ("model", "tiny"))) in first
    assert ("tensorfold_model_info", (("family", "example"), ("model", "other"))) in second
    assert plain(first, "slots") == plain(second, "slots")


def test_scrapes_while_a_request_runs_see_it_and_never_fail(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    done = threading.Event()

    def ask() -> None:
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count slowly. " * 40}],
                                           max_tokens=96, temperature=0, extra_body={"ignore_eos": True})
        finally:
            done.set()

    worker = threading.Thread(target=ask)
    worker.start()
    running = []
    while not done.is_set():
        running.append(plain(metrics(base), "requests_running"))
    worker.join()
    assert max(running) == 1 and plain(idle(base), "requests_running") == 0
