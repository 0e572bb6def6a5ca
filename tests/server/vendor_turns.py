"""Multi-turn chat scenarios for real servers rendering real vendor chat templates (test_server_vendor_turns.py).

A Session sends a conversation's requests through the official openai client and keeps every prompt it sent. For
each request it works out, from the prompts alone through the server's `/tokenize`, the least the server must
resume: the last message start the new prompt shares with an earlier prompt of the session. A message start is
where the tokens of the messages before it end inside the prompt, whatever comes next: the prefix rendered on its
own when its tokens are the prompt's first ones, else the prefix rendered followed by probe messages (the role that
comes next, and a user message when one comes later, so the template renders the prefix as the history it is in
the prompt), less the tokens the probes add after a one-message chat. A start two prompts share is one where both
prompts hold it and their tokens agree up to it.

The families' tiny checkpoints ship a tiny byte-level tokenizer whose only special tokens are ChatML's; a vendor
whose template opens its messages with other header tokens (GLM's `<|user|>`, `<|assistant|>`, …) gets them as
special tokens (`with_specials`), as the vendor's own tokenizer has them, so a header is a token of its own and
never merges with the text before it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tensorfold.plugins import load_families
from tensorfold.ports import free_port
from tensorfold.testing.process import healthy, tail
from tensorfold.testing.tiny_tokenizer import CORPUS, SPECIALS

TEMPLATES = Path(__file__).resolve().parents[1] / "core" / "chat" / "templates"
NO_TIERS = ("--prompt-cache-gib", "0", "--host-cache-gib", "0")  # every tier off: nothing is kept or resumed
TEXT_TOKENS = 6  # max_tokens of a reply that is text or reasoning
CALL_TOKENS = 24  # max_tokens of a forced call: room for its whole JSON arguments
START_S = 180.0
PROBE_TEXT = "Sunday probe"
FIRST = {"role": "user", "content": "Hello"}
GLM_HEADERS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a word up", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["word"],
    "properties": {"word": {"type": "string", "enum": ["tide", "reef", "gale"]}}}}}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                   "days": {"type": "integer", "enum": [1, 2, 3]}}}}}
TOOLS = (LOOKUP, WEATHER)


@attrs.frozen
class Vendor:
    """A vendor template on a family's tiny checkpoint, its keep-reasoning kwargs (None: none) and header tokens."""

    family: str
    template: str
    keep_reasoning: Mapping[str, Any] | None = None
    specials: tuple[str, ...] = ()


VENDORS = {
    "qwen3.5": Vendor("qwen", "Qwen3.5-4B.jinja"),
    "glm-4.7": Vendor("glm", "GLM-4.7-Flash.jinja", {"clear_thinking": False}, GLM_HEADERS),
    "nemotron-3": Vendor("nemotron", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
                         {"truncate_history_thinking": False}),
}


