"""What the HTTP server is handed: the engine to submit to and the facts it answers with."""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from tensorfold.chat.api import ChatFormat
from tensorfold.chat.start_cache import StartCache
from tensorfold.engine.api import Request, Sampling
from tensorfold.engine.stats import EngineStats
from tensorfold.tokenizer import ChatTokenizer


class QueueFull(Exception):
    """More requests wait than --max-waiting allows; the client should retry later."""


class EngineDead(Exception):
    """The engine's step loop has stopped for good; the message says why. The server answers 503 and exits."""


class Submitter(Protocol):
    """The engine as the server sees it."""

    def submit(self, request: Request) -> None:
        """Queue a request; events reach request.on_event from the engine thread. Raises QueueFull or
        EngineDead."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Streams and memory now, for GET /memory."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine stopped for good (then /health is 503 and submit raises EngineDead); None while it runs."""
        ...


@attrs.frozen
class Service:
    """The server's view of one served model; with `request_starts` (the family's request-starts switch) chat
    requests carry the positions where their messages start, and prefill cuts there too. `stats` is what the
    engine records latencies and tokens into, for /metrics (None: no latency metrics)."""

    engine: Submitter
    tokenizer: ChatTokenizer
    model_name: str
    family: str
    context: int
    defaults: Sampling
    plan: dict[str, Any] = attrs.field(factory=dict)
    request_starts: bool = False
    isolate_by_key: bool = False  # --isolate-cache-by-key: a request's partition names its API key
    stats: EngineStats | None = None
    model_names: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # every name served; () = model_name
    chat_format: ChatFormat | None = None  # the family's think markers and tool parser (None: replies are content)
    grammars: Any = None  # engine/grammar.py's Grammars for structured output (None: none is served)
    starts_cache: StartCache = attrs.field(factory=StartCache, eq=False)  # proven message starts (chat/start_cache.py)

    @property
    def names(self) -> tuple[str, ...]:
        """The names a request may give as `model` (--served-model-name, each; the first is `model_name`)."""
        return self.model_names or (self.model_name,)

