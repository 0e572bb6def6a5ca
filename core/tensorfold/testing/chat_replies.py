"""What a model was trained to write, for testing reply parsers: an assistant message rendered through a real chat
template (as the server renders prompts), less what the generation prompt already wrote; and a check that a
stream gives the same parts as the whole parse whatever the chunking.

Only tests import this module (docs/hooks.md, "Writing a tool parser").
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from tensorfold.chat.api import ChatFormat, ContentDelta, ReasoningDelta, ReplyParts, ToolCall, ToolCallDelta
from tensorfold.chat.blocks import collect
from tensorfold.chat.reply import ReplySplitter
from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold.tokenizer import ChatTokenizer

TURN_ENDS = ("<|im_end|>", "<|endoftext|>", "<|user|>", "<|observation|>", "<SPECIAL_12>")
TOOL_RESULT = {"role": "tool", "content": "ok"}


def function(name: str, **properties: Any) -> dict[str, Any]:
    """An OpenAI tool entry with these parameter schemas."""
    return {"type": "function", "function": {"name": name, "description": f"{name} for the tests",
                                             "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    function("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"},
             where={"type": "object"}, hours={"type": "array", "items": {"type": "integer"}},
             scale={"type": "number"}, unit={"anyOf": [{"type": "string"}, {"type": "null"}]}),
    function("search", query={"type": "string"}, limit={"type": ["integer", "null"]}),
    function("run_code", code={"type": "string"}),
    function("now"),
]
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is the weather?"}


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """An assistant message's tool call, arguments as a mapping (how HF templates take them)."""
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant(content: str = "", *calls: dict[str, Any], reasoning: str | None = None) -> dict[str, Any]:
    """An assistant message with content, calls and (when given) reasoning_content."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": list(calls)}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


# a thinking model's reply with content and two calls, typed values and unicode among them
THINKING_CALLS = assistant("Checking both — ünïcode ☔.", call("get_weather", city="Zürich", days=3, metric=True,
                                                                 where={"lat": 47.4, "tags": ["lake", None]}),
                           call("search", query="föhn\nwind", limit=5),
                           reasoning="Two lookups.\nWeather first, then a <tool_call> search.")


CALLS = assistant(THINKING_CALLS["content"], *THINKING_CALLS["tool_calls"])     # the same without reasoning


def expected(message: Mapping[str, Any], with_reasoning: bool = False) -> ReplyParts:
    """The parts a parser should find in `message` as rendered: its content (the templates trim it), its calls'
    arguments as compact JSON in their order, and its reasoning when the template renders it."""
    calls = tuple(ToolCall(id="", name=c["function"]["name"],
                           arguments=json.dumps(c["function"]["arguments"], ensure_ascii=False))
                  for c in message["tool_calls"])
    reasoning = message.get("reasoning_content") if with_reasoning else None
    return ReplyParts(content=message["content"].strip(), reasoning=reasoning, tool_calls=calls)


def template_tokenizer(template: Path, directory: Path) -> ChatTokenizer:
    """A ChatTokenizer that renders `template` (the tiny tokenizer underneath: only the text matters here)."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "tokenizer.json").exists():
        write_tiny_tokenizer(directory, 512)
    shutil.copyfile(template, directory / "chat_template.jinja")
    return ChatTokenizer(directory)


@attrs.frozen
class TrainedReply:
    """An assistant turn as the model writes it: its text and whether the prompt left it inside reasoning."""

    text: str
    starts_open: bool
    prompt: str


def trained_reply(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], assistant: Mapping[str, Any],
                  think_start: str | None = None, **kwargs: Any) -> TrainedReply:
    """`assistant` as the template writes it after `messages` (a tool result follows it, so templates render it as
    history, reasoning included), without the part the generation prompt already wrote and the turn's end token."""
    prompt = tokenizer.render(list(messages), add_generation_prompt=True, **kwargs)
    full = tokenizer.render([*messages, assistant, TOOL_RESULT], add_generation_prompt=False, **kwargs)
    shared = os.path.commonprefix([prompt, full])
    while shared != prompt and shared and shared[-1] not in "\n>":    # not inside a marker both begin
        shared = shared[:-1]
    text = full[len(shared):]
    ends = [at for end in TURN_ENDS if (at := text.find(end)) != -1]
    text = text[:min(ends)] if ends else text
    opened = think_start is not None and shared.rstrip("\n").endswith(think_start)
    return TrainedReply(text=text, starts_open=opened, prompt=prompt)