def with_specials(directory: Path, specials: Sequence[str]) -> None:
    """Retrain a tiny checkpoint's tokenizer with `specials` after ChatML's (ids kept), the vocabulary size kept."""
    if not specials:
        return
    size = json.loads((directory / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[*SPECIALS, *specials], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = CORPUS.split()
    tokenizer.train_from_iterator([CORPUS] + [" ".join(words[i::k]) for k in range(2, 9) for i in range(k)],
                                  trainer=trainer)
    assert tokenizer.get_vocab_size() == size
    tokenizer.save(str(directory / "tokenizer.json"))


def make_checkpoint(vendor: Vendor, directory: Path) -> Path:
    """The family's tiny checkpoint (seed 0) in `directory`, with the vendor's header tokens."""
    load_families([vendor.family])[vendor.family].make_tiny(directory, seed=0)
    with_specials(directory, vendor.specials)
    return directory


@contextlib.contextmanager
def serving_all(runs: Sequence[tuple[Sequence[str], Path]]) -> Iterator[list[str]]:
    """Start `tensorfold serve ARGS` for each (ARGS, log) at once; yield their base URLs once all answer /health."""
    started: list[tuple[subprocess.Popen, str, Path]] = []
    try:
        for args, log in runs:
            url = f"http://127.0.0.1:{(port := free_port())}"
            with log.open("a") as out:
                process = subprocess.Popen([sys.executable, "-m", "tensorfold", "serve", *args, "--port", str(port)],
                                           stdout=out, stderr=subprocess.STDOUT,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
            started.append((process, url, log))
        deadline = time.monotonic() + START_S
        for process, url, log in started:
            while not healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tensorfold serve did not come up (exit {process.poll()}):\n{tail(log)}")
                time.sleep(0.1)
        yield [url for _, url, _ in started]
    finally:
        for process, _, _ in started:
            process.terminate()
        for process, _, _ in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def user(text: str) -> dict[str, Any]:
    """A user message."""
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, Any]:
    """A system message."""
    return {"role": "system", "content": text}


def tool_result(call_id: str, text: str) -> dict[str, Any]:
    """A tool message answering the call `call_id`."""
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def probe(role: str) -> dict[str, Any]:
    """A message of `role` with the probe's text."""
    message = {"role": role, "content": PROBE_TEXT}
    if role == "tool":
        message["tool_call_id"] = "probe"
    return message


@attrs.frozen
class Sent:
    """A prompt a session sent, and its message starts (index → token position)."""

    prompt: tuple[int, ...]
    starts: Mapping[int, int]


@attrs.frozen
class Turn:
    """One request: its reply, cached_tokens and, measured, its prompt's starts and the least it must resume."""

    name: str
    content: str | None
    reasoning: str | None
    calls: tuple[tuple[str, str], ...]
    finish: str
    cached: int
    starts: Mapping[int, int]
    expected: int
    size: int
    latest_user: int

    @property
    def reply(self) -> tuple[Any, ...]:
        """What two servers must agree on."""
        return self.content, self.reasoning, self.calls, self.finish

    @property
    def history_end(self) -> int | None:
        """Where the generated turn starts: the next turn's resume point."""
        return self.starts.get(self.size)

    @property
    def latest_user_start(self) -> int | None:
        """Where the latest user message starts: an edited or regenerated turn resumes there."""
        return self.starts.get(self.latest_user)

    def call_ids(self) -> list[str]:
        """Fixed ids for this reply's calls (the server's are random; the history must be the same on both)."""
        return [f"{self.name}-{k}" for k in range(len(self.calls))]

    def assistant(self, reasoning: str = "field", arguments: str = "string",
                  extra_calls: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> dict[str, Any]:
        """The reply as an assistant message, reasoning and arguments sent as asked, a harness's `extra_calls` added."""
        content = self.content or ""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning and reasoning == "field":
            message["reasoning_content"] = self.reasoning
        elif self.reasoning:
            message["content"] = f"<think>\n{self.reasoning}\n</think>\n\n{content}"
        calls = [*self.calls, *((name, json.dumps(args)) for name, args in extra_calls)]
        if calls:
            message["tool_calls"] = [
                {"id": f"{self.name}-{k}", "type": "function",
                 "function": {"name": name, "arguments": args if arguments == "string" else json.loads(args)}}
                for k, (name, args) in enumerate(calls)]
        return message


class Session:
    """Requests to one server; with `measure`, each turn's least resume is worked out from the prompts."""

    def __init__(self, url: str, measure: bool) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=url, timeout=120)
        self.model = self.client.models.list().data[0].id
        self.measure = measure
        self.sent: list[Sent] = []
        self._tokens: dict[str, tuple[int, ...] | None] = {}

    def close(self) -> None:
        """Close both HTTP clients."""
        self.client.close()
        self.http.close()

    def ask(self, name: str, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
            choice: str | Mapping[str, Any] | None = None, kwargs: Mapping[str, Any] | None = None) -> Turn:
        """Send one greedy request; its Turn."""
        forced = isinstance(choice, Mapping)
        reply = self.client.chat.completions.create(
            model=self.model, messages=[dict(m) for m in messages], temperature=0,
            max_tokens=CALL_TOKENS if forced else TEXT_TOKENS, tools=[dict(t) for t in tools] or openai.NOT_GIVEN,
            tool_choice=choice if choice is not None else openai.NOT_GIVEN,
            extra_body={"chat_template_kwargs": dict(kwargs)} if kwargs else None)
        choice_ = reply.choices[0]
        message = choice_.message
        calls = tuple((c.function.name, c.function.arguments) for c in message.tool_calls or ())
        reasoning = (message.model_extra or {}).get("reasoning_content")
        cached = reply.usage.prompt_tokens_details.cached_tokens or 0
        starts: dict[int, int] = {}
        expected = 0
        if self.measure:
            prompt = self.tokens(messages, tools, kwargs, generation=True)
            assert prompt is not None and len(prompt) == reply.usage.prompt_tokens
            starts = self.starts(messages, tools, kwargs, prompt)
            expected = self.shared(prompt, starts)
            self.sent.append(Sent(prompt, starts))
        latest_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        return Turn(name, message.content, reasoning, calls, choice_.finish_reason, cached, starts, expected,
                    len(messages), latest_user)

    def tokens(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
               kwargs: Mapping[str, Any] | None, generation: bool) -> tuple[int, ...] | None:
        """The server's tokens of the rendered messages; None where the template refuses them."""
        body: dict[str, Any] = {"messages": list(messages), "add_generation_prompt": generation}
        if tools:
            body["tools"] = list(tools)
        if kwargs:
            body["chat_template_kwargs"] = dict(kwargs)
        key = json.dumps(body, sort_keys=True)
        if key not in self._tokens:
            answer = self.http.post("/tokenize", json=body)
            if answer.status_code == 400:
                self._tokens[key] = None
            else:
                answer.raise_for_status()
                self._tokens[key] = tuple(answer.json()["tokens"])
        return self._tokens[key]

    def starts(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
               kwargs: Mapping[str, Any] | None, prompt: tuple[int, ...]) -> dict[int, int]:
        """Message index → where it starts in `prompt` (index len(messages): the generated turn), 1 ≤ index."""
        n = len(messages)
        later_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        found: dict[int, int] = {}
        for i in range(1, n + 1):
            role = str(messages[i]["role"]) if i < n else "assistant"
            shapes = [(role, "user"), (role,)] if later_user > i and role != "user" else [(role,)]
            at = self.alone(messages[:i], tools, kwargs, prompt)
            for roles in shapes:
                if at is None:
                    at = self.probed(messages[:i], roles, tools, kwargs, prompt)
            if at is not None:
                found[i] = at
        return found

    def alone(self, prefix: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
              kwargs: Mapping[str, Any] | None, prompt: tuple[int, ...]) -> int | None:
        """The prefix's own tokens' length, when they are the prompt's first tokens."""
        own = self.tokens(prefix, tools, kwargs, generation=False)
        return len(own) if own and len(own) < len(prompt) and prompt[:len(own)] == own else None

    def probed(self, prefix: Sequence[Mapping[str, Any]], roles: tuple[str, ...],
               tools: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any] | None,
               prompt: tuple[int, ...]) -> int | None:
        """Where the probes of `roles` start after the prefix, when the tokens before them are the prompt's."""
        head = self.tokens([FIRST], tools, kwargs, generation=False)
        whole = self.tokens([FIRST, *map(probe, roles)], tools, kwargs, generation=False)
        rendered = self.tokens([*prefix, *map(probe, roles)], tools, kwargs, generation=False)
        if head is None or whole is None or rendered is None or whole[:len(head)] != head:
            return None
        added = whole[len(head):]
        at = len(rendered) - len(added)
        if not added or rendered[at:] != added or not 0 < at < len(prompt) or prompt[:at] != rendered[:at]:
            return None
        return at

    def shared(self, prompt: tuple[int, ...], starts: Mapping[int, int]) -> int:
        """The last message start of `prompt` that an earlier prompt holds too, their tokens equal up to it."""
        mine = set(starts.values())
        best = 0
        for earlier in self.sent:
            for at in mine & set(earlier.starts.values()):
                if at > best and prompt[:at] == earlier.prompt[:at]:
                    best = at
        return best


# ---------------------------------------------------------------- the scenarios (each a list of Turns)

def chat(s: Session, tag: str, reasoning: str, kwargs: Mapping[str, Any] | None = None) -> list[Turn]:
    """Three user turns, each reply sent back as the next request's history (`reasoning` as Turn.assistant)."""
    messages = [user(f"Tell me a story about a {tag}")]
    turns: list[Turn] = []
    for k, follow in enumerate(("And one about a dog", "Now write a poem about the sea")):
        turns.append(s.ask(f"{tag}{k}", messages, kwargs=kwargs))
        messages += [turns[-1].assistant(reasoning), user(follow)]
    turns.append(s.ask(f"{tag}2", messages, kwargs=kwargs))
    return turns


def tool_calls(s: Session, tag: str, arguments: str) -> list[Turn]:
    """A forced call, its result, an answer, then a follow-up forcing another call; arguments sent back as given."""
    forced = {"type": "function", "function": {"name": "lookup"}}
    messages = [user(f"What does the word tide mean to a {tag}")]
    turns = [s.ask(f"{tag}0", messages, TOOLS, forced)]
    messages += [turns[-1].assistant(arguments=arguments),
                 *(tool_result(i, "the rise and fall of the sea") for i in turns[-1].call_ids())]
    turns.append(s.ask(f"{tag}1", messages, TOOLS))
    messages += [turns[-1].assistant(), user("And the word reef")]
    turns.append(s.ask(f"{tag}2", messages, TOOLS, forced))
    return turns


def agent(s: Session, tag: str, kwargs: Mapping[str, Any] | None = None) -> list[Turn]:
    """An agent: a forced call, a reasoned step its harness adds two calls to, an answer; then a call and an answer."""
    messages = [system(f"You are a {tag} agent who looks words up and checks the weather"),
                user("Plan a trip to the reef in Oslo")]
    turns: list[Turn] = []
    for step, follow in ((0, None), (1, None), (2, "Now plan one to Paris"), (3, None), (4, None)):
        forced = {"type": "function", "function": {"name": "weather" if step % 2 else "lookup"}}
        turns.append(s.ask(f"{tag}{step}", messages, TOOLS, forced if step in (0, 3) else None, kwargs))
        turn = turns[-1]
        extra = [("lookup", {"word": "gale"}), ("weather", {"city": "Oslo", "days": 2})] if step == 1 else []
        messages.append(turn.assistant(arguments="object", extra_calls=extra))
        messages += [tool_result(f"{turn.name}-{k}", f"result {k} of step {step}")
                     for k in range(len(turn.calls) + len(extra))]
        if follow is not None:
            messages.append(user(follow))
    return turns


def shared_system(s: Session, tag: str, system_text: str) -> list[Turn]:
    """Two conversations on one system prompt, two turns each, one after the other."""
    turns: list[Turn] = []
    for who in ("Ann", "Bob"):
        messages = [system(system_text), user(f"I am {who}, tell me about the {tag}")]
        turns.append(s.ask(f"{tag}{who}0", messages))
        messages += [turns[-1].assistant(), user("Tell me more")]
        turns.append(s.ask(f"{tag}{who}1", messages))
    return turns


def edit(s: Session, tag: str) -> list[Turn]:
    """Two turns, then the last user message changed and sent again."""
    messages = [user(f"Tell me about the {tag}")]
    turns = [s.ask(f"{tag}0", messages)]
    messages += [turns[-1].assistant(), user("Why is the sky blue")]
    turns.append(s.ask(f"{tag}1", messages))
    turns.append(s.ask(f"{tag}2", [*messages[:-1], user("Why is the sea blue")]))
    return turns


def regenerate(s: Session, tag: str) -> list[Turn]:
    """Two turns, then the second sent again without its reply."""
    messages = [user(f"Tell me about the {tag}")]
    turns = [s.ask(f"{tag}0", messages)]
    messages += [turns[-1].assistant(), user("Write a poem about the sea")]
    turns.append(s.ask(f"{tag}1", messages))
    turns.append(s.ask(f"{tag}2", messages))
    return turns
