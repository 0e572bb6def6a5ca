"""Resumed == fresh at TP=2 through real servers (issue 20): `tensorfold serve --tp 2` on a random checkpoint of
--shape (bench/serving.py writes it: HF's model with random weights, a word-level tokenizer whose words "t1", "t2",
… are the vocabulary's ids, ChatML), and the openai-compatible chat route, streamed with token ids.

Per tier in --tiers, a server of its own (NVLink multicast off in its environment, which its followers inherit):

    device   `--host-cache-gib 0`: the device tier alone
    host     `--prompt-cache-gib 0`: every state kept in host memory
    disk     `--learn-conversations --learn-dir D`: stopped with SIGTERM after the first turns (its ranks write
             their parts, rank k's under D/rank-<k>/), then a new server on D

Each of --conversations chats (a system message and a user message of --history words, each word one token) has
its first turn sent under a cache_salt of the tier's (its states are kept there). Its second turn (the first turn,
the reply as text, a new user message) is then sent twice: under another salt, where nothing is kept (fresh:
cached_tokens must be 0), and under the first turn's salt (resumed: the tier's hits must move and cached_tokens be
above 0). The two replies' greedy token ids (--tokens, ignore_eos) must be equal. One JSON line per measurement in
--out/tp_resume.jsonl:

    tp_resume_checkpoint  the checkpoint written (bytes, seconds) or reused
    tp_resume             per tier and chat: equal, the first divergence, prompt and cached tokens, the serving tier,
                          fresh and resumed TTFT (ms)
    tp_resume_kept        per tier: rank 0's kept states and bytes (/memory: its numbers are rank 0's part); disk:
                          every rank's kept bytes on disk (as `tensorfold learned ls` counts them), the
                          shutdown's written and dropped states
    tp_resume_all         every chat's tokens equal on every tier

    device (nvidia-h200-x2):  python bench/tp_resume.py --shape qwen3_5-9b --checkpoint /tmp/ckpt-9b --out $OUT
    CPU smoke:                python bench/tp_resume.py --device cpu --shape qwen3_5-tiny --dtype float32 \\
                                  --history 48 --tokens 4 --conversations 1 --out /tmp/tp-resume
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gpu  # bench/gpu.py: python puts the script's directory (bench/) first on sys.path
import serving
from tp_gpu import MULTICAST_OFF

from tensorfold import learned
from tensorfold.testing.process import serving as served
from tensorfold.testing.tiny_tokenizer import SPECIALS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from resume import shutdown  # noqa: E402  (bench/resume.py: the disk tier's closing line)

from gate.wire import Server, tier_delta  # noqa: E402

TIER_FLAGS = {"device": ["--host-cache-gib", "0"], "host": ["--prompt-cache-gib", "0"]}
TIERS = (*TIER_FLAGS, "disk")


def emit(out: Path | None, **record: object) -> None:
    """One line on stdout and in out/tp_resume.jsonl."""
    gpu.emit(out, jsonl="tp_resume.jsonl", **record)


def words(rng: random.Random, count: int, vocab: int) -> str:
    """`count` words of the generated tokenizer, one token each (ids 1 .. vocab - specials - 1)."""
    return " ".join(f"t{rng.randrange(1, vocab - len(SPECIALS))}" for _ in range(count))


def first_turn(index: int, history: int, vocab: int) -> list[dict[str, str]]:
    """Chat `index`'s first turn: a system message and a user message of `history` words in all."""
    rng = random.Random(index)
    return [{"role": "system", "content": words(rng, 16, vocab)},
            {"role": "user", "content": words(rng, max(1, history - 16), vocab)}]


def body(messages: list[dict[str, str]], tokens: int, salt: str) -> dict[str, Any]:
    """A greedy chat request of `tokens` tokens whose kept states live under `salt`."""
    return {"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "cache_salt": salt}


def divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """The first place two token lists differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def store_bytes(root: Path) -> dict[str, int]:
    """Every rank's kept bytes on disk under a --learn-dir, as `tensorfold learned ls` counts them (its identities'
    files; rank 0's in the directory, rank k's in `rank-<k>/`)."""
    sizes: dict[str, int] = {}
    for identity in learned.identities(root):
        rank = identity.rank_folder or "rank-0"
        sizes[rank] = sizes.get(rank, 0) + identity.nbytes
    return dict(sorted(sizes.items()))


def second_turns(server: Server, firsts: list[tuple[list[dict[str, str]], str]], tier: str, tokens: int,
                 vocab: int, out: Path | None) -> bool:
    """Every chat's second turn fresh, then resumed; a tp_resume line each; whether all were equal."""
    all_equal = True
    for index, (turn, reply_text) in enumerate(firsts):
        follow = [*turn, {"role": "assistant", "content": reply_text},
                  {"role": "user", "content": words(random.Random(1000 + index), 24, vocab)}]
        fresh = server.chat(body(follow, tokens, f"fresh-{tier}-{index}"))
        before = server.tiers()
        resumed = server.chat(body(follow, tokens, f"kept-{tier}-{index}"))
        moved = tier_delta(before, server.tiers())
        serving_tier = next((name for name, numbers in moved.items() if numbers.get("hits")), "none")
        place = divergence(fresh.token_ids, resumed.token_ids)
        ok = place is None and fresh.cached_tokens == 0 and resumed.cached_tokens > 0 and serving_tier == tier
        all_equal &= ok
        emit(out, bench="tp_resume", tier=tier, chat=index, equal=place is None, ok=ok, first_divergence=place,
             prompt_tokens=resumed.prompt_tokens, cached_tokens=resumed.cached_tokens,
             fresh_cached_tokens=fresh.cached_tokens, serving_tier=serving_tier,
             fresh_ttft_ms=round(fresh.ttft_s * 1e3, 3), resumed_ttft_ms=round(resumed.ttft_s * 1e3, 3),
             tokens=len(resumed.token_ids))
    return all_equal


