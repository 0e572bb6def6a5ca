"""TTFT of a conversation's next turn: prefilled from the start (cold) vs resumed from a kept state.

For each history length L and repeat: a conversation whose rendered history is about L tokens is sent once (its
states are kept), then its next turn (history + reply + a new user message) is timed to the first token: that
is the resumed measurement, and /metrics says which tier served it. The same next turn with its system message
changed at its first word (so no kept state is a prefix of it) is the cold measurement.
Prints one JSON line per measurement, then one summary line per server and length (medians and their ratio).

    python bench/resume.py --url http://127.0.0.1:8080 --lengths 512 2048
    python bench/resume.py --tiny qwen --lengths 512 2048 8192 --repeats 5

--serve ARGS / --tiny FAMILY start the servers here, under TF_KV_POISON=1, twice: once with the device tier
alone (`--host-cache-gib 0`), once with the host tier alone (`--prompt-cache-gib 0`: every state is kept in host
memory), so both tiers' resumes are measured. --tiny serves the family's random tiny checkpoint with its
max_position_embeddings raised to the context (the tiny default stops at 4096; random weights do not mind).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from gate.scenarios import text  # noqa: E402
from gate.wire import Server, tier_delta  # noqa: E402

MESSAGE_WORDS = 40
NEW_WORDS = 24
CONFIGS = {"device": ["--host-cache-gib", "0"], "host": ["--prompt-cache-gib", "0"]}


def history(server: Server, tag: str, tokens: int) -> list[dict[str, str]]:
    """System, then user/assistant pairs, then a user message: about `tokens` tokens rendered, all text new."""
    messages = [{"role": "system", "content": text(f"{tag} system", MESSAGE_WORDS, 1.0)}]
    pair = 0
    while True:
        messages.append({"role": "user", "content": text(f"{tag} user {pair}", MESSAGE_WORDS, 1.0)})
        if len(server.tokenize(messages, generation_prompt=True)) >= tokens:
            return messages
        messages.append({"role": "assistant", "content": text(f"{tag} reply {pair}", MESSAGE_WORDS, 1.0)})
        pair += 1


def body(server: Server, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A greedy request."""
    return {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0}


def next_turn(server: Server, tag: str, tokens: int) -> tuple[list[dict[str, str]], int]:
    """A conversation of at least `tokens` history tokens, sent once so its states are kept; its next turn and
    the history's rendered length."""
    messages = history(server, tag, tokens)
    reply = server.chat(body(server, messages, 4))
    return [*messages, {"role": "assistant", "content": reply.text},
            {"role": "user", "content": text(f"{tag} next", NEW_WORDS, 1.0)}], reply.prompt_tokens


def timed(server: Server, messages: list[dict[str, str]]) -> tuple[dict[str, Any], str]:
    """TTFT of one request and the tier that served it ("none": prefilled from the start)."""
    before = server.tiers()
    reply = server.chat(body(server, messages, 1))
    moved = tier_delta(before, server.tiers())
    tier = next((name for name, numbers in moved.items() if numbers.get("hits")), "none")
    return {"prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens,
            "ttft_ms": round(reply.ttft_s * 1000, 3)}, tier


def measure(server: Server, name: str, lengths: list[int], repeats: int) -> None:
    """Cold and resumed next turns at every length; JSON lines on stdout."""
    timed(server, next_turn(server, f"{name} warm-up", 256)[0])
    for length in lengths:
        cold, resumed = [], []
        for repeat in range(repeats):
            turn, rendered = next_turn(server, f"{name} {length} {repeat}", length)
            fresh = [{"role": "system", "content": "Cold. " + turn[0]["content"]}, *turn[1:]]
            for kind, messages in (("cold", fresh), ("resumed", turn)):
                numbers, tier = timed(server, messages)
                (cold if kind == "cold" else resumed).append(numbers["ttft_ms"])
                print(json.dumps({"server": name, "history": length, "history_tokens": rendered, "kind": kind,
                                  "tier": tier, "repeat": repeat, **numbers}), flush=True)
        print(json.dumps({"server": name, "history": length, "summary": True,
                          "cold_ttft_ms": statistics.median(cold), "resumed_ttft_ms": statistics.median(resumed),
                          "resumed_over_cold": round(statistics.median(resumed) / statistics.median(cold), 4)}),
              flush=True)


def tiny_checkpoint(family: str, context: int, directory: Path) -> Path:
    """The family's tiny random checkpoint, its positions raised to `context`."""
    subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", family, str(directory)],
                   check=True, capture_output=True)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = max(context, config.get("max_position_embeddings", 0))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@contextlib.contextmanager
def started(args: list[str], log: Path) -> Iterator[Server]:
    """`tensorfold serve ARGS` under TF_KV_POISON=1, for the block."""
    from tensorfold.testing.process import serving

    with serving(args, log, env={"TF_KV_POISON": "1"}) as url:
        server = Server(url)
        try:
            yield server
        finally:
            server.close()


def main() -> None:
    """Parse, start or reach the servers, measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (its tiers are what they are)")
    parser.add_argument("--serve", help='start `tensorfold serve ARGS` per tier, e.g. "--family qwen"')
    parser.add_argument("--tiny", metavar="FAMILY", help="serve FAMILY's tiny checkpoint with a long enough context")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 3584], help="history tokens")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per length and kind")
    args = parser.parse_args()
    if sum(x is not None for x in (args.url, args.serve, args.tiny)) != 1:
        raise SystemExit("give one of --url, --serve and --tiny")
    if args.url is not None:
        server = Server(args.url)
        measure(server, args.url, args.lengths, args.repeats)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    context = max(args.lengths) + 1024
    base = shlex.split(args.serve) if args.serve else ["--family", args.tiny, "--model",
                                                       str(tiny_checkpoint(args.tiny, context, work / "tiny"))]
    if "--context" not in base:
        base += ["--context", str(context)]
    for name, flags in CONFIGS.items():
        with started([*base, *flags], work / f"{name}.log") as server:
            measure(server, name, args.lengths, args.repeats)


if __name__ == "__main__":
    main()
