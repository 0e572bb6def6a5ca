"""The soak's arithmetic and bookkeeping: the RSS slope after warm-up, /proc reads, the clients' tally."""

from __future__ import annotations

import os

from rss import growth, rss_mib, slope, status_kib
from soak_load import Tally


def test_slope_is_the_least_squares_fit() -> None:
    assert slope([(0, 10.0), (1, 12.0), (2, 14.0)]) == 2.0
    assert slope([(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)]) == 0.2
    assert slope([(5, 1.0), (5, 2.0)]) is None
    assert slope([]) is None


def test_growth_leaves_out_the_warm_up() -> None:
    samples = [(0.0, 100.0), (1.0, 200.0), (2.0, 300.0), (3.0, 301.0), (4.0, 302.0), (5.0, 303.0)]
    assert growth(samples, warmup=3.0) == {"rss_slope_mib_per_min": 1.0, "slope_samples": 3}
    assert growth(samples, warmup=0.0)["slope_samples"] == 6
    assert growth(samples, warmup=5.0) == {"rss_slope_mib_per_min": None, "slope_samples": 1}


def test_proc_reads_of_this_process() -> None:
    assert status_kib(os.getpid(), "VmRSS") > 0
    assert rss_mib(os.getpid()) > 1.0
    assert status_kib(os.getpid(), "NoSuchField") is None
    assert rss_mib(2**22 + 1) is None  # past pid_max's largest value: no such process


def test_tally_counts_5xx_error_events_and_resumes() -> None:
    tally = Tally()
    usage = {"completion_tokens": 4, "prompt_tokens": 30, "prompt_tokens_details": {"cached_tokens": 16}}
    tally.answered("turn", 200, {"usage": usage})
    tally.answered("turn", 200, {"usage": {**usage, "prompt_tokens_details": {"cached_tokens": 0}}})
    tally.answered("completion", 503, {"error": {"message": "busy"}})
    tally.server_error("hang_up error event: data: {...}")
    summary = tally.summary()
    assert summary["requests"] == 3 and summary["server_errors_5xx"] == 2
    assert summary["completion_tokens"] == 8 and summary["resumed_answers"] == 1 and summary["cached_tokens"] == 16
    assert summary["statuses"] == {"completion 503": 1, "turn 200": 2}
    assert len(summary["error_examples"]) == 2
