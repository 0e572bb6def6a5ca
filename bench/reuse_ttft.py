"""The reuse gate's TTFT ratio, measured: resumed turns against the same requests on a cache-off server.

CI (tests/tools/test_reuse_gate.py) asserts only the gate's exact checks; how much sooner a resumed turn's first
token comes is a timing, so it is measured here. This runs tools/reuse_gate.py end to end (record against a
cache-on server it starts, replay to a cache-off one, compare) and prints one JSON line per scenario and one for
the run: requests, resumes, cached and prefilled rows on both servers, and the median TTFT resumed / fresh.

    python bench/reuse_ttft.py --serve "--family qwen --context 4096"
    python bench/reuse_ttft.py --serve "--family qwen --model DIR" --ttft-ratio 0.8   # a release check

--cached "ARGS" are the cache-on server's extra flags (small tiers by default, so the eviction scenario is quick);
--ttft-ratio MAX also makes the gate fail (exit status 1) above MAX: for a release check on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GATE = Path(__file__).resolve().parents[1] / "tools" / "reuse_gate.py"
SMALL_TIERS = "--prompt-cache-gib 0.002 --host-cache-gib 0.004"


def gate(*args: str | Path) -> None:
    """Run one gate command; stop with its output when it fails to run (compare's verdict is read from JSON)."""
    done = subprocess.run([sys.executable, str(GATE), *map(str, args)], capture_output=True, text=True, check=False)
    if done.returncode != 0 and args[0] != "compare":
        raise SystemExit(f"reuse_gate.py {args[0]} failed:\n{done.stdout}{done.stderr}")


def lines(verdict: dict[str, Any], serve: str) -> list[dict[str, Any]]:
    """One JSON line per scenario, then the run's."""
    out = [{"bench": "reuse_ttft", "serve": serve, "scenario": name, **numbers}
           for name, numbers in verdict["scenarios"].items()]
    out.append({"bench": "reuse_ttft", "serve": serve, "scenario": None, "passed": verdict["passed"],
                "failures": verdict["failures"], "reused": verdict["reused"],
                "ttft_ratio": None if verdict["ttft_ratio"] is None else round(verdict["ttft_ratio"], 3),
                "ttft_limit": verdict["ttft_limit"]})
    return out


def main() -> int:
    """Record, replay, compare; print the lines; exit 1 when the gate failed."""
    top = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    top.add_argument("--serve", required=True, help='`tensorfold serve` arguments for both servers')
    top.add_argument("--cached", default=SMALL_TIERS, help="the cache-on server's extra flags")
    top.add_argument("--prefill-chunk", default="512")
    top.add_argument("--min-chunk", default="32")
    top.add_argument("--scale", default="1.0", help="multiplies every message's length")
    top.add_argument("--ttft-ratio", type=float, help="fail above this median TTFT resumed / fresh")
    top.add_argument("--out", type=Path, help="keep the gate's files here (default: a temporary folder)")
    args = top.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="reuse-ttft-"))
    out.mkdir(parents=True, exist_ok=True)
    grid = ["--prefill-chunk", args.prefill_chunk, "--min-chunk", args.min_chunk]
    gate("record", "--serve", f"{args.serve} {args.cached}", "--out", out / "recorded.json", "--log",
         out / "cached.log", "--scale", args.scale, *grid)
    gate("replay", out / "recorded.json", "--serve", args.serve, "--out", out / "replay.json", "--log",
         out / "fresh.log")
    limit = [] if args.ttft_ratio is None else ["--ttft-ratio", str(args.ttft_ratio)]
    gate("compare", out / "recorded.json", out / "replay.json", "--json", out / "verdict.json", *limit)
    verdict = json.loads((out / "verdict.json").read_text())
    for line in lines(verdict, " ".join(shlex.split(args.serve))):
        print(json.dumps(line), flush=True)
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