def call_tuple(call: ToolCall) -> tuple[str, str]:
    """A call without its random id, to compare parses."""
    return call.name, call.arguments


def chunkings(text: str, seed: int = 0, random_ones: int = 25) -> Iterator[list[str]]:
    """Ways to feed `text` to a stream: whole, one character at a time, cut in two at every place, and
    `random_ones` random chunkings."""
    yield [text]
    yield list(text)
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    rng = random.Random(seed)
    for _ in range(random_ones):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 16)))) if text else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream_parts(push: Callable[[str], list], finish: Callable[[], list], pieces: Sequence[str]) -> ReplyParts:
    """What a client puts together from a stream fed `pieces`: content, reasoning (None if none) and calls."""
    deltas = [delta for piece in pieces for delta in push(piece)] + finish()
    assert all(d.text for d in deltas if isinstance(d, ContentDelta | ReasoningDelta)), "an empty delta went out"
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) or None
    content, calls = collect([d for d in deltas if isinstance(d, ContentDelta | ToolCallDelta)])
    indexes = [d.index for d in deltas if isinstance(d, ToolCallDelta) and d.id is not None]
    assert indexes == list(range(len(indexes))), f"calls out of order: {indexes}"
    return ReplyParts(content=content, reasoning=reasoning, tool_calls=calls)


def same_parts(a: ReplyParts, b: ReplyParts) -> bool:
    """Equal parts, call ids aside (each parse draws its own)."""
    return (a.content, a.reasoning, [call_tuple(c) for c in a.tool_calls]) == (
        b.content, b.reasoning, [call_tuple(c) for c in b.tool_calls])


def check_template(format: ChatFormat, template: Path, directory: Path,
                   message: Mapping[str, Any] = THINKING_CALLS, **kwargs: Any) -> tuple[ReplyParts, TrainedReply]:
    """The parts `format` finds in `message` as `template` renders it (with TOOLS), split whole, after checking
    that a stream gives the same parts in every chunking; and the rendered reply."""
    reply = trained_reply(template_tokenizer(template, directory), [SYSTEM, USER], message, format.think_start,
                          tools=TOOLS, **kwargs)
    whole = ReplySplitter(format, TOOLS, reply.starts_open).split_whole(reply.text)
    for pieces in chunkings(reply.text, seed=len(reply.text), random_ones=10):
        splitter = ReplySplitter(format, TOOLS, reply.starts_open)
        assert same_parts(stream_parts(splitter.push, splitter.finish, pieces), whole), pieces
    return whole, reply


def check_tiny(format: ChatFormat, directory: Path) -> str:
    """A family's tiny checkpoint (in `directory`) against its format: the generation prompt its template renders
    (returned) leaves no reasoning open, so the tiny model's replies are content."""
    prompt = ChatTokenizer(directory).render([SYSTEM, USER], tools=TOOLS)
    assert format.think_start is None or not prompt.rstrip("\n").endswith(format.think_start), prompt
    text = "Hello! How are you today?\n"
    assert ReplySplitter(format, TOOLS, starts_open=False).split_whole(text) == ReplyParts(content=text)
    return prompt


def family_format(name: str, directory: Path) -> ChatFormat:
    """The installed family `name`'s chat format for its tiny checkpoint (written to `directory`), after
    `check_tiny` on it."""
    from tensorfold.checkpoint import Checkpoint
    from tensorfold.plugins import load_families

    family = load_families([name])[name]
    family.make_tiny(directory)
    found = family.chat_format(Checkpoint(directory).config)
    check_tiny(found, directory)
    return found
