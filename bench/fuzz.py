"""A long fuzz campaign (the CI test's generator, many more cases): a line per failing case with its reproducer,
and a summary with failures by kind, engine deaths and the server's RSS before and after.

    python bench/fuzz.py --cases 4000 --seed 1                  # a tiny `example` checkpoint, its own server
    python bench/fuzz.py --url http://127.0.0.1:8080 --pid 1234 --cases 500

With its own server, an engine that stops answering is noted and the server started again, and the campaign goes
on from the next case; with --url it stops there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from rss import rss_mib  # bench/rss.py: this script runs from bench/ on sys.path

from tensorfold.ports import free_port
from tensorfold.settings import default_request_bytes
from tensorfold.testing.fuzz import Fuzzer, Limits
from tensorfold.testing.fuzz_http import Outcome, greedy, health_problems, run_cases

VOCAB = 512  # the tiny tokenizer's ids


def emit(line: str, **fields: Any) -> None:
    """One JSON line."""
    print(json.dumps({"bench": "fuzz", "line": line, **fields}), flush=True)


@contextlib.contextmanager
def server(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[str, int]]:
    """`tensorfold serve` on the checkpoint (made tiny when none is given); yields its URL and pid."""
    model = Path(args.model) if args.model else workdir / "tiny"
    if not model.exists():
        subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", args.family, str(model)],
                       check=True, capture_output=True)
    port = free_port()
    command = [sys.executable, "-m", "tensorfold", "serve", "--family", args.family, "--model", str(model),
               "--port", str(port), "--context", str(args.context), "--log-level", "warning",
               *shlex.split(args.serve_args)]
    with (workdir / "server.log").open("a") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the server exited with {process.returncode}; see {workdir / 'server.log'}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.3)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def campaign(url: str, pid: int | None, cases: Iterator, args: argparse.Namespace) -> tuple[list[Outcome], bool]:
    """Send cases until they run out or the engine stops answering; a line per failure; True when it stopped."""
    rss_before = rss_mib(pid) if pid else None
    with httpx.Client() as client:
        before = greedy(client, url)
    outcomes = run_cases(url, cases, workers=args.workers, timeout_s=args.timeout_s)
    for outcome in outcomes:
        if outcome.problem is not None:
            emit("failure", index=outcome.case.index, kind=outcome.case.kind, path=outcome.case.path,
                 status=outcome.status, problem=outcome.problem[:300], reproducer=outcome.case.reproducer())
    died = any((outcome.problem or "").startswith("the engine stopped answering") for outcome in outcomes)
    health = [] if died else health_problems(url, before)
    emit("server", cases=len(outcomes), died=died, health_problems=health, rss_before_mib=rss_before,
         rss_after_mib=rss_mib(pid) if pid else None)
    return outcomes, died


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS")
    parser.add_argument("--cases", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--family", default="example")
    parser.add_argument("--model", help="default: a tiny checkpoint of --family, made here")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--serve-args", default="", help="more `tensorfold serve` arguments, as one string")
    args = parser.parse_args()
    limits = Limits(context=args.context, max_body=default_request_bytes(args.context), vocab=args.vocab)
    cases = Fuzzer(args.seed, limits).cases(args.cases)
    outcomes: list[Outcome] = []
    deaths = 0
    if args.url:
        found, died = campaign(args.url, args.pid, cases, args)
        outcomes, deaths = found, int(died)
    else:
        with tempfile.TemporaryDirectory(prefix="fuzz-") as scratch:
            while len(outcomes) < args.cases:
                with server(args, Path(scratch)) as (url, pid):
                    found, died = campaign(url, pid, cases, args)
                outcomes += found
                deaths += died
                if not found:
                    break
    failed = [outcome for outcome in outcomes if outcome.problem is not None]
    emit("summary", cases=len({outcome.case.index for outcome in outcomes}), seed=args.seed, failed=len(failed),
         server_errors_5xx=sum(1 for outcome in failed if (outcome.status or 0) >= 500), engine_deaths=deaths,
         failed_by_kind=dict(collections.Counter(outcome.case.kind for outcome in failed)),
         statuses=dict(sorted(collections.Counter(str(outcome.status) for outcome in outcomes).items())))


if __name__ == "__main__":
    main()
