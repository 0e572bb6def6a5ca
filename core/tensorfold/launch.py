"""Running the HTTP server around a booted engine, and stopping both cleanly; an engine that stops for good stops
the process, so that no socket stays open in front of a dead engine. While it serves, the heap freed after a
burst is handed back to the system (heap_trim.py).

    exit status  0 after SIGINT or SIGTERM (a clean stop); ENGINE_DEAD_STATUS when the engine stopped for good
                 (Engine.failure, engine/runner.py; a tensor-parallel follower gone is one): /health answers 503
                 with the reason for DEAD_GRACE_S, then the HTTP server shuts down and the process exits, for a
                 supervisor to restart it
    followers    at --tensor-parallel-size above 1, stopped after the engine (follow/spawn.py Ranks.close): told to
                 stop after a clean run, terminated after the engine's death; none outlives the process
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING

import uvicorn

from tensorfold.boot import Loaded
from tensorfold.heap_trim import start_heap_trimmer

if TYPE_CHECKING:
    from tensorfold.engine.runner import Engine

log = logging.getLogger(__name__)
ENGINE_DEAD_STATUS = 3
DEAD_GRACE_S = 2.0  # the requests the engine failed get their answers, and a balancer polling /health sees why


def run_server(loaded: Loaded, log_level: str = "info") -> None:
    """Start the engine thread, serve HTTP until SIGINT/SIGTERM or the engine's death, then stop the engine: with
    the disk tier on, the states still kept in RAM are written and its queue flushed within its bound before the
    process exits; after the engine's death, with SystemExit(ENGINE_DEAD_STATUS)."""
    from tensorfold.server import build_app
    from tensorfold.server.door import FrontDoor
    from tensorfold.server.limits import uvicorn_options

    settings = loaded.settings
    app = build_app(loaded.service, FrontDoor.from_settings(settings))
    stop_on_signals()
    loaded.engine.start()
    trimmer = start_heap_trimmer()
    log.info("serving %s on http://%s:%d/v1", loaded.service.model_name, settings.host, settings.port)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level.lower(),
                            access_log=False, **uvicorn_options(settings))
    server = uvicorn.Server(config)
    threading.Thread(target=_watch, args=(loaded.engine, server), name="tensorfold-engine-watch", daemon=True).start()
    try:
        server.run()
    finally:
        log.info("stopping: the engine%s%s", ", then the disk tier's writes" if loaded.engine.disk is not None else "",
                 ", then the tensor-parallel followers" if loaded.ranks is not None else "")
        loaded.engine.close()
        if loaded.ranks is not None:
            loaded.ranks.close(loaded.engine.failure)
        if trimmer is not None:
            trimmer.close()
        log.info("stopped")
    failure = loaded.engine.failure
    if failure is not None:
        log.critical("exiting with status %d for a supervisor to restart the server: the engine stopped: %s",
                     ENGINE_DEAD_STATUS, failure)
        raise SystemExit(ENGINE_DEAD_STATUS)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT leave through `finally` blocks (exit 0): called before startup too, so a stop asked for
    while loading still stops the followers already started (boot.py)."""
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, _terminated)


def _watch(engine: Engine, server: uvicorn.Server) -> None:
    """Wait for the engine's death (also before the server listens); then, after the grace, stop uvicorn."""
    reason = engine.wait_failed()
    log.error("the engine stopped (%s): /health answers 503; the server stops in %g s", reason, DEAD_GRACE_S)
    time.sleep(DEAD_GRACE_S)
    server.should_exit = True


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM or SIGINT outside uvicorn's own handling (before it serves, or re-raised by it after its graceful
    shutdown): leave through `finally`, so the engine stops and the disk tier flushes; a stop asked for is exit 0."""
    raise SystemExit(0)