def first_turns(server: Server, args: argparse.Namespace, tier: str, vocab: int
                ) -> list[tuple[list[dict[str, str]], str]]:
    """Every chat's first turn under the tier's kept salt: (its messages, the reply's text)."""
    firsts = []
    for index in range(args.conversations):
        turn = first_turn(index, args.history, vocab)
        reply = server.chat(body(turn, args.tokens, f"kept-{tier}-{index}"))
        firsts.append((turn, reply.text))
    return firsts


def kept_line(out: Path | None, server: Server, tier: str, **more: object) -> None:
    """The tier's kept states and bytes as rank 0 counts them (its part), with `more`."""
    numbers = server.tiers().get(tier, {})
    emit(out, bench="tp_resume_kept", tier=tier, rank0_states=numbers.get("states"),
         rank0_bytes=numbers.get("bytes"), **more)


def run_tier(args: argparse.Namespace, tier: str, checkpoint: Path, vocab: int, work: Path) -> bool:
    """One tier's servers, first turns, second turns; whether every chat's tokens were equal."""
    base = [str(checkpoint), "--tp", str(args.tp), "--context", str(args.context), "--parallel", "2",
            *args.serve_args.split()]
    env = dict(MULTICAST_OFF)
    log = work / f"{tier}.log"

    def started(flags: list[str]):
        return served([*base, *flags], log, env=env, timeout_s=args.start_timeout)

    if tier in TIER_FLAGS:
        with started(TIER_FLAGS[tier]) as url:
            server = Server(url)
            try:
                firsts = first_turns(server, args, tier, vocab)
                equal = second_turns(server, firsts, tier, args.tokens, vocab, args.out)
                kept_line(args.out, server, tier)
            finally:
                server.close()
        return equal
    root = work / "learned"
    flags = ["--learn-conversations", "--learn-dir", str(root), "--learn-min-free-gib", "0"]
    with started(flags) as url:
        server = Server(url)
        try:
            firsts = first_turns(server, args, tier, vocab)
            server.idle()
        finally:
            server.close()
    closed = shutdown(log)
    on_disk = store_bytes(root)
    with started(flags) as url:
        server = Server(url)
        try:
            equal = second_turns(server, firsts, tier, args.tokens, vocab, args.out)
            kept_line(args.out, server, tier, store_bytes=on_disk, **closed)
        finally:
            server.close()
    return equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(gpu.SHAPES))
    parser.add_argument("--checkpoint", type=Path, help="written here unless it holds a config.json already")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(serving.DTYPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tiers", nargs="+", default=list(TIERS), choices=TIERS)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--history", type=int, default=8192, help="words (tokens) in a chat's first turn")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens a reply")
    parser.add_argument("--context", type=int, default=0, help="serve --context (0: room for both turns)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--serve-args", default="", help="more `tensorfold serve` flags")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gpu.DEVICE = args.device
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    args.context = args.context or 2 * args.history + 4 * args.tokens + 256
    if args.device == "cpu":
        args.serve_args = f"--device cpu {args.serve_args}"
    with tempfile.TemporaryDirectory(prefix="tp-resume-") as scratch:
        work = Path(scratch)
        checkpoint = args.checkpoint or work / "checkpoint"
        if (checkpoint / "config.json").exists():
            emit(args.out, bench="tp_resume_checkpoint", shape=args.shape, reused=str(checkpoint))
        else:
            emit(args.out, bench="tp_resume_checkpoint", shape=args.shape,
                 **serving.write_checkpoint(args.shape, checkpoint, serving.DTYPES[args.dtype]))
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        results = {}
        for tier in args.tiers:
            began = time.perf_counter()
            results[tier] = run_tier(args, tier, checkpoint, vocab, work)
            emit(args.out, bench="tp_resume_tier", tier=tier, ok=results[tier],
                 seconds=round(time.perf_counter() - began, 1))
            if args.out:
                (args.out / f"{tier}.log").write_bytes((work / f"{tier}.log").read_bytes())
    emit(args.out, bench="tp_resume_all", shape=args.shape, tp=args.tp, ok=all(results.values()), tiers=results)
    if not all(results.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
