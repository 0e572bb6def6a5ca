"""One submitted request: engine events carried from the engine thread into asyncio, turned into text pieces."""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import attrs

from tensorfold.engine.api import DoneEvent, ErrorEvent, Event, Request, TokenEvent
from tensorfold.server.detok import StopText
from tensorfold.server.errors import UNAVAILABLE, ApiError, engine_failed, queue_full
from tensorfold.server.handoff import sink_for
from tensorfold.server.params import Generate
from tensorfold.service import EngineDead, QueueFull, Service

POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is still there
Disconnected = Callable[[], Awaitable[bool]]


@attrs.frozen
class Usage:
    """Token counts for the `usage` object."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_json(self) -> dict[str, object]:
        """OpenAI's usage object, with prompt_tokens_details.cached_tokens."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@attrs.frozen
class Piece:
    """New text and the token ids that arrived with it (text may be empty while a stop string is possible)."""

    text: str
    token_ids: tuple[int, ...]


@attrs.frozen
class Finish:
    """The end of a completion."""

    finish_reason: str
    usage: Usage


class EngineFailed(Exception):
    """The engine reported an ErrorEvent; the message is safe to show."""


class ClientGone(Exception):
    """The client disconnected while we waited."""


class Generation:
    """Submits one request and yields its Pieces then one Finish; cancels the engine's work when abandoned. Its
    events come through the loop's sink (server/handoff.py): one hop per engine step for every request on the loop."""

    def __init__(self, service: Service, params: Generate, prefix: str, partition: str = "") -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.params = params
        self.text = StopText(service.tokenizer.decode, params.stop, include=params.include_stop)
        self.finished = False
        self._service = service
        self._loop = asyncio.get_running_loop()
        self._events: deque[Event] = deque()
        self._wake: asyncio.Future[None] | None = None  # set while the reader waits for an event
        self._since = 0  # token ids not yet handed out with a Piece
        self._check_at = self._loop.time() + POLL_S  # when to next ask whether the client is still there
        self.request = Request(id=self.id, prompt=params.prompt, sampling=params.sampling,
                               on_event=self._receive, starts=params.starts, marks=params.marks,
                               partition=partition, sink=sink_for(self._loop))

    def _receive(self, event: Event) -> None:
        """On the loop, from the sink's batch: queue the event and wake the reader."""
        self._events.append(event)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def submit(self) -> None:
        """Queue the request with the engine; a full queue, or an engine stopped for good, is a 503."""
        try:
            self._service.engine.submit(self.request)
        except QueueFull as err:
            raise queue_full(str(err)) from err
        except EngineDead as err:  # the process is exiting (launch.py): a 503 naming why
            raise ApiError(503, f"the engine has stopped: {err}", UNAVAILABLE, code="engine_dead") from err

    def abandon(self) -> None:
        """The answer is no longer wanted (client gone, error): let the engine free the stream."""
        if not self.finished:
            self.request.cancel()

    async def _arrived(self, disconnected: Disconnected | None) -> None:
        """Return once an event is queued; with `disconnected`, give up (and cancel) when the client goes away."""
        while True:
            if disconnected is not None and self._loop.time() >= self._check_at:  # on a clock: tokens may never
                self._check_at = self._loop.time() + POLL_S                     # leave a gap
                if await disconnected():
                    self.abandon()
                    raise ClientGone(self.id)
            if self._events:
                return
            self._wake = wake = self._loop.create_future()
            timer = None if disconnected is None else self._loop.call_later(POLL_S, _wake_up, wake)
            try:
                await wake
            finally:
                self._wake = None
                if timer is not None:
                    timer.cancel()

    async def first_event_ok(self, disconnected: Disconnected | None) -> None:
        """Wait for the first event so that a failure before any output is a plain 500, not a broken stream."""
        await self._arrived(disconnected)
        event = self._events[0]
        if isinstance(event, ErrorEvent):
            self._events.popleft()
            self.finished = True
            raise engine_failed(event.message)

    async def batches(self, disconnected: Disconnected | None = None) -> AsyncIterator[list[Piece | Finish]]:
        """At each wake-up, the Pieces of every event that arrived (one per token that made text), the last batch
        ending with one Finish; an ErrorEvent raises EngineFailed after the batch of the events before it."""
        while True:
            await self._arrived(disconnected)
            items: list[Piece | Finish] = []
            failed: str | None = None
            while self._events and failed is None:
                event = self._events.popleft()
                if isinstance(event, TokenEvent):
                    self._token(event.token_id, items)
                elif isinstance(event, DoneEvent):
                    self.finished = True
                    self._done(event, items)
                    yield items
                    return
                else:
                    self.finished = True
                    failed = event.message
            if items:
                yield items
            if failed is not None:
                raise EngineFailed(failed)

    def _token(self, token_id: int, items: list[Piece | Finish]) -> None:
        """One token through the stop-string decoder: a Piece when it made text; a stop string cancels the rest."""
        if self.text.stopped:
            return
        text = self.text.push(token_id)
        if self.text.stopped:
            self.request.cancel()
        if text:
            items.append(self._piece(text))

    def _done(self, event: DoneEvent, items: list[Piece | Finish]) -> None:
        """The text held back, then the Finish."""
        rest = self.text.finish()
        if rest or self._since < len(self.text.ids):
            items.append(self._piece(rest))
        items.append(Finish(self._reason(event), self._usage(event)))

    def _piece(self, text: str) -> Piece:
        ids = tuple(self.text.ids[self._since:])
        self._since = len(self.text.ids)
        return Piece(text, ids)

    def _reason(self, event: DoneEvent) -> str:
        """A request cut by a stop string finished with `stop`, whatever the engine saw after."""
        return "stop" if self.text.stopped else event.finish_reason

    def _usage(self, event: DoneEvent) -> Usage:
        """Counts from the engine; after a stop string, only the tokens up to it count as the completion."""
        completion = len(self.text.ids) if self.text.stopped else event.completion_tokens
        return Usage(event.prompt_tokens, completion, event.cached_tokens)

    @property
    def token_ids(self) -> list[int]:
        """The completion's token ids so far (up to the stop string's last token when one was seen)."""
        return list(self.text.ids)


def _wake_up(wake: asyncio.Future[None]) -> None:
    """The poll clock's tick: wake a reader that waits for events, so it can ask about its client."""
    if not wake.done():
        wake.set_result(None)
