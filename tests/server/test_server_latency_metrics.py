"""The latency, token and finish metrics of a real `tensorfold serve`, scraped and parsed with prometheus_client:
requests of known length move every count exactly (one time to first token per request, one inter-token gap per
later token, one end-to-end and one queue time per request, tokens as usage reports them, rows fed as the prompts
and replies imply), a resumed turn counts its cached tokens, and each finish reason is counted under its label.
Timing values are never asserted: only counts, sums of rows and tokens, and label sets."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorfold.engine.stats import FINISH_REASONS
from tensorfold.testing.process import serving

CONTEXT = 4096
LONG = CONTEXT - 96  # a reply that takes many steps: still running when its client goes away
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "prefill_step_seconds", "decode_step_seconds", "step_rows")
SYSTEM = "You are a careful assistant who answers every question in full sentences, with reasons. " * 3
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A server of its own, so its counters start at zero and only these tests move them."""
    directory = tmp_path_factory.mktemp("latency")
    subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", "example", str(directory / "m")],
                   check=True, capture_output=True)
    args = ["--family", "example", "--model", str(directory / "m"), "--context", str(CONTEXT), "--parallel", "2",
            "--page-rows", "16", "--prefill-chunk", "128", "--min-chunk", "16", "--host-cache-gib", "0"]
    with serving(args, directory / "server.log") as url:
        yield url


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def scrape(base: str) -> tuple[Samples, dict[str, str]]:
    """Sample name and labels → value, and each family's type."""
    reply = httpx.get(f"{base}/metrics", timeout=10)
    assert reply.status_code == 200
    families = list(text_string_to_metric_families(reply.text))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}
    return samples, {family.name: family.type for family in families}


def quiet(base: str) -> Samples:
    """/metrics once nothing runs and two scrapes in a row agree (the engine records a step after its events)."""
    deadline = time.monotonic() + 30
    previous: Samples | None = None
    while True:
        samples, _ = scrape(base)
        if samples[("tensorfold_requests_running", ())] == 0 and samples == previous:
            return samples
        if time.monotonic() > deadline:
            pytest.fail("the engine did not fall quiet within 30 s")
        previous = samples
        time.sleep(0.1)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((f"tensorfold_{name}", tuple(sorted(labels.items()))), 0.0)


def moved(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def finished(samples: Samples) -> dict[str, float]:
    return {dict(labels)["finished_reason"]: v for (name, labels), v in samples.items()
            if name == "tensorfold_requests_finished_total"}


def check_histograms(samples: Samples) -> None:
    """Every histogram's cumulative buckets grow with `le` and end at its _count."""
    for name in HISTOGRAMS:
        buckets = sorted((float(dict(labels)["le"]), v) for (sample, labels), v in samples.items()
                         if sample == f"tensorfold_{name}_bucket")
        assert len(buckets) > 1 and buckets[-1] == (float("inf"), value(samples, f"{name}_count")), name
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False)), name


def test_the_metrics_are_served_with_their_types_and_every_finish_reason(base):
    samples, kinds = scrape(base)
    for name in HISTOGRAMS:
        assert kinds[f"tensorfold_{name}"] == "histogram"
    for name in ("prompt_tokens", "generation_tokens", "prompt_tokens_resumed", "requests_finished"):
        assert kinds[f"tensorfold_{name}"] == "counter"
    assert kinds["tensorfold_kv_cache_usage_ratio"] == "gauge"
    assert set(finished(samples)) == set(FINISH_REASONS)
    check_histograms(samples)


def test_requests_of_known_length_move_every_count_exactly(base):
    requests, tokens = 5, 6
    before = quiet(base)

    def ask(i: int):
        return client(base).chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Request number {i}: tell me about the number {i}."}],
            max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(max_workers=requests) as pool:
        replies = list(pool.map(ask, range(requests)))
    after = quiet(base)
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == tokens for r in replies)
    prompt = sum(r.usage.prompt_tokens for r in replies)
    cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)

    assert moved(after, before, "time_to_first_token_seconds_count") == requests
    assert moved(after, before, "inter_token_latency_seconds_count") == requests * (tokens - 1)
    assert moved(after, before, "e2e_request_latency_seconds_count") == requests
    assert moved(after, before, "request_queue_time_seconds_count") == requests
    assert moved(after, before, "generation_tokens_total") == requests * tokens
    assert moved(after, before, "prompt_tokens_total") == prompt
    assert moved(after, before, "prompt_tokens_resumed_total") == cached
    assert {reason: after_count - finished(before)[reason] for reason, after_count in finished(after).items()} == \
        {"stop": 0, "length": requests, "cancelled": 0, "error": 0}
    # rows fed: every prompt row not resumed, then one decode row per token after the first
    assert moved(after, before, "step_rows_sum") == prompt - cached + requests * (tokens - 1)
    steps = moved(after, before, "step_rows_count")
    assert moved(after, before, "prefill_step_seconds_count") + moved(after, before, "decode_step_seconds_count") \
        == steps
    assert moved(after, before, "decode_step_seconds_count") >= tokens - 1
    check_histograms(after)
    held = value(after, "pool_pages") - value(after, "pool_pages_free")
    assert value(after, "kv_cache_usage_ratio") == held / value(after, "pool_pages")


def test_a_resumed_turn_counts_its_cached_tokens(base):
    chat = client(base)
    before = quiet(base)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why is the sky blue?"}]
    first = chat.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    quiet(base)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And why is the sunset red?"}]
    second = chat.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    after = quiet(base)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert moved(after, before, "prompt_tokens_resumed_total") == cached
    assert moved(after, before, "prompt_tokens_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert moved(after, before, "step_rows_sum") == first.usage.prompt_tokens + second.usage.prompt_tokens - cached \
        + 2 * (4 - 1)
    assert moved(after, before, "time_to_first_token_seconds_count") == 2


def test_each_finish_reason_is_counted_under_its_label(base):
    before = quiet(base)
    reasons = {"stop": 0, "length": 0}
    completion = 0
    for seed in range(64):  # random weights: search for a reply that ends with the end token
        got = httpx.post(f"{base}/v1/completions", timeout=60,
                         json={"prompt": [42, 348], "temperature": 1, "seed": seed, "max_tokens": 62}).json()
        reasons[got["choices"][0]["finish_reason"]] += 1
        completion += got["usage"]["completion_tokens"]
        if reasons["stop"]:
            break
    assert reasons["stop"] == 1, "no seed in 0..63 makes the tiny model end its reply with the end token"

    body = {"prompt": "Hello", "stream": True, "max_tokens": LONG, "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base}/v1/completions", json=body) as response:
        lines = response.iter_lines()  # held open: leaving the loop must not close the connection yet
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["token_ids"]:
                break  # a token arrived: the request has its time to first token
        running, _ = scrape(base)
        assert value(running, "requests_running") == 1 and value(running, "kv_cache_usage_ratio") > 0
    deadline = time.monotonic() + 30
    while finished(scrape(base)[0])["cancelled"] == finished(before)["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = quiet(base)

    ended = reasons["stop"] + reasons["length"] + 1
    assert {reason: count - finished(before)[reason] for reason, count in finished(after).items()} == \
        {"stop": reasons["stop"], "length": reasons["length"], "cancelled": 1, "error": 0}
    assert moved(after, before, "e2e_request_latency_seconds_count") == ended
    assert moved(after, before, "time_to_first_token_seconds_count") == ended
    generated = moved(after, before, "generation_tokens_total")
    assert generated == ended + moved(after, before, "inter_token_latency_seconds_count")
    assert completion < generated < completion + LONG  # the cancelled reply's tokens: at least one, not all
