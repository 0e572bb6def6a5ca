"""A free loopback port chosen below the kernel's ephemeral range, so nothing that binds port 0 can take it.

A port found free by binding port 0 comes from the ephemeral range, and so does every port the kernel hands out on
its own afterwards: an outgoing connection's, or gloo's listening pairs when a tensor-parallel world forms. Between
the moment the port is found and the moment its server binds it (a model loads in between), any of those can take it.
A port below that range is handed out only by name, so only another caller naming the same port can race for it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000          # below this lie well-known and commonly configured services' ports
TRIES = 64
_chooser = random.SystemRandom()   # never the seeded module-level generator: test plugins reseed it alike everywhere
_handed: set[int] = set()


def ephemeral_low(path: Path = EPHEMERAL_RANGE) -> int | None:
    """The lowest port the kernel hands out on its own, or None where the system does not say."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on `host:port` now and it may be bound."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", below: int | None = None) -> int:
    """A port free on `host` now, below the ephemeral range and not handed out before by this process; a port the
    kernel picks where no such range is known or none of the tries is free (`below`: the range's start, read
    from the system when not given)."""
    top = ephemeral_low() if below is None else below
    if top is not None and top > LOWEST + TRIES:
        for _ in range(TRIES):
            port = _chooser.randrange(LOWEST, top)
            if port not in _handed and bindable(port, host):
                _handed.add(port)
                return port
    for _ in range(TRIES):
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _handed:
            break
    _handed.add(port)
    return port
