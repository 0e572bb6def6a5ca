"""The HTTP server's own limits (uvicorn's options): connections, and how long a client may take."""

from __future__ import annotations

from typing import Any

from tensorfold.settings import Settings


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Options for uvicorn.Config from the settings."""
    return {"limit_concurrency": settings.max_connections}
