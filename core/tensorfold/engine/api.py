"""What the server and the engine exchange: requests in, events out. No tensors cross this line."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from tensorfold.engine.grammar import Matcher


@attrs.frozen
class Sampling:
    """How one request samples: greedy when temperature is 0; a seed makes a reply reproducible; max_tokens 0
    prefills the prompt and ends with `length` (for its prompt logprobs)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), each id once
    min_tokens: int = 0  # until this many tokens are out, the stop tokens cannot be sampled
    repetition_penalty: float = 1.0  # engine/penalties.py
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # the sampled token's logprob and this many most likely ones (None: none)
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many most likely (PromptEvent)


@attrs.frozen
class TokenEvent:
    """One sampled token; with Sampling.logprobs, its log-probability under the model's raw logits and the
    most likely tokens' (id, logprob), best first."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class PromptEvent:
    """Sent once, when the prompt's prefill ends, to a request whose Sampling.prompt_logprobs is set (such a request
    prefills its whole prompt: it never resumes from a kept state). One (token id, logprob, top) per prompt token,
    as TokenEvent has them; the first token has no logprob (nothing precedes it) and no top."""

    entries: tuple[tuple[int, float | None, tuple[tuple[int, float], ...]], ...]


@attrs.frozen
class DoneEvent:
    """The request ended: `stop` (end token or stop string), `length` (max_tokens or context) or `cancelled`."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@attrs.frozen
class ErrorEvent:
    """The engine failed this request; the message is safe to show a client."""

    message: str


Event = TokenEvent | PromptEvent | DoneEvent | ErrorEvent


class EventSink(Protocol):
    """Where the events of requests that name it go, in bulk: the engine thread calls `deliver` once per step with
    that step's events for all of them, in order, so a receiver on another thread is woken once per step, not once
    per token. It must not block; an event loop's sink hands the batch over with one `call_soon_threadsafe`."""

    def deliver(self, events: Sequence[tuple[Request, Event]]) -> None:
        """Take a batch of (request, event) pairs, each request's in the order they happened."""
        ...


class DeviceLost(Exception):
    """Raised by a family's forward when its device cannot compute any more (a lost GPU, a sticky kernel fault):
    the engine stops for good, /health answers 503 and `serve` exits with status 3 for a supervisor to restart it
    (docs/hooks.md). torch's own accelerator errors are read the same way."""


@attrs.frozen
class KeepMarks:
    """Prompt positions a later request may want to resume at, found by the server (None: not known); the engine
    keeps a state at the last cut at or before each (tiers/policy.py) and knows nothing else of the chat."""

    history: int | None = None  # where the rendered history ends (the generated turn's start); None: the prompt end
    system: int | None = None   # where the shared system prompt ends (the first non-system message's start)
    rewind: int | None = None   # where the latest user message starts: an edited or regenerated last turn


@attrs.define
class Request:
    """A prompt to continue. Without a `sink`, `on_event` is called on the engine thread as each event happens and
    must not block (one that raises on a token fails the request); with one, the events go to the sink in one batch
    per step and the sink calls `on_event` where it lives (the server's: on its event loop). `starts` are the
    prompt positions where requests (chat messages) start: prefill also cuts there (cuts.py); empty, the
    grid alone. `marks` say where states worth resuming at lie. `partition` names the kept states it may resume
    from and those it keeps: only states kept under the same partition (server/isolation.py). `grammar`, when
    set, is the request's own matcher (engine/grammar.py): each token is drawn among those it allows, and the
    request ends with `stop` once it is complete; the engine thread alone uses it. `forks` are the other choices of
    one prompt (the API's `n`): requests with the same prompt, each with its own id, sampling, events and grammar,
    submitted only through this one. The prompt is prefilled once: they are admitted with it (all or none), and when
    its prefill ends each gets a copy of its state and draws its own first token from the same logits row
    (engine/forks.py); ended before that point, it ends them the same way."""

    id: str
    prompt: tuple[int, ...] = attrs.field(converter=tuple)
    sampling: Sampling
    on_event: Callable[[Event], None] = attrs.field(repr=False)
    cancelled: threading.Event = attrs.field(factory=threading.Event, repr=False)
    starts: tuple[int, ...] = attrs.field(default=(), converter=tuple, kw_only=True)
    marks: KeepMarks = attrs.field(factory=KeepMarks, kw_only=True)
    partition: str = attrs.field(default="", kw_only=True)  # kept states' namespace: "" shared, else its own
    sink: EventSink | None = attrs.field(default=None, kw_only=True, repr=False)
    grammar: Matcher | None = attrs.field(default=None, kw_only=True, repr=False)
    forks: tuple[Request, ...] = attrs.field(default=(), converter=tuple, kw_only=True, repr=False)

    def cancel(self) -> None:
        """Ask the engine to stop this request at its next step (client gone, stop string seen)."""
        self.cancelled.set()
