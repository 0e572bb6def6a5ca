"""Large bodies and RSS: the server's resident memory before and right after N requests of about --body-mib each
(a /tokenize prompt, a chat message, a completion prompt as token ids), once idle, and after malloc_trim(0) when the
server runs under bench/rss_probe.py (--launcher), so what glibc keeps can be told from what is still in use.

    python bench/rss_bodies.py --requests 64 --concurrency 8
    python bench/rss_bodies.py --env MALLOC_ARENA_MAX=2 --launcher bench/rss_probe.py --env TF_PROBE_OUT=p.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from rss import rss_mib  # bench/rss.py: this script runs from bench/ on sys.path
from soak import add_server_args, start_server, stop_server  # bench/soak.py

KINDS = ("tokenize", "chat", "completion_ids")


def body(kind: str, size: int) -> tuple[str, bytes]:
    """A request of about `size` bytes: the route and its JSON."""
    if kind == "tokenize":
        return "/tokenize", json.dumps({"prompt": ("kept state " * (size // 11))[:size]}).encode()
    if kind == "chat":
        text = ("the sea " * (size // 8))[:size]
        return "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text}],
                                                   "max_tokens": 4}).encode()
    return "/v1/completions", json.dumps({"prompt": [7] * (size // 3), "max_tokens": 4}).encode()


async def send_all(url: str, requests: int, concurrency: int, size: int) -> Counter:
    """Every request, `concurrency` at once; statuses by kind."""
    statuses: Counter = Counter()
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as http:
        async def one(index: int) -> None:
            kind = KINDS[index % len(KINDS)]
            path, content = body(kind, size)
            async with gate:
                reply = await http.post(url + path, content=content, headers={"content-type": "application/json"})
            statuses[f"{kind} {reply.status_code}"] += 1
        await asyncio.gather(*(one(i) for i in range(requests)))
    return statuses


def trimmed(pid: int, probe_out: Path | None) -> dict[str, Any]:
    """Ask the probe for malloc_trim(0) and read back what it logged (RSS before and after)."""
    if probe_out is None:
        return {}
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in probe_out.read_text().splitlines()]
        found = [line for line in lines if line.get("on_signal")]
        if found:
            return found[-1]
        time.sleep(0.5)
    return {"trim": "the probe did not answer"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--body-mib", type=float, default=0.9)
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds to wait before the idle sample")
    add_server_args(parser)
    args = parser.parse_args()
    probe = next((Path(pair.split("=", 1)[1]) for pair in args.env if pair.startswith("TF_PROBE_OUT=")), None)
    with tempfile.TemporaryDirectory(prefix="rss-bodies-") as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        process, url, _ = start_server(args, workdir)
        try:
            before = rss_mib(process.pid)
            statuses = asyncio.run(send_all(url, args.requests, args.concurrency, int(args.body_mib * (1 << 20))))
            after = rss_mib(process.pid)
            time.sleep(args.idle_s)
            idle = rss_mib(process.pid)
            trim = trimmed(process.pid, probe)
        finally:
            stop_server(process)
    print(json.dumps({"bench": "rss_bodies", "env": args.env, "requests": args.requests, "body_mib": args.body_mib,
                      "statuses": dict(statuses), "rss_before_mib": before, "rss_after_mib": after,
                      "rss_idle_mib": idle, "rss_after_trim_mib": trim.get("rss_after_trim_mib")}), flush=True)


if __name__ == "__main__":
    main()
