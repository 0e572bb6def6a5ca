"""The soak's clients: multi-turn chats whose next turn extends the last (so states are kept and resumed, some
after their eviction), streams hung up midway, requests cancelled before their answer, plain completions."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from typing import Any

import attrs
import httpx

WORDS = ("the quick brown fox jumps over the lazy dog a conversation is kept never prefilled twice hello how are you "
         "what is the capital of France Paris tell me a story about a cat and a model kept states live on the device "
         "in pinned host memory and on disk resume do not recompute why is the sky blue write a poem about the sea"
         ).split()
# what a client does next, and how often
ACTIONS = {"turn": 30, "turn_stream": 25, "hang_up": 15, "cancel": 10, "completion": 20}
REQUEST_TIMEOUT_S = 300.0


@attrs.define
class Tally:
    """What every client saw, together: answers by action and status, and what went wrong."""

    statuses: Counter = attrs.field(factory=Counter)   # "action status" -> count
    server_errors: int = 0      # 5xx answers, and error events inside a 200 stream
    transport_errors: int = 0   # no answer, one that broke off (not our own hang-ups), or a body not as documented
    requests: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    resumed: int = 0            # answers with cached_tokens > 0
    examples: list[str] = attrs.field(factory=list)  # the first few server errors, for the log

    def answered(self, action: str, status: int, body: Any = None) -> None:
        """Count one answer; a 5xx keeps an example."""
        self.requests += 1
        self.statuses[f"{action} {status}"] += 1
        if status >= 500:
            self.server_error(f"{action} {status}: {str(body)[:300]}")
        if isinstance(body, dict) and isinstance(body.get("usage"), dict):
            self.usage(body["usage"])

    def usage(self, usage: dict[str, Any]) -> None:
        """Add one answer's token counts."""
        self.completion_tokens += usage.get("completion_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.cached_tokens += cached
        self.resumed += cached > 0

    def server_error(self, example: str) -> None:
        """A 5xx or an error event."""
        self.server_errors += 1
        if len(self.examples) < 5:
            self.examples.append(example)

    def summary(self) -> dict[str, Any]:
        """The tally as JSON fields."""
        return {"requests": self.requests, "server_errors_5xx": self.server_errors,
                "transport_errors": self.transport_errors, "completion_tokens": self.completion_tokens,
                "resumed_answers": self.resumed, "cached_tokens": self.cached_tokens,
                "statuses": dict(sorted(self.statuses.items())), "error_examples": self.examples}


@attrs.define
class Conversation:
    """One chat: its messages so far; a next turn is the history, the reply and a new user message."""

    messages: list[dict[str, str]]
    prompt_tokens: int = 0


class Client:
    """One soak client: its own conversations (a few kept to return to) and its own connection pool."""

    def __init__(self, index: int, url: str, context: int, ids: list[int], tally: Tally, seed: int) -> None:
        self.index = index
        self.url = url
        self.context = context
        self.ids = ids  # token ids the server's tokenizer makes of WORDS, for prompts given as ids
        self.tally = tally
        self.rng = random.Random(seed * 1000 + index)
        self.started = 0
        self.old: list[Conversation] = []
        self.chat = self.new_conversation()

    def words(self, low: int, high: int) -> str:
        """Some words: a few dozen tokens."""
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(low, high)))

    def new_conversation(self) -> Conversation:
        """A conversation that opens with text of its own, so it resumes only from its own states."""
        self.started += 1
        system = f"client {self.index} conversation {self.started}: {self.words(20, 60)}"
        return Conversation([{"role": "system", "content": system}, {"role": "user", "content": self.words(10, 40)}])

    def pick_conversation(self) -> None:
        """Go on with this chat; now and then go back to an older one (its states evicted by now, some of them), or
        start afresh once the history nears the context."""
        if self.chat.prompt_tokens > self.context // 2:
            self.chat = self.new_conversation()
        elif self.old and self.rng.random() < 0.1:
            self.old.append(self.chat)
            self.chat = self.old.pop(self.rng.randrange(len(self.old) - 1))
        elif self.rng.random() < 0.05:
            self.old = [*self.old[-3:], self.chat]
            self.chat = self.new_conversation()

    def body(self, stream: bool) -> dict[str, Any]:
        """The chat's next turn."""
        body: dict[str, Any] = {"messages": self.chat.messages, "max_tokens": self.rng.randint(8, 40),
                                "stream": stream}
        if self.rng.random() < 0.5:
            body.update(temperature=0.8, top_p=0.95, seed=self.rng.randrange(1 << 30))
        else:
            body["temperature"] = 0
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def answered_turn(self, reply: str, prompt_tokens: int) -> None:
        """The turn's reply joins the history and the user says something new."""
        self.chat.prompt_tokens = prompt_tokens
        self.chat.messages = [*self.chat.messages, {"role": "assistant", "content": reply},
                              {"role": "user", "content": self.words(10, 40)}]

    async def run(self, stop: asyncio.Event) -> None:
        """Act until told to stop."""
        actions, weights = list(ACTIONS), list(ACTIONS.values())
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            while not stop.is_set():
                action = self.rng.choices(actions, weights)[0]
                self.pick_conversation()
                try:
                    await getattr(self, action)(http)
                except (httpx.HTTPError, ValueError, KeyError) as err:  # no answer, or one that is not what it says
                    self.tally.transport_errors += 1
                    if len(self.tally.examples) < 5:
                        self.tally.examples.append(f"{action}: {type(err).__name__}: {err}")

    async def turn(self, http: httpx.AsyncClient) -> None:
        reply = await http.post(f"{self.url}/v1/chat/completions", json=self.body(stream=False))
        body = reply.json()
        self.tally.answered("turn", reply.status_code, body)
        if reply.status_code == 200:
            self.answered_turn(body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"])

    async def turn_stream(self, http: httpx.AsyncClient, hang_up_after: int | None = None) -> None:
        action = "turn_stream" if hang_up_after is None else "hang_up"
        texts: list[str] = []
        prompt_tokens = 0
        async with http.stream("POST", f"{self.url}/v1/chat/completions", json=self.body(stream=True)) as reply:
            if reply.status_code != 200:
                self.tally.answered(action, reply.status_code, (await reply.aread()).decode(errors="replace"))
                return
            self.tally.answered(action, 200)
            events = 0
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.tally.server_error(f"{action} error event: {line[:300]}")
                    return
                if chunk.get("usage"):
                    self.tally.usage(chunk["usage"])
                    prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    texts.append(choice["delta"].get("content") or "")
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    return  # leaving the block closes the connection mid-stream
        if hang_up_after is None:
            self.answered_turn("".join(texts), prompt_tokens)

    async def hang_up(self, http: httpx.AsyncClient) -> None:
        await self.turn_stream(http, hang_up_after=self.rng.randint(1, 6))

    async def cancel(self, http: httpx.AsyncClient) -> None:
        """A non-streamed turn given up on before its answer: the request is cancelled, its connection closed."""
        wait = self.rng.uniform(0.02, 0.5)
        try:
            reply = await asyncio.wait_for(http.post(f"{self.url}/v1/chat/completions", json=self.body(False)), wait)
        except TimeoutError:
            self.tally.statuses["cancel gave up"] += 1
            return
        self.tally.answered("cancel", reply.status_code, reply.json())

    async def completion(self, http: httpx.AsyncClient) -> None:
        """A plain completion, from text or token ids, streamed or not; nothing kept on the client's side."""
        prompt: str | list[int] = self.words(5, 80)
        if self.rng.random() < 0.3:
            prompt = [self.rng.choice(self.ids) for _ in range(self.rng.randint(1, 200))]
        body = {"prompt": prompt, "max_tokens": self.rng.randint(1, 32), "temperature": self.rng.choice([0, 1.0])}
        if self.rng.random() < 0.3:
            async with http.stream("POST", f"{self.url}/v1/completions", json={**body, "stream": True}) as reply:
                text = await reply.aread()
                self.tally.answered("completion_stream", reply.status_code,
                                    text[:300].decode(errors="replace") if reply.status_code != 200 else None)
                if reply.status_code == 200 and b'"error"' in text:
                    self.tally.server_error(f"completion_stream error event: {text[-300:]!r}")
            return
        reply = await http.post(f"{self.url}/v1/completions", json=body)
        self.tally.answered("completion", reply.status_code, reply.json())
