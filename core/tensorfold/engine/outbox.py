"""The engine's events on their way out: a request without a sink hears each one at once on the engine thread; the
events of requests with a sink are gathered while the loop holds them (a step) and handed over in one call per
sink when it lets go, so a server's event loop is woken once per step, not once per token.

    order    a request's events keep their order: each goes to one sink, appended in the order they happen, and a
             batch is delivered before the next one is started
    prompt   outside a hold (a failed admission, a request refused before it runs, the engine's death) and at each
             `flush` inside one, what is gathered leaves at once
    faults   a sink whose `deliver` raises is logged: the receiver's fault, never a step's; a direct `on_event` that
             raises propagates to the caller (the step loop fails that stream)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from tensorfold.engine.api import Event, EventSink, Request

log = logging.getLogger(__name__)


class Outbox:
    """The engine thread's events, per sink, until the hold ends; used from the engine thread alone."""

    def __init__(self) -> None:
        self._pending: dict[EventSink, list[tuple[Request, Event]]] = {}
        self._holding = False

    def emit(self, request: Request, event: Event) -> None:
        """Send one event: now to a sinkless request's `on_event`, else to its sink's batch (now, unless held)."""
        sink = request.sink
        if sink is None:
            request.on_event(event)
            return
        batch = self._pending.get(sink)
        if batch is None:
            batch = self._pending[sink] = []
        batch.append((request, event))
        if not self._holding:
            self.flush()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Gather the events sent inside the block and deliver them when it ends, however it ends."""
        outer, self._holding = self._holding, True
        try:
            yield
        finally:
            self._holding = outer
            if not outer:
                self.flush()

    def flush(self) -> None:
        """Deliver what is gathered: one `deliver` per sink."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for sink, events in pending.items():
            try:
                sink.deliver(events)
            except Exception:
                log.exception("an event sink raised on a batch of %d events", len(events))
