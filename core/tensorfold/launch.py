"""Running the HTTP server around a booted engine, and stopping both cleanly."""

from __future__ import annotations

import logging

import uvicorn

from tensorfold.boot import Loaded

log = logging.getLogger(__name__)


def run_server(loaded: Loaded, log_level: str = "info") -> None:
    """Start the engine thread, serve HTTP until SIGINT/SIGTERM, then stop the engine."""
    from tensorfold.server import build_app

    settings = loaded.settings
    app = build_app(loaded.service)
    loaded.engine.start()
    log.info("serving %s on http://%s:%d/v1", loaded.service.model_name, settings.host, settings.port)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level.lower(), access_log=False)
    finally:
        loaded.engine.close()
