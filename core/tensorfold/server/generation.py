"""One submitted request: engine events carried from the engine thread into asyncio, turned into text pieces."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import attrs

from tensorfold.engine.api import DoneEvent, ErrorEvent, Event, Request, TokenEvent
from tensorfold.server.detok import StopText
from tensorfold.server.errors import UNAVAILABLE, ApiError, engine_failed, queue_full
from tensorfold.server.params import Generate
from tensorfold.service import EngineDead, QueueFull, Service

log = logging.getLogger(__name__)
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
    """Submits one request and yields its Pieces then one Finish; cancels the engine's work when abandoned."""

    def __init__(self, service: Service, params: Generate, prefix: str, partition: str = "") -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.params = params
        self.text = StopText(service.tokenizer.decode, params.stop)
        self.finished = False
        self._service = service
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._peeked: Event | None = None
        self._since = 0  # token ids not yet handed out with a Piece
        self._check_at = self._loop.time() + POLL_S  # when to next ask whether the client is still there
        self.request = Request(id=self.id, prompt=params.prompt, sampling=params.sampling,
                               on_event=self._on_event, starts=params.starts, marks=params.marks,
                               partition=partition)

    def _on_event(self, event: Event) -> None:
        """Engine thread: hand the event to the loop; a loop already closed (shutdown) drops it."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:
            log.debug("event for %s dropped: the event loop is closed", self.id)

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

    async def _next(self, disconnected: Disconnected | None) -> Event:
        """The next event; with `disconnected`, give up (and cancel) when the client goes away."""
        if self._peeked is not None:
            event, self._peeked = self._peeked, None
            return event
        if disconnected is None:
            return await self._events.get()
        while True:
            if self._loop.time() >= self._check_at:  # checked on a clock: tokens may never leave a gap
                self._check_at = self._loop.time() + POLL_S
                if await disconnected():
                    self.abandon()
                    raise ClientGone(self.id)
            if not self._events.empty():
                return self._events.get_nowait()
            try:
                return await asyncio.wait_for(self._events.get(), POLL_S)
            except TimeoutError:
                pass

    async def first_event_ok(self, disconnected: Disconnected | None) -> None:
        """Wait for the first event so that a failure before any output is a plain 500, not a broken stream."""
        event = await self._next(disconnected)
        self._peeked = event
        if isinstance(event, ErrorEvent):
            self.finished = True
            raise engine_failed(event.message)

    async def pieces(self, disconnected: Disconnected | None = None) -> AsyncIterator[Piece | Finish]:
        """Pieces of text as they become safe to send, then one Finish; an ErrorEvent raises EngineFailed."""
        while True:
            event = await self._next(disconnected)
            if isinstance(event, TokenEvent):
                if self.text.stopped:
                    continue
                text = self.text.push(event.token_id)
                if self.text.stopped:
                    self.request.cancel()
                if text:
                    yield self._piece(text)
            elif isinstance(event, DoneEvent):
                self.finished = True
                rest = self.text.finish()
                if rest or self._since < len(self.text.ids):
                    yield self._piece(rest)
                yield Finish(self._reason(event), self._usage(event))
                return
            elif isinstance(event, ErrorEvent):
                self.finished = True
                raise EngineFailed(event.message)

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
