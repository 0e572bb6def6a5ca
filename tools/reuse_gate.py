"""The reuse gate: kept states must change nothing but the time to the first token.

    record   run multi-turn scenarios against a cache-on server; write every request, its reply (token ids,
             cached_tokens, TTFT) and the resume row the keep policy predicts for it
    replay   send the same requests to a cache-off server (--prompt-cache-gib 0 --host-cache-gib 0); write its
             replies
    compare  identical tokens, cached_tokens 0 when fresh and == the predicted row when cached, /metrics in step
             with usage (exact checks: tools/gate/checks.py lists each); the median TTFT resumed / fresh is
             reported, and checked only with --ttft-ratio MAX (a bench or release check on a quiet machine)

A server is either running (--url; start it with TF_KV_POISON=1 and the same --prefill-chunk/--min-chunk you
give here) or started by the gate (--serve "ARGS": `tensorfold serve ARGS` under TF_KV_POISON=1, with the
gate's grid flags added). docs/benchmarks.md shows a whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gate.checks import MIN_PROMPT, compare
from gate.policy import KeepModel
from gate.records import Run
from gate.runs import Recorder, replay, server_facts
from gate.scenarios import DROPS, SCENARIOS
from gate.wire import Server

GRID_FLAGS = ("--prefill-chunk", "--min-chunk")


def cache_off_flags() -> list[str]:
    """Flags that turn every tier of kept states off, for the serve command this checkout has."""
    from tensorfold.settings import Settings

    flags = ["--prompt-cache-gib", "0"]
    if "host_cache_gib" in {field.name for field in Settings.__attrs_attrs__}:
        flags += ["--host-cache-gib", "0"]
    return flags


@contextlib.contextmanager
def server_for(url: str | None, serve: str | None, grid: int, min_chunk: int, log: Path | None,
               extra: list[str] | None = None) -> Iterator[Server]:
    """The server at --url, or `tensorfold serve` started with --serve's arguments (poison on) and stopped."""
    if (url is None) == (serve is None):
        raise SystemExit("give exactly one of --url and --serve")
    if url is not None:
        server = Server(url)
        try:
            yield server
        finally:
            server.close()
        return
    from tensorfold.testing.process import serving

    args = shlex.split(serve)
    if any(flag in args for flag in GRID_FLAGS):
        raise SystemExit("give --prefill-chunk and --min-chunk to the gate, not inside --serve")
    args += ["--prefill-chunk", str(grid), "--min-chunk", str(min_chunk), *(extra or [])]
    log = log or Path(tempfile.mkdtemp(prefix="reuse-gate-")) / "server.log"
    with serving(args, log, env={"TF_KV_POISON": "1", "PYTHONUNBUFFERED": "1"}) as base:
        server = Server(base)
        try:
            yield server
        finally:
            server.close()


