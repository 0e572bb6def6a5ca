"""The engine's events into asyncio: one sink per event loop, so a step's events for every request served on that
loop cross the thread boundary in one `call_soon_threadsafe`; the loop then calls each request's `on_event`."""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Sequence

from tensorfold.engine.api import Event, Request

log = logging.getLogger(__name__)


class LoopSink:
    """An EventSink (engine/api.py) that runs the requests' handlers on one event loop, a batch per hop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # a weak one: the registry below must not keep a finished loop alive

    def deliver(self, events: Sequence[tuple[Request, Event]]) -> None:
        """Engine thread: hand the batch to the loop; a loop already closed or gone (shutdown) drops it."""
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(dispatch, events)
        except RuntimeError:
            log.debug("%d events dropped: the event loop is closed", len(events))


def dispatch(events: Sequence[tuple[Request, Event]]) -> None:
    """On the loop: each request's handler, in order; one that raises is logged and the others still hear theirs."""
    for request, event in events:
        try:
            request.on_event(event)
        except Exception:
            log.exception("%s: its event handler raised on %s", request.id, type(event).__name__)


_SINKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSink] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # loops on several threads may ask at once


def sink_for(loop: asyncio.AbstractEventLoop) -> LoopSink:
    """The one sink of `loop`, made on first use."""
    with _LOCK:
        sink = _SINKS.get(loop)
        if sink is None:
            sink = _SINKS[loop] = LoopSink(loop)
        return sink
