"""Closed-loop load over HTTP: N clients each send a streamed chat request, wait for it, and send the next.

Prints one JSON line per concurrency level: aggregate tokens/s, TTFT and inter-token latency p50/p99, the pool's use
seen on /memory during the run, and the server process's CPU time per completion token: all its threads, and its
main thread alone (uvicorn's event loop: HTTP, detokenization, SSE). Starts `tensorfold serve` (the embedded
default, or --model) unless --url points at a running server (then --pid gives its CPU figures).

    python bench/serve_load.py --family example --levels 1 4 16 32 --seconds 20
    python bench/serve_load.py --levels 16 --variant logprobs '{"logprobs": true, "top_logprobs": 5}' \
        --variant json '{"response_format": {"type": "json_object"}}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tensorfold.ports import free_port


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_request(client: httpx.AsyncClient, url: str, body: dict, stats: dict) -> None:
    sent = time.perf_counter()
    last = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                stats["tokens"] += chunk["usage"]["completion_tokens"]
            if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if last is None:
                stats["ttft"].append(now - sent)
            else:
                stats["itl"].append(now - last)
            last = now


async def client_loop(url: str, index: int, deadline: float, stats: dict, max_tokens: int, words: int,
                      extra: dict) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        turn = 0
        while time.perf_counter() < deadline:
            text = f"client {index} turn {turn}: " + " ".join(["the kept state resumes"] * words)
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": True,
                    "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
            await one_request(client, url, body, stats)
            stats["requests"] += 1
            turn += 1


async def watch_pool(url: str, deadline: float, seen: list[dict]) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while time.perf_counter() < deadline:
            seen.append((await client.get(f"{url}/memory")).json()["now"])
            await asyncio.sleep(0.5)


def cpu_seconds(pid: int | None) -> tuple[float, float]:
    """CPU seconds (user + system) so far of process `pid`, all threads, and of its main thread; (nan, nan) without
    a pid."""
    if pid is None:
        return float("nan"), float("nan")
    tick = os.sysconf("SC_CLK_TCK")

    def read(stat: str) -> float:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()  # after the command name: state is fields[0]
        return (int(fields[11]) + int(fields[12])) / tick          # utime, stime

    return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")


def per_token_ms(seconds: float, tokens: int) -> float | None:
    return round(1000 * seconds / tokens, 3) if tokens and seconds == seconds else None


async def level(url: str, clients: int, seconds: float, max_tokens: int, words: int, pid: int | None,
                variant: str = "plain", extra: dict | None = None) -> dict:
    stats = {"tokens": 0, "requests": 0, "ttft": [], "itl": []}
    pool: list[dict] = []
    cpu_before = cpu_seconds(pid)
    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(watch_pool(url, deadline, pool),
                         *(client_loop(url, i, deadline, stats, max_tokens, words, extra or {})
                           for i in range(clients)))
    elapsed = time.perf_counter() - start
    cpu_after = cpu_seconds(pid)
    server_cpu, loop_cpu = (after - before for after, before in zip(cpu_after, cpu_before, strict=True))
    leased = [p.get("leased", 0) / max(p.get("pages", 1), 1) for p in pool]
    return {"bench": "serve_load", "variant": variant, "clients": clients, "seconds": round(elapsed, 2),
            "requests": stats["requests"],
            "completion_tokens": stats["tokens"], "tok_per_s": round(stats["tokens"] / elapsed, 2),
            "ttft_p50_ms": round(1000 * percentile(stats["ttft"], 0.5), 1),
            "ttft_p99_ms": round(1000 * percentile(stats["ttft"], 0.99), 1),
            "itl_p50_ms": round(1000 * percentile(stats["itl"], 0.5), 2),
            "itl_p99_ms": round(1000 * percentile(stats["itl"], 0.99), 2),
            "pool_leased_mean": round(statistics.fmean(leased), 3) if leased else None,
            "running_max": max((p.get("running", 0) for p in pool), default=0),
            "server_cpu_ms_per_token": per_token_ms(server_cpu, stats["tokens"]),
            "loop_cpu_ms_per_token": per_token_ms(loop_cpu, stats["tokens"])}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "tensorfold", "serve", "--family", args.family, "--port", str(port),
               "--parallel", str(args.parallel), "--log-level", "warning"]
    if args.model:
        command += ["--model", args.model]
    proc = subprocess.Popen(command, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; without it one is started")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for the CPU figures")
    parser.add_argument("--family", default="example")
    parser.add_argument("--model")
    parser.add_argument("--parallel", default="32")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=40)
    parser.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "JSON"),
                        help="fields merged into every request body, run at each level after the plain requests "
                             "(repeatable): e.g. penalties '{\"frequency_penalty\": 0.5}'")
    args = parser.parse_args()
    variants = [("plain", {})] + [(name, json.loads(fields)) for name, fields in args.variant or []]
    proc, url = (None, args.url) if args.url else start_server(args)
    pid = proc.pid if proc is not None else args.pid
    try:
        for clients in args.levels:
            for name, extra in variants:
                result = level(url, clients, args.seconds, args.max_tokens, args.prompt_words, pid, name, extra)
                print(json.dumps(asyncio.run(result)), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
