"""Running the HTTP server around a booted engine, and stopping both cleanly."""

from __future__ import annotations

import logging
import signal

import uvicorn

from tensorfold.boot import Loaded

log = logging.getLogger(__name__)


def run_server(loaded: Loaded, log_level: str = "info") -> None:
    """Start the engine thread, serve HTTP until SIGINT/SIGTERM, then stop the engine: with the disk tier on, the
    states still kept in RAM are written and its queue flushed within its bound before the process exits."""
    from tensorfold.server import build_app
    from tensorfold.server.limits import uvicorn_options

    settings = loaded.settings
    app = build_app(loaded.service)
    signal.signal(signal.SIGTERM, _terminated)
    loaded.engine.start()
    log.info("serving %s on http://%s:%d/v1", loaded.service.model_name, settings.host, settings.port)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level.lower(),
                            access_log=False, **uvicorn_options(settings))
    try:
        uvicorn.Server(config).run()
    finally:
        log.info("stopping: the engine%s", ", then the disk tier's writes" if loaded.engine.disk is not None else "")
        loaded.engine.close()
        log.info("stopped")


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM outside uvicorn's own handling (before it serves, or re-raised by it after its graceful shutdown):
    leave through `finally`, so the engine stops and the disk tier flushes, with the conventional status."""
    raise SystemExit(128 + signum)
