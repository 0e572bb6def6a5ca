"""One submitted request: engine events carried from the engine thread into asyncio, turned into text pieces."""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import attrs

from tensorfold.engine.api import DoneEvent, ErrorEvent, Event, PromptEvent, Request, Sampling, TokenEvent
from tensorfold.server.detok import StopText
from tensorfold.server.errors import UNAVAILABLE, ApiError, engine_failed, queue_full
from tensorfold.server.handoff import sink_for
from tensorfold.server.logprobs import Entry
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
    """New text and the token ids that arrived with it (text may be empty while a stop string is possible), and
    their logprob entries when the request asked for logprobs (server/logprobs.py)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Entry, ...] = ()


@attrs.frozen
class Finish:
    """The end of a completion."""

    finish_reason: str
    usage: Usage


class EngineFailed(Exception):
    """The engine reported an ErrorEvent; the message is safe to show."""


class ClientGone(Exception):
    """The client disconnected while we waited."""


class Waiter:
    """Wakes the one reader of some generations (one, or a request's choices) when events arrive for any of them,
    and asks on a clock whether its client is still there."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._wake: asyncio.Future[None] | None = None  # set while the reader waits for an event
        self._check_at = loop.time() + POLL_S  # when to next ask whether the client is still there

    def wake(self) -> None:
        """Events arrived: wake the reader if it waits."""
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def wait(self, ready: Callable[[], bool], disconnected: Disconnected | None, gone: Callable[[], None],
                   name: str) -> None:
        """Return once `ready()`; with `disconnected`, call `gone` and raise ClientGone when the client goes away."""
        while True:
            if disconnected is not None and self._loop.time() >= self._check_at:  # on a clock: tokens may never
                self._check_at = self._loop.time() + POLL_S                     # leave a gap
                if await disconnected():
                    gone()
                    raise ClientGone(name)
            if ready():
                return
            self._wake = wake = self._loop.create_future()
            timer = None if disconnected is None else self._loop.call_later(POLL_S, _wake_up, wake)
            try:
                await wake
            finally:
                self._wake = None
                if timer is not None:
                    timer.cancel()


class Generation:
    """Submits one request and yields its Pieces then one Finish; cancels the engine's work when abandoned. Its
    events come through the loop's sink (server/handoff.py): one hop per engine step for every request on the loop.
    One choice of several (server/choices.py) has its own `id` and `sampling`, shares its reader's `waiter`, and
    the first choice's request carries the others' as its `forks` (engine/forks.py)."""

    def __init__(self, service: Service, params: Generate, prefix: str, partition: str = "", *,
                 id: str | None = None, sampling: Sampling | None = None, forks: Sequence[Request] = (),
                 waiter: Waiter | None = None) -> None:
        self.id = id if id is not None else f"{prefix}-{uuid.uuid4().hex}"
        self.params = params
        self.text = StopText(service.tokenizer.decode, params.stop, include=params.include_stop)
        self.finished = False
        self._service = service
        self._loop = asyncio.get_running_loop()
        self._events: deque[Event] = deque()
        self._waiter = waiter if waiter is not None else Waiter(self._loop)
        self._since = 0  # token ids not yet handed out with a Piece
        self._entries: list[Entry] = []  # logprob entries, one per id of self.text.ids (when asked for)
        self.prompt_entries: list[Entry] = []  # the prompt's, from the engine's PromptEvent (when asked for)
        self._echoed = False  # whether the echoed prompt went out
        grammar = service.grammars.matcher(params.grammar) if params.grammar is not None else None
        self.request = Request(id=self.id, prompt=params.prompt, sampling=sampling or params.sampling,
                               on_event=self._receive, starts=params.starts, marks=params.marks,
                               partition=partition, sink=sink_for(self._loop), grammar=grammar, forks=forks)

    def _receive(self, event: Event) -> None:
        """On the loop, from the sink's batch: queue the event and wake the reader."""
        self._events.append(event)
        self._waiter.wake()

    @property
    def queued(self) -> bool:
        """Whether events wait to be read."""
        return bool(self._events)

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
        await self._waiter.wait(lambda: bool(self._events), disconnected, self.abandon, self.id)

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
            items, failed = self.drain()
            if items:
                yield items
            if failed is not None:
                raise EngineFailed(failed)
            if self.finished:
                return

    def drain(self) -> tuple[list[Piece | Finish], str | None]:
        """The items of the events queued now (the last a Finish once the request is done), and the engine's message
        when it failed the request; nothing is read past the request's last event."""
        items: list[Piece | Finish] = []
        while self._events and not self.finished:
            event = self._events.popleft()
            if isinstance(event, TokenEvent):
                self._echo(items)
                self._token(event, items)
            elif isinstance(event, PromptEvent):
                self.prompt_entries = list(event.entries)
                self._echo(items)
            elif isinstance(event, DoneEvent):
                self.finished = True
                self._echo(items)
                self._done(event, items)
            else:
                self.finished = True
                return items, event.message
        return items, None

    def _token(self, event: TokenEvent, items: list[Piece | Finish]) -> None:
        """One token through the stop-string decoder: a Piece when it made text; a stop string cancels the rest."""
        if self.text.stopped:
            return
        if event.logprob is not None:
            self._entries.append((event.token_id, event.logprob, event.top))
        text = self.text.push(event.token_id)
        if self.text.stopped:
            self.request.cancel()
        if text:
            items.append(self._piece(text))

    def _echo(self, items: list[Piece | Finish]) -> None:
        """With `echo`, the prompt's text as the first Piece, before the first token (with the prompt's logprobs
        when the completion's are asked for: the engine sends them before any token)."""
        if self.params.echo is not None and not self._echoed:
            self._echoed = True
            items.append(Piece(self.params.echo, (), tuple(self.echoed_entries)))

    @property
    def echoed_entries(self) -> list[Entry]:
        """The prompt's entries an echo shows with the completion's logprobs (none unless both are asked for)."""
        wanted = self.params.echo is not None and self.request.sampling.logprobs is not None
        return self.prompt_entries if wanted else []

    def _done(self, event: DoneEvent, items: list[Piece | Finish]) -> None:
        """The text held back, then the Finish."""
        rest = self.text.finish()
        if rest or self._since < len(self.text.ids):
            items.append(self._piece(rest))
        items.append(Finish(self._reason(event), self._usage(event)))

    def _piece(self, text: str) -> Piece:
        ids = tuple(self.text.ids[self._since:])
        entries = tuple(self._entries[self._since:len(self.text.ids)])
        self._since = len(self.text.ids)
        return Piece(text, ids, entries)

    def _reason(self, event: DoneEvent) -> str:
        """A request cut by a stop string finished with `stop`, whatever the engine saw after."""
        return "stop" if self.text.stopped else event.finish_reason

    def _usage(self, event: DoneEvent) -> Usage:
        """Counts from the engine; after a stop string, only the tokens up to it count as the completion."""
        completion = len(self.text.ids) if self.text.stopped else event.completion_tokens
        return Usage(event.prompt_tokens, completion, event.cached_tokens)

    @property
    def logprobs(self) -> list[Entry]:
        """The completion's logprob entries so far (up to the stop string's last token), when asked for."""
        return self._entries[:len(self.text.ids)]

    @property
    def token_ids(self) -> list[int]:
        """The completion's token ids so far (up to the stop string's last token when one was seen)."""
        return list(self.text.ids)


class Choices:
    """A request's choices (`best_of`, else `n`): a Generation each, seeded by `choice_seed`; the first is
    submitted with the others' requests as its forks, so the engine prefills the prompt once (engine/forks.py).
    Read as one: each wake-up yields the items of every choice that had events, with its index."""

    def __init__(self, service: Service, params: Generate, prefix: str, partition: str = "") -> None:
        self.waiter = Waiter(asyncio.get_running_loop())
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.params = params
        count = params.best_of
        logprobs = params.sampling.logprobs
        if count > params.n and logprobs is None:  # best_of ranks by the choices' logprobs, shown only if asked
            logprobs = 0
        samplings = [attrs.evolve(params.sampling, seed=choice_seed(params.sampling.seed, i), logprobs=logprobs)
                     for i in range(count)]
        forks = [Generation(service, params, prefix, partition, id=f"{self.id}-{i}", sampling=samplings[i],
                            waiter=self.waiter) for i in range(1, count)]
        first = Generation(service, params, prefix, partition, id=self.id, sampling=samplings[0],
                           forks=[fork.request for fork in forks], waiter=self.waiter)
        self.generations = [first, *forks]

    @property
    def finished(self) -> bool:
        """Every choice has its last event."""
        return all(generation.finished for generation in self.generations)

    def submit(self) -> None:
        """Queue the first choice's request, the others with it (a full queue or a dead engine: Generation.submit)."""
        self.generations[0].submit()

    def abandon(self) -> None:
        """The answer is no longer wanted: let the engine free every choice's stream."""
        for generation in self.generations:
            generation.abandon()

    async def first_event_ok(self, disconnected: Disconnected | None) -> None:
        """Wait for the first choice's first event: the request's failure before any output is a plain 500."""
        await self.generations[0].first_event_ok(disconnected)

    async def batches(self, disconnected: Disconnected | None = None
                      ) -> AsyncIterator[list[tuple[int, Piece | Finish]]]:
        """At each wake-up, (choice index, item) for the events of every choice that arrived, until each choice has
        its Finish; a choice's ErrorEvent raises EngineFailed after the batch of the events before it."""
        while not self.finished:
            await self.waiter.wait(self._ready, disconnected, self.abandon, self.id)
            out: list[tuple[int, Piece | Finish]] = []
            failed: str | None = None
            for index, generation in enumerate(self.generations):
                if generation.queued and not generation.finished:
                    items, error = generation.drain()
                    out += [(index, item) for item in items]
                    failed = failed if failed is not None else error
            if out:
                yield out
            if failed is not None:
                raise EngineFailed(failed)

    def _ready(self) -> bool:
        """Whether a choice still running has events to read (a finished one's late events are never read)."""
        return any(generation.queued and not generation.finished for generation in self.generations)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i of a seeded request draws with seed + i (the engine reads seeds mod 2⁶⁴), so choice 0 is the
    request with n=1 and every choice is reproducible; unseeded, each choice draws its own seed."""
    return None if seed is None else seed + index


def _wake_up(wake: asyncio.Future[None]) -> None:
    """The poll clock's tick: wake a reader that waits for events, so it can ask about its client."""
    if not wake.done():
        wake.set_result(None)
