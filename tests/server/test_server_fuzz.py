"""A bounded fuzz through a real `tensorfold serve`: malformed, hostile and extreme requests on every JSON route
get a 4xx in OpenAI's envelope (never a 5xx), and the engine comes out of it answering exactly as before.

A server of its own (a fuzz that stops the engine must not take the shared e2e server down with it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tensorfold.settings import default_request_bytes
from tensorfold.testing.fuzz import Fuzzer, Limits
from tensorfold.testing.fuzz_http import greedy, health_problems, report, run_cases
from tensorfold.testing.process import serving

SEED = 13
CASES = 360
CONTEXT = 256
VOCAB = 512  # the tiny tokenizer's ids
WORKERS = 3  # clients at once: streams interleave in the engine, hang-ups land mid-step


@pytest.fixture(scope="module")
def fuzz_url(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of the tiny checkpoint with a small context, so that no fuzzed generation runs long."""
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with serving(["--family", "example", "--model", str(tiny_checkpoint), "--context", str(CONTEXT),
                  "--log-level", "warning"], log) as url:
        yield url


def test_fuzz_gets_no_5xx_and_leaves_the_engine_as_it_was(fuzz_url: str) -> None:
    with httpx.Client() as client:
        before = greedy(client, fuzz_url)
    assert before is not None and len(before) == 12
    limits = Limits(context=CONTEXT, max_body=default_request_bytes(CONTEXT), vocab=VOCAB)
    outcomes = run_cases(fuzz_url, Fuzzer(SEED, limits).cases(CASES), workers=WORKERS)
    health = health_problems(fuzz_url, before)
    failed = [outcome for outcome in outcomes if outcome.problem is not None]
    assert not failed and not health, (f"{len(failed)} of {len(outcomes)} fuzz cases failed (seed {SEED}):\n"
                                       + report(outcomes, health))
    assert len(outcomes) == CASES
    assert {outcome.case.kind for outcome in outcomes} == set(Fuzzer(SEED, limits).mutations)
