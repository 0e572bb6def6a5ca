"""Soak: N clients for T minutes against one server that keeps states on every tier (capped small, so they evict),
its resident memory sampled as it goes. The closing line says whether memory grows (the RSS slope after warm-up),
whether anything failed (5xx), and whether the pool is whole once the load stops (idle integrity).

    python bench/soak.py --clients 16 --minutes 20                 # starts its own server
    python bench/soak.py --url http://127.0.0.1:8080 --pid 1234 --clients 8 --minutes 5

One JSON line per measurement: `start`, one `rss` line per sample, `idle` (after the load, once nothing runs),
`summary`. Without --url the server is `tensorfold serve --learn-conversations` on a temporary --learn-dir with
small tier caps (or --launcher SCRIPT run with the same arguments, for a server under a probe).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rss import growth, rss_mib, status_kib  # bench/rss.py: this script runs from bench/ on sys.path
from soak_load import WORDS, Client, Tally  # bench/soak_load.py

from tensorfold.ports import free_port

START_TIMEOUT_S = 300.0
SHOWN_COUNTERS = ("prompt_cache_states", "host_cache_states", "disk_states", "disk_bytes", "prompt_cache_hits",
                  "prompt_cache_evicted", "host_cache_hits", "host_cache_evicted", "disk_hits", "disk_written",
                  "disk_evicted", "disk_dropped", "disk_write_failed", "disk_damaged")


def emit(line: str, **fields: Any) -> None:
    """One JSON line."""
    print(json.dumps({"bench": "soak", "line": line, **fields}), flush=True)


def serve_args(args: argparse.Namespace, learn_dir: Path, port: int) -> list[str]:
    """`tensorfold serve` arguments: kept states on the device, host and disk tiers, each capped small."""
    found = ["serve", "--family", args.family, "--port", str(port), "--context", str(args.context),
             "--parallel", str(args.parallel), "--prompt-cache-gib", str(args.prompt_cache_gib),
             "--host-cache-gib", str(args.host_cache_gib), "--learn-conversations", "--learn-dir", str(learn_dir),
             "--learn-gib", str(args.learn_gib), "--learn-min-free-gib", "0", "--log-level", "warning"]
    if args.model:
        found += ["--model", args.model]
    return found + shlex.split(args.serve_args)


def start_server(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    """Start the server, wait for /health; its output goes to workdir/server.log."""
    port = free_port()
    command = [sys.executable, args.launcher] if args.launcher else [sys.executable, "-m", "tensorfold"]
    command += serve_args(args, workdir / "learned", port)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(pair.split("=", 1) for pair in args.env)}
    log = workdir / "server.log"
    with log.open("a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                emit("start", url=url, pid=process.pid, command=shlex.join(command), log=str(log))
                return process, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server was not healthy within {START_TIMEOUT_S:.0f} s; see {log}")


async def memory_now(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """/memory's `now`, or {} when it does not answer."""
    try:
        return (await http.get(url + "/memory", timeout=30)).json()["now"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


def sample(pid: int | None, started: float, now: dict[str, Any], tally: Tally) -> dict[str, Any]:
    """One RSS sample's fields."""
    hwm = status_kib(pid, "VmHWM") if pid else None
    return {"t_min": round((time.monotonic() - started) / 60, 2), "rss_mib": rss_mib(pid) if pid else None,
            "hwm_mib": None if hwm is None else round(hwm / 1024, 1), "requests": tally.requests,
            "server_errors_5xx": tally.server_errors, "running": now.get("running"), "waiting": now.get("waiting"),
            "kept_states": {tier: now.get(f"{tier}_states") for tier in ("prompt_cache", "host_cache", "disk")}}


async def watch(url: str, pid: int | None, every_s: float, stop: asyncio.Event, started: float, tally: Tally,
                samples: list[tuple[float, float]]) -> None:
    """An `rss` line every `every_s` seconds (the first at once) until the load stops."""
    async with httpx.AsyncClient() as http:
        while True:
            fields = sample(pid, started, await memory_now(http, url), tally)
            emit("rss", **fields)
            if fields["rss_mib"] is not None:
                samples.append((fields["t_min"], fields["rss_mib"]))
            try:
                await asyncio.wait_for(stop.wait(), every_s)
                return
            except TimeoutError:
                pass


async def settle(url: str, wait_s: float) -> dict[str, Any]:
    """/memory's `now` once nothing runs or waits (the idle check has run then), or when `wait_s` is up."""
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient() as http:
        while True:
            now = await memory_now(http, url)
            if (now.get("running") == 0 and now.get("waiting") == 0) or time.monotonic() > deadline:
                await asyncio.sleep(1.0)  # the engine checks integrity when its loop goes idle
                return await memory_now(http, url)
            await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    """Run the clients for the minutes asked, sampling RSS; return the summary's fields."""
    async with httpx.AsyncClient() as http:
        ids = (await http.post(url + "/tokenize", json={"prompt": " ".join(WORDS)})).json()["tokens"]
    tally = Tally()
    stop = asyncio.Event()
    started = time.monotonic()
    samples: list[tuple[float, float]] = []
    watcher = asyncio.create_task(watch(url, pid, args.sample_s, stop, started, tally, samples))
    clients = [asyncio.create_task(Client(i, url, args.context, ids, tally, args.seed).run(stop))
               for i in range(args.clients)]
    await asyncio.sleep(args.minutes * 60)
    stop.set()
    for task in clients:  # whatever is in flight is hung up on: the server must clean up after that too
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    await watcher
    loaded_s = time.monotonic() - started
    now = await settle(url, args.idle_wait_s)
    idle = sample(pid, started, now, tally)
    emit("idle", **idle, integrity_when_idle=now.get("integrity_when_idle"))
    return {"clients": args.clients, "minutes": round(loaded_s / 60, 2), "warmup_minutes": args.warmup_minutes,
            **growth(samples, args.warmup_minutes), "rss_first_mib": samples[0][1] if samples else None,
            "rss_last_loaded_mib": samples[-1][1] if samples else None, "rss_idle_mib": idle["rss_mib"],
            "rss_peak_mib": idle["hwm_mib"], **tally.summary(),
            "idle_running": now.get("running"), "idle_waiting": now.get("waiting"),
            "integrity_when_idle": now.get("integrity_when_idle"),
            "counters": {name: now.get(name) for name in SHOWN_COUNTERS}}


def stop_server(process: subprocess.Popen) -> int | None:
    """SIGTERM (the disk tier writes what RAM kept), then the exit status."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the server this script starts (and of bench/rss_bodies.py's)."""
    parser.add_argument("--family", default="example")
    parser.add_argument("--model", help="a checkpoint directory (default: the family's embedded one)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--parallel", default="8")
    parser.add_argument("--prompt-cache-gib", type=float, default=0.002)
    parser.add_argument("--host-cache-gib", type=float, default=0.004)
    parser.add_argument("--learn-gib", type=float, default=0.02)
    parser.add_argument("--serve-args", default="", help="more `tensorfold serve` arguments, as one string")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for the server (repeat)")
    parser.add_argument("--launcher", help="a Python script run instead of `-m tensorfold`, with the same arguments")
    parser.add_argument("--workdir", help="where the learn dir and server.log go (default: a temporary folder)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (give --pid to sample its RSS); without it one is started")
    parser.add_argument("--pid", type=int, help="the process whose RSS is sampled, with --url")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between RSS samples")
    parser.add_argument("--warmup-minutes", type=float, default=5.0, help="samples before this are not in the slope")
    parser.add_argument("--idle-wait-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    add_server_args(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.url:
        emit("start", url=args.url, pid=args.pid)
        summary = asyncio.run(soak(args, args.url, args.pid))
        emit("summary", **summary)
        return
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        process, url, log = start_server(args, workdir)
        try:
            summary = asyncio.run(soak(args, url, process.pid))
        finally:
            exit_status = stop_server(process)
        text = log.read_text(errors="replace")
        emit("summary", **summary, server_exit=exit_status, server_log_tracebacks=text.count("Traceback"),
             server_log=str(log) if args.workdir else None)


if __name__ == "__main__":
    main()
