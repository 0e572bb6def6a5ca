"""A real `tensorfold serve` process for a family's tests: started on a free loopback port, waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

from tensorfold.ports import free_port

LOG_TAIL = 4000


def healthy(url: str) -> bool:
    """The server at `url` answers /health with 200 now."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def serving(args: list[str], log: Path, env: Mapping[str, str] | None = None,
            timeout_s: float = 120.0) -> Iterator[str]:
    """Run `tensorfold serve ARGS --port P`, yield its base URL once /health answers, stop it afterwards.

    The server's output goes to `log`; a server that exits or does not answer in time raises with its log's tail.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("a") as out:
        process = subprocess.Popen([sys.executable, "-m", "tensorfold", "serve", *args, "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + timeout_s
        while not healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensorfold serve did not come up (exit {process.poll()}):\n{tail(log)}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def tail(log: Path) -> str:
    """The end of a log file."""
    return log.read_text(errors="replace")[-LOG_TAIL:] if log.exists() else "(no log)"
