"""What `serve` checks before it loads anything: the log level, the address and port, the model directory. Each
problem is one sentence; `serve` reports them together and exits with status 2, before the weights load."""

from __future__ import annotations

import errno
import re
import socket
from pathlib import Path

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # what a hub model id looks like: owner/name


def log_level_problem(level: str) -> str | None:
    """A --log-level logging cannot take."""
    if level.lower() in LOG_LEVELS:
        return None
    return f"--log-level {level!r} is not one of {', '.join(LOG_LEVELS)}"


def port_problem(host: str, port: int) -> str | None:
    """A port outside 1..65535, or one this host cannot bind now (in use, not allowed, an unknown address)."""
    if not 1 <= port <= 65535:
        return f"--port {port} is not a port: give one from 1 to 65535"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"--host {host!r} is not an address this machine can bind ({err.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use: stop what listens there or pick another --port"
            if err.errno == errno.EACCES:
                return f"port {port} on {host} needs privileges this process lacks: pick a port above 1023"
            return f"cannot listen on {host}:{port}: {err.strerror}"
    return None


def model_problem(model: Path | None) -> str | None:
    """A --model that is not a local checkpoint directory; a hub id gets the download it needs first."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        return None if (path / "config.json").is_file() else \
            f"--model {model} has no config.json: give an HF-format checkpoint directory"
    if path.exists():
        return f"--model {model} is a file: give an HF-format checkpoint directory"
    if HUB_ID.match(str(model)) and not str(model).startswith("."):
        return (f"--model {model} is not a local directory; TensorFold serves local checkpoint directories only: "
                f"download it first (huggingface-cli download {model} --local-dir DIR) and serve DIR")
    return f"--model {model} does not exist"


def serve_problems(host: str, port: int, log_level: str, model: Path | None) -> list[str]:
    """Every problem `serve` can see before loading, in flag order."""
    found = [model_problem(model), port_problem(host, port), log_level_problem(log_level)]
    return [problem for problem in found if problem is not None]
