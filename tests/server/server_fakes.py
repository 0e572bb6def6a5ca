"""A scripted engine for the server's in-process tests: the real tokenizer, canned token streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from tensorfold.engine.api import DoneEvent, ErrorEvent, Request, Sampling, TokenEvent
from tensorfold.service import QueueFull, Service
from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold.tokenizer import ChatTokenizer

Script = Callable[[Request], list[int]]


@attrs.define
class FakeEngine:
    """Emits `script(request)` token by token on its own thread, honouring cancel, max_tokens and stop ids."""

    script: Script = lambda request: []
    fail_with: str | None = None  # an ErrorEvent after `fail_after` tokens
    fail_after: int = 0
    full: bool = False  # submit raises QueueFull
    delay_s: float = 0.0  # between tokens
    requests: list[Request] = attrs.field(factory=list)
    finished: list[str] = attrs.field(factory=list)  # finish reasons, in order

    def submit(self, request: Request) -> None:
        """Start a thread that plays the script."""
        if self.full:
            raise QueueFull("1 requests are already waiting")
        self.requests.append(request)
        threading.Thread(target=self._play, args=(request,), daemon=True).start()

    def _play(self, request: Request) -> None:
        produced = 0
        reason = "length"
        for i, token in enumerate(self.script(request)):
            if self.fail_with is not None and i == self.fail_after:
                request.on_event(ErrorEvent(self.fail_with))
                self.finished.append("error")
                return
            if request.cancelled.is_set():
                reason = "cancelled"
                break
            time.sleep(self.delay_s)
            produced += 1
            request.on_event(TokenEvent(token))
            if token in request.sampling.stop_token_ids:
                reason = "stop"
                break
            if produced >= request.sampling.max_tokens:
                break
        else:
            if self.fail_with is not None:
                request.on_event(ErrorEvent(self.fail_with))
                self.finished.append("error")
                return
        self.finished.append(reason)
        request.on_event(DoneEvent(reason, len(request.prompt), produced, 3))

    def wait_finished(self, count: int, timeout: float = 5.0) -> list[str]:
        """Block until `count` requests have ended in the engine."""
        deadline = time.monotonic() + timeout
        while len(self.finished) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.finished


def make_tokenizer(directory: Path) -> ChatTokenizer:
    """The tiny tokenizer every family's tiny checkpoint ships."""
    write_tiny_tokenizer(directory, 512)
    return ChatTokenizer(directory)


def make_service(tokenizer: ChatTokenizer, engine: FakeEngine | None = None, context: int = 64,
                 defaults: Sampling | None = None) -> Service:
    """A Service over the fake engine."""
    return Service(engine=engine or FakeEngine(), tokenizer=tokenizer, model_name="tiny", family="fake",
                   context=context, defaults=defaults or Sampling(max_tokens=16, stop_token_ids=tokenizer.eos_ids))
