"""Several choices for one request (`n`, and `best_of` on /v1/completions), as vLLM's clients expect them.

    engine      one request with the other choices as its forks (server/generation.py Choices, engine/forks.py):
                the prompt is prefilled once and its state copied into each choice's slot where its prefill ends
    seeds       with a request `seed` s, choice i draws with seed s + i: choice 0 is the request with n=1, and a
                seeded request is reproducible whatever n is; without one each choice draws its own seed;
                greedy choices are all the same
    whole       `choices` with `index` 0..n-1, each built as the one-choice answer builds its own (message or text,
                tool calls, reasoning, logprobs, finish_reason); usage counts the prompt once, the completion
                tokens of every returned choice, and the first choice's cached tokens (every fork shares them)
    best_of     best_of choices are generated with logprobs (shown only when asked for) and the n whose tokens'
                logprobs sum highest are returned, best first (ties: the lower choice first), numbered 0..n-1
    streamed    every choice's role chunk first (chat), then the chunks of all choices as their events come, each
                naming its choice's `index`, a finish chunk per choice, one usage chunk at the end when asked for,
                then [DONE]; a choice the engine fails ends the stream with the error event
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import attrs
from starlette.responses import StreamingResponse

from tensorfold.server.generation import Choices, Disconnected, EngineFailed, Finish, Generation, Piece, Usage
from tensorfold.server.logprobs import prompt_logprobs
from tensorfold.server.payloads import CHAT, Shaper
from tensorfold.server.replies import ChatOutput, chat_output, finish_reason
from tensorfold.server.sse import DONE, HEADERS, ChoiceChunks, EventStream, event, failed
from tensorfold.service import Service


@attrs.define
class Collected:
    """One choice's answer as its items arrive: its text pieces, then its Finish."""

    texts: list[str] = attrs.field(factory=list)
    finish: Finish | None = None

    def take(self, item: Piece | Finish) -> None:
        """Keep a Piece's text or the Finish."""
        if isinstance(item, Finish):
            self.finish = item
        else:
            self.texts.append(item.text)

    def body(self, shaper: Shaper, generation: Generation, output: ChatOutput | None) -> dict[str, Any]:
        """The whole answer of this choice alone (server/payloads.py Shaper.response)."""
        assert self.finish is not None
        text = "".join(self.texts)
        parts = output.whole(text) if output is not None else None
        body = shaper.response(text, finish_reason(self.finish.finish_reason, output), self.finish.usage,
                               list(generation.params.prompt), generation.token_ids, parts,
                               generation.echoed_entries + generation.logprobs)
        if generation.params.prompt_logprobs:  # vLLM's field: the chat answer's, or the completion choice's
            shown = prompt_logprobs(generation.prompt_entries, shaper.decoded)
            (body if shaper.kind == CHAT else body["choices"][0])["prompt_logprobs"] = shown
        return body


async def whole_one(generation: Generation, shaper: Shaper, output: ChatOutput | None,
                    disconnected: Disconnected) -> dict[str, Any]:
    """The non-streamed answer of a request with one choice."""
    collected = Collected()
    async for batch in generation.batches(disconnected):
        for item in batch:
            collected.take(item)
    return collected.body(shaper, generation, output)


def outputs_for(service: Service, choices: Choices, kind: str) -> list[ChatOutput | None]:
    """Each choice's own reply splitter (a chat's; None for completions or plain content)."""
    return [chat_output(service, choices.params) if kind == CHAT else None for _ in choices.generations]


async def whole(choices: Choices, shaper: Shaper, service: Service,
                disconnected: Disconnected) -> dict[str, Any]:
    """The non-streamed answer: every choice collected, the best `n` kept when best_of asks for more."""
    collected = [Collected() for _ in choices.generations]
    async for batch in choices.batches(disconnected):
        for index, item in batch:
            collected[index].take(item)
    outputs = outputs_for(service, choices, shaper.kind)
    kept = best(choices.generations, choices.params.n)
    bodies = [collected[i].body(shaper.for_choice(rank), choices.generations[i], outputs[i])
              for rank, i in enumerate(kept)]
    body = bodies[0]
    body["choices"] = [one["choices"][0] for one in bodies]
    body["usage"] = total(collected[i].finish for i in kept).to_json()
    return body


def best(generations: list[Generation], n: int) -> list[int]:
    """The indexes of the `n` choices to return: all of them in order, or with best_of the n whose tokens'
    logprobs sum highest, best first."""
    if len(generations) == n:
        return list(range(n))
    scores = [sum(entry[1] for entry in generation.logprobs) for generation in generations]
    return sorted(range(len(generations)), key=lambda i: -scores[i])[:n]


def total(finishes: Iterable[Finish | None]) -> Usage:
    """The usage of several choices of one prompt: the prompt once, every completion token, the first's cache."""
    usages = [finish.usage for finish in finishes if finish is not None]
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), usages[0].cached_tokens)


async def streamed(choices: Choices, shaper: Shaper, service: Service) -> AsyncIterator[bytes]:
    """The stream body of several choices (module docstring); one wake-up's chunks go out as one body write."""
    prompt = list(choices.params.prompt)
    streams = [ChoiceChunks(shaper.for_choice(i), prompt, output)
               for i, output in enumerate(outputs_for(service, choices, shaper.kind))]
    parts = [chunk for stream in streams for chunk in stream.start()]
    finishes: list[Finish | None] = [None] * len(streams)
    try:
        async for batch in choices.batches():
            for index, item in batch:
                parts += streams[index].push(item)
                if isinstance(item, Finish):
                    finishes[index] = item
            if parts and not choices.finished:  # the last batch leaves with [DONE]
                yield b"".join(parts)
                parts = []
        if choices.params.include_usage:
            parts.append(event(shaper.usage_chunk(total(finishes))))
    except EngineFailed as err:
        parts.append(failed(choices.id, err))
    parts.append(DONE)
    yield b"".join(parts)


class ChoicesStream(EventStream):
    """The SSE answer of several choices; as EventStream, it cancels every choice however the stream ends."""

    def __init__(self, choices: Choices, shaper: Shaper, service: Service) -> None:
        StreamingResponse.__init__(self, streamed(choices, shaper, service), media_type="text/event-stream",
                                   headers=HEADERS)
        self.generation = choices
