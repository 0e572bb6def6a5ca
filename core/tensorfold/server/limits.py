"""The HTTP server's own limits (uvicorn's options): connections, the request head's size, and how long a client
may take to send it (server/protocol.py). The body's size and time are the app's (server/guard.py, bodies.py)."""

from __future__ import annotations

from typing import Any

from tensorfold.server.protocol import HEAD_BYTES, guarded_protocol
from tensorfold.settings import Settings


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Options for uvicorn.Config from the settings: always the h11 protocol, whatever else is installed."""
    return {"limit_concurrency": settings.max_connections, "http": guarded_protocol(settings.header_timeout_s),
            "h11_max_incomplete_event_size": HEAD_BYTES}
