"""What the HTTP front door enforces, read from the settings once: keys, hosts, body size and time, parse slots."""

from __future__ import annotations

import hashlib
import os

import attrs

from tensorfold.server.access import is_loopback
from tensorfold.settings import DEFAULT_BODY_TIMEOUT_S, DEFAULT_CONTEXT, Settings, default_request_bytes


def parse_slots() -> int:
    """Request bodies parsed, rendered and tokenized at once: one per CPU this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity on this platform
        return max(1, os.cpu_count() or 1)


def key_digest(key: str) -> bytes:
    """What keys are compared as: equal-length digests, so the comparison's time tells nothing of a key's length."""
    return hashlib.sha256(key.encode()).digest()


@attrs.frozen
class FrontDoor:
    """The front door's settings; the default is an open door (no keys, any Host), as tests in-process use it."""

    request_bytes: int = default_request_bytes(DEFAULT_CONTEXT)
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, repr=False)
    metrics_open: bool = False
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    bound_loopback: bool = False  # served on a loopback address: Host names other than loopback need allowing
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    specials_in_content: bool = True
    parse_slots: int = attrs.field(factory=parse_slots)

    @classmethod
    def from_settings(cls, settings: Settings) -> FrontDoor:
        """The front door `tensorfold serve` runs with these settings."""
        return cls(request_bytes=settings.request_bytes, api_keys=settings.api_keys,
                   metrics_open=settings.metrics_open, allowed_hosts=settings.allowed_hosts,
                   bound_loopback=is_loopback(settings.host), body_timeout_s=settings.body_timeout_s,
                   specials_in_content=settings.special_tokens_in_content)

    @property
    def key_digests(self) -> tuple[bytes, ...]:
        """The keys as compared."""
        return tuple(key_digest(key) for key in self.api_keys)
