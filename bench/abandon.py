"""How soon the engine is free after a client abandons a long request: streamed (closed after the first chunk) and
waiting (a non-streamed request whose client times out).

tests/server/test_server_e2e.py asserts what is exact (the request is cancelled, leases and slots come back, the
next request is served in full); the seconds are measured here. Per repeat and shape, one JSON line: `idle_s`
from the client leaving to /memory showing nothing running or waiting, and `next_s`, the wall time of a 4-token
completion sent right after.

    python bench/abandon.py --url http://127.0.0.1:8080
    python bench/abandon.py --serve "--family example" --repeats 5
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

import httpx

from tensorfold.testing.process import serving

SHAPES = ("streamed", "waiting")
CLIENT_WAIT_S = 0.5  # the waiting shape's client gives up after this


@contextlib.contextmanager
def server(url: str | None, serve: str | None) -> Iterator[str]:
    """The server at --url, or `tensorfold serve` started with --serve's arguments."""
    if url is not None:
        yield url.rstrip("/")
        return
    log = Path(tempfile.mkdtemp(prefix="abandon-")) / "server.log"
    with serving(shlex.split(serve or ""), log) as base:
        yield base


def abandon(http: httpx.Client, url: str, model: str, max_tokens: int, shape: str) -> None:
    """Send a long request and leave it: after its first chunk (streamed) or on a client timeout (waiting)."""
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    if shape == "streamed":
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as reply:
            next(reply.iter_lines())
        return
    with contextlib.suppress(httpx.ReadTimeout):
        http.post(url + "/v1/completions", json=body, timeout=CLIENT_WAIT_S)


def idle_after(http: httpx.Client, url: str, began: float, limit_s: float = 600.0) -> float:
    """Seconds from `began` until nothing runs or waits."""
    while time.perf_counter() - began < limit_s:
        now = http.get(url + "/memory").json()["now"]
        if now["running"] == now["waiting"] == 0:
            break
        time.sleep(0.005)
    return time.perf_counter() - began


def measure(http: httpx.Client, url: str, shape: str) -> dict[str, object]:
    """One abandoned request, then one short one."""
    model = http.get(url + "/v1/models").json()["data"][0]
    abandon(http, url, model["id"], model["max_model_len"] - 8, shape)
    idle_s = idle_after(http, url, time.perf_counter())
    began = time.perf_counter()
    after = http.post(url + "/v1/completions", json={"model": model["id"], "prompt": "Hi", "max_tokens": 4,
                                                     "ignore_eos": True})
    return {"bench": "abandon", "shape": shape, "idle_s": round(idle_s, 4),
            "next_s": round(time.perf_counter() - began, 4), "next_status": after.status_code}


def main() -> int:
    """Each shape `--repeats` times, one JSON line each."""
    top = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    top.add_argument("--url", help="base URL of a running server")
    top.add_argument("--serve", help='start `tensorfold serve` with these arguments, e.g. "--family example"')
    top.add_argument("--repeats", type=int, default=3)
    args = top.parse_args()
    if (args.url is None) == (args.serve is None):
        raise SystemExit("give exactly one of --url and --serve")
    with server(args.url, args.serve) as url, httpx.Client(timeout=120) as http:
        for _ in range(args.repeats):
            for shape in SHAPES:
                print(json.dumps(measure(http, url, shape)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