def record(args: argparse.Namespace) -> None:
    """`record`: the scenarios against a cache-on server."""
    names = args.scenario or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    with server_for(args.url, args.serve, args.prefill_chunk, args.min_chunk, args.log) as server:
        run = Run(meta={**server_facts(server), "grid": args.prefill_chunk, "min_chunk": args.min_chunk,
                        "seed": args.seed, "max_tokens": args.max_tokens, "scale": args.scale, "scenarios": names})
        recorder = Recorder(server, KeepModel(args.prefill_chunk, args.min_chunk), run, args.seed, args.max_tokens)
        for name in names:
            started = time.monotonic()
            with recorder.scenario_run(name, drops=name in DROPS):
                SCENARIOS[name](recorder, args.scale)
            print(f"recorded {name} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        run.integrity = server.idle()["integrity_when_idle"]
    run.write(args.out)


def replay_cmd(args: argparse.Namespace) -> None:
    """`replay`: the recorded requests against a cache-off server."""
    recorded = Run.read(args.record)
    grid, min_chunk = recorded.meta["grid"], recorded.meta["min_chunk"]
    with server_for(args.url, args.serve, grid, min_chunk, args.log, cache_off_flags()) as server:
        run = replay(recorded, server)
    run.meta |= {"grid": grid, "min_chunk": min_chunk}
    run.write(args.out)


def compare_cmd(args: argparse.Namespace) -> int:
    """`compare`: print the verdict; exit status 1 when the gate fails."""
    verdict = compare(Run.read(args.record), Run.read(args.replay), args.ttft_ratio, args.min_prompt,
                      args.allow_no_poison)
    for name, numbers in verdict.scenarios.items():
        print(f"{name:14} {numbers['requests']:3} requests, {numbers['resumed']:3} resumed, "
              f"{numbers['cached_tokens']:6} of {numbers['prompt_tokens']:6} prompt tokens cached, "
              f"{numbers['prefilled']:6} rows prefilled (fresh {numbers['prefilled_fresh']:6}), "
              f"TTFT resumed/fresh {numbers['ttft_ratio']}")
    ratio = "n/a" if verdict.ttft_ratio is None else f"{verdict.ttft_ratio:.3f}"
    limit = "measured, not checked" if args.ttft_ratio is None else f"checked: at most {args.ttft_ratio}"
    print(f"median TTFT resumed / fresh over {verdict.reused} resumed requests: {ratio} ({limit})")
    for failure in verdict.failures:
        print(f"FAIL {failure}")
    print("PASS" if verdict.passed else f"FAILED: {len(verdict.failures)} checks")
    if args.json is not None:
        args.json.write_text(json.dumps(verdict.as_json(), indent=1))
    return 0 if verdict.passed else 1


def parser() -> argparse.ArgumentParser:
    """The command line."""
    top = argparse.ArgumentParser(prog="reuse_gate.py", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)

    def server_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="base URL of a running server (started with TF_KV_POISON=1)")
        p.add_argument("--serve", help='start `tensorfold serve` with these arguments, e.g. "--family qwen"')
        p.add_argument("--log", type=Path, help="where a server started with --serve logs")
        p.add_argument("--out", type=Path, required=True, help="the JSON file to write")

    rec = commands.add_parser("record", help="run the scenarios against a cache-on server")
    server_options(rec)
    rec.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="run only these (repeatable)")
    rec.add_argument("--prefill-chunk", type=int, default=8192, help="the server's --prefill-chunk")
    rec.add_argument("--min-chunk", type=int, default=256, help="the server's --min-chunk")
    rec.add_argument("--seed", type=int, default=0, help="seed sent with every (greedy) request")
    rec.add_argument("--max-tokens", type=int, default=12, help="tokens per reply")
    rec.add_argument("--scale", type=float, default=1.0, help="multiplies every message's length")
    rep = commands.add_parser("replay", help="send a recording's requests to a cache-off server")
    rep.add_argument("record", type=Path)
    server_options(rep)
    cmp = commands.add_parser("compare", help="check a recording against its replay")
    cmp.add_argument("record", type=Path)
    cmp.add_argument("replay", type=Path)
    cmp.add_argument("--ttft-ratio", "--ttft-margin", dest="ttft_ratio", type=float, metavar="MAX",
                     help="also fail when median resumed TTFT is above MAX times the fresh one (a bench or release "
                          "check on a quiet machine, e.g. 0.8; without it the ratio is reported, not checked)")
    cmp.add_argument("--min-prompt", type=int, default=MIN_PROMPT,
                     help="prompts shorter than this count neither as reused nor for TTFT")
    cmp.add_argument("--allow-no-poison", action="store_true", help="accept servers run without TF_KV_POISON=1")
    cmp.add_argument("--json", type=Path, help="also write the verdict as JSON here")
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one command."""
    args = parser().parse_args(argv)
    if args.command == "record":
        record(args)
    elif args.command == "replay":
        replay_cmd(args)
    else:
        return compare_cmd(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
