"""Request starts: where each message (and the generated turn) starts in a rendered chat prompt, proven by an
exact token prefix; a start that cannot be proven is skipped, never guessed."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from starlette.testclient import TestClient

from tensorfold.chat.start_cache import Entry, StartCache
from tensorfold.engine.api import Request
from tensorfold.server import build_app
from tensorfold.server.starts import direct_positions, keep_marks, message_starts, start_positions
from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold.tokenizer import ChatTokenizer

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is."},
        {"role": "user", "content": "Tell me a story about a cat."}]


def tokenizer_with(directory: Path, template: str | None = None) -> ChatTokenizer:
    write_tiny_tokenizer(directory, 512)
    if template is not None:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return ChatTokenizer(directory)


def prompt_of(tok: ChatTokenizer, messages, **kwargs) -> tuple[str, list[int]]:
    text = tok.render(messages, add_generation_prompt=True, **kwargs)
    return text, tok.encode(text)


def test_chatml_every_message_and_the_generated_turn_start(tmp_path):
    tok = tokenizer_with(tmp_path)
    text, prompt = prompt_of(tok, CHAT)
    starts = message_starts(tok, CHAT, prompt, {}, text)
    im_start = tok.tokenizer.token_to_id("<|im_start|>")
    assert len(starts) == len(CHAT)  # messages 1..3 and the reply's turn; message 0 starts at 0, no cut
    assert all(prompt[s] == im_start for s in starts)
    for i, start in enumerate(starts, start=1):
        assert prompt[:start] == tok.encode(tok.render(CHAT[:i], add_generation_prompt=False))
    generated = starts[-1]
    assert tok.decode(prompt[generated:]) == "assistant\n" and generated < len(prompt)
    assert message_starts(tok, CHAT, prompt, {}) == starts  # the text pre-check changes nothing


def test_one_message_gives_only_the_generated_turn(tmp_path):
    tok = tokenizer_with(tmp_path)
    messages = [{"role": "user", "content": "Hello!"}]
    text, prompt = prompt_of(tok, messages)
    assert message_starts(tok, messages, prompt, {}, text) == (len(tok.encode(tok.render(messages, False))),)


def test_a_template_that_renders_the_last_message_differently_loses_those_starts(tmp_path):
    # Like a template that drops reasoning from all but the last turn: a prefix renders its last message
    # differently from the full prompt, so those starts are not proven and are skipped.
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if loop.last %}{{ '[last] ' }}"
                "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok = tokenizer_with(tmp_path, template)
    text, prompt = prompt_of(tok, CHAT)
    whole = len(tok.encode(tok.render(CHAT, add_generation_prompt=False)))
    assert message_starts(tok, CHAT, prompt, {}, text) == (whole,)
    assert message_starts(tok, CHAT, prompt, {}) == (whole,)


def test_a_template_that_refuses_a_prefix_skips_that_start(tmp_path):
    template = ("{% if messages[-1]['role'] == 'system' %}{{ raise_exception('a chat needs a user turn') }}"
                "{% endif %}{% for m in messages %}"
                "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok = tokenizer_with(tmp_path, template)
    text, prompt = prompt_of(tok, CHAT)
    starts = message_starts(tok, CHAT, prompt, {}, text)
    chatml = tokenizer_with(tmp_path / "chatml")
    # The system-only prefix is refused on its own but accepted followed by a user probe: its end is still found.
    assert starts == message_starts(chatml, CHAT, prompt, {})
    assert direct_positions(tok, CHAT, prompt, {}, text, True).get(1) is None  # the old rule lost it


def test_a_start_whose_tokens_merge_across_the_boundary_is_skipped(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = tokenizer_with(tmp_path, template)
    merged = [{"role": "user", "content": "Hel"}, {"role": "user", "content": "lo"}]
    text, prompt = prompt_of(tok, merged)
    assert tok.encode("Hel") != prompt[:len(tok.encode("Hel"))]  # "Hello" tokenizes across the boundary
    assert message_starts(tok, merged, prompt, {}, text) == ()
    clean = [{"role": "user", "content": "Par"}, {"role": "user", "content": "is is."}]
    text, prompt = prompt_of(tok, clean)
    assert message_starts(tok, clean, prompt, {}, text) == (len(tok.encode("Par")),)


def test_template_kwargs_reach_every_prefix(tmp_path):
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (prefix or '') + m['content'] + "
                "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")
    tok = tokenizer_with(tmp_path, template)
    text, prompt = prompt_of(tok, CHAT, prefix="Monday ")
    assert len(message_starts(tok, CHAT, prompt, {"prefix": "Monday "}, text)) == len(CHAT)


class Recorder:
    """The real engine behind a submit that keeps each request."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.requests: list[Request] = []

    def submit(self, request: Request) -> None:
        self.requests.append(request)
        self.engine.submit(request)

    def snapshot(self):
        return self.engine.snapshot()


@pytest.mark.parametrize("switch", [True, False], ids=["switch-on", "switch-off"])
def test_chat_requests_carry_starts_with_the_switch_and_completions_never(loaded, tokenizer, switch):
    assert loaded.service.request_starts  # the fixture serves with TF_EXAMPLE_REQUEST_STARTS=1
    recorder = Recorder(loaded.engine)
    service = attrs.evolve(loaded.service, engine=recorder, request_starts=switch)
    messages = CHAT[:3] + [{"role": "user", "content": "Why?"}]
    with TestClient(build_app(service)) as http:
        reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
        reply = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    chat, completion = recorder.requests
    text, prompt = prompt_of(tokenizer, messages)
    assert list(chat.prompt) == prompt
    assert chat.starts == (message_starts(tokenizer, messages, prompt, {}, text) if switch else ())
    assert len(chat.starts) == (len(messages) if switch else 0)
    assert completion.starts == ()


TEMPLATES = Path(__file__).parents[1] / "core" / "chat" / "templates"
# Each vendor template, the special tokens its real tokenizer has (added to the tiny one, so headers are single
# tokens as they are in the checkpoint) and the text of a user message's header, to find the starts independently.
VENDOR = {
    "Qwen3.5-4B": (("<|im_start|>", "<|im_end|>"), ("<think>", "</think>", "<tool_call>", "</tool_call>",
                                                    "<tool_response>", "</tool_response>"), "<|im_start|>user"),
    "GLM-4.7-Flash": (("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
                      ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                       "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"), "<|user|>"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": (("<|im_start|>", "<|im_end|>"),
                                            ("<think>", "</think>", "<tool_call>", "</tool_call>",
                                             "<tool_response>", "</tool_response>"), "<|im_start|>user"),
    "NVIDIA-Nemotron-Nano-v2": (("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"),
                                ("<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>"), "<SPECIAL_11>User"),
}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    # the rewind cut follows an assistant message, which a prefix ending there renders as the current turn
    "plain": ([*CHAT[:2], {"role": "assistant", "content": "Paris is.", "reasoning_content": "A capital."},
               CHAT[3]], {}),
    "tools": ([CHAT[0], CHAT[1],
               {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "Sunny, 20 C."},
               {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Tell them."},
               {"role": "user", "content": "Why is the sky blue?"}], {"tools": TOOLS}),
    "system-only-then-user": ([CHAT[0], CHAT[1]], {}),
}


def vendor_tokenizer(directory: Path, name: str) -> ChatTokenizer:
    from tokenizers import AddedToken, Tokenizer

    specials, plain, _ = VENDOR[name]
    write_tiny_tokenizer(directory, 512)
    inner = Tokenizer.from_file(str(directory / "tokenizer.json"))
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    inner.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    inner.save(str(directory / "tokenizer.json"))
    return ChatTokenizer(directory, template=(TEMPLATES / f"{name}.jinja").read_text())


def header_positions(tok: ChatTokenizer, prompt: list[int], header: str) -> list[int]:
    """Where the user header's tokens stand in the prompt: found in the whole prompt, not by the rule."""
    ids = tok.encode(header)
    return [i for i in range(len(prompt) - len(ids) + 1) if prompt[i:i + len(ids)] == ids]


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(VENDOR))
def test_vendor_templates_find_the_rewind_and_system_ends(tmp_path, name, conversation):
    tok = vendor_tokenizer(tmp_path, name)
    messages, kwargs = CONVERSATIONS[conversation]
    text, prompt = prompt_of(tok, messages, **kwargs)
    assert tok.decode(prompt) == tok.tokenizer.decode(tok.encode(text))  # the tiny tokenizer encodes the template
    positions = start_positions(tok, messages, prompt, kwargs, text)
    marks = keep_marks(messages, positions)
    users = header_positions(tok, prompt, VENDOR[name][2])
    assert users, "the user header is in the prompt"
    assert marks.rewind == users[-1]  # the latest user message's header
    assert marks.system == users[0]  # the first non-system message is the first user message
    assert marks.history is not None and marks.history < len(prompt)
    assert sorted(positions) == list(range(1, len(messages) + 1))  # every message's start and the reply's
    for start in positions.values():  # every start is a true prefix of the prompt
        head = tok.tokenizer.decode(prompt[:start], skip_special_tokens=False)
        assert text.startswith(head) and tok.encode(head) == prompt[:start]


def test_vendor_template_probes_find_more_than_the_prefix_alone(tmp_path):
    tok = vendor_tokenizer(tmp_path, "Qwen3.5-4B")
    messages, kwargs = CONVERSATIONS["plain"]
    text, prompt = prompt_of(tok, messages, **kwargs)
    old = direct_positions(tok, messages, prompt, kwargs, text, True)
    new = start_positions(tok, messages, prompt, kwargs, text)
    assert 1 not in old and 3 not in old  # "No user query found"; the assistant rendered with a think block
    assert {1, 2, 3, 4} <= set(new) and all(old[i] == new[i] for i in old)


class Counting(ChatTokenizer):
    """The real tokenizer, counting what it renders and encodes (and how much), its tokenizers.Tokenizer too."""

    renders = encoded = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer = CountingInner(self.tokenizer, self)

    def render(self, messages, add_generation_prompt=True, template=None, **kwargs):
        self.renders += 1
        return super().render(messages, add_generation_prompt, template, **kwargs)

    def encode(self, text, specials=True):
        if not specials:  # an encode with specials goes through the counted tokenizers.Tokenizer
            self.encoded += len(text)
        return super().encode(text, specials)


class CountingInner:
    def __init__(self, inner, counts: Counting) -> None:
        self.inner, self.counts = inner, counts

    def encode(self, text, *args, **kwargs):
        self.counts.encoded += len(text)
        return self.inner.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def agent_chat(turns: int) -> list[dict]:
    messages = [CHAT[0]]
    for t in range(turns):
        messages += [{"role": "user", "content": f"Tell me a story about a cat, part {t}."},
                     {"role": "assistant", "content": f"Once upon a time, part {t}."}]
    return messages + [{"role": "user", "content": "Why is the sky blue?"}]


def counting(tmp_path: Path, name: str) -> Counting:
    if name == "chatml":
        write_tiny_tokenizer(tmp_path, 512)
        return Counting(tmp_path)
    vendor_tokenizer(tmp_path, name)
    return Counting(tmp_path, template=(TEMPLATES / f"{name}.jinja").read_text())


@pytest.mark.parametrize("name", ["chatml", "Qwen3.5-4B"])
def test_the_next_turn_proves_only_the_new_messages(tmp_path, name):
    tok = counting(tmp_path, name)
    cost = {}
    for turns in (5, 25):
        cache = StartCache()
        first = agent_chat(turns)
        text, prompt = prompt_of(tok, first)
        assert start_positions(tok, first, prompt, {}, text, cache=cache)
        nxt = first + [{"role": "assistant", "content": "Because air scatters blue."},
                       {"role": "user", "content": "Write a poem about the sea."}]
        text, prompt = prompt_of(tok, nxt)
        tok.renders = tok.encoded = 0
        cached = start_positions(tok, nxt, prompt, {}, text, cache=cache)
        cost[turns] = (tok.renders, tok.encoded)
        assert cached == start_positions(tok, nxt, prompt, {}, text)  # the same starts as proven from scratch
        assert len(cached) == len(nxt)
    # renders and text encoded (the prompt is not encoded again): the new messages', whatever the history's length
    assert cost[5] == cost[25]
    assert cost[25][0] <= 2 * 3  # three new starts (two messages and the reply), a probe render each at most
    assert cost[25][1] < 100  # only the text since the last special token before each new start


def test_a_long_cold_chat_proves_its_marks_and_newest_starts_within_the_budget(tmp_path):
    tok = counting(tmp_path, "Qwen3.5-4B")
    messages = agent_chat(30)
    text, prompt = prompt_of(tok, messages)
    tok.renders = 0
    found = start_positions(tok, messages, prompt, {}, text, budget=8)
    assert tok.renders <= 2 * 8 + 8  # probes for 8 starts, and the probe tails learned once
    n = len(messages)
    assert {1, n - 1, n} <= set(found) and len(found) == 8  # system end, rewind, reply; then the newest
    assert set(found) - {1} == set(range(n - 6, n + 1))


def test_a_turn_that_rewrites_older_turns_falls_back_to_an_older_entry(tmp_path):
    # Qwen3.5 keeps the reasoning of the tool-calling turns after the latest user message and drops it once a new
    # user message comes: the last turn's entry no longer matches the text, an earlier turn's still does.
    tok = counting(tmp_path, "Qwen3.5-4B")
    cache = StartCache()
    messages = agent_chat(10)
    step = [{"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "Sunny, 20 C."}]
    grown = [messages]  # the agent's turns: a tool result, then a user message, twice
    for turn in range(2):
        grown.append(grown[-1] + step)
        grown.append(grown[-1] + [{"role": "assistant", "content": "Sunny."},
                                  {"role": "user", "content": f"And tomorrow, {turn}?"}])
    for turn, messages in enumerate(grown):
        text, prompt = prompt_of(tok, messages)
        tok.renders = 0
        found = start_positions(tok, messages, prompt, {}, text, cache=cache)
        renders = tok.renders
        assert found == start_positions(tok, messages, prompt, {}, text)
        assert sorted(found) == list(range(1, len(messages) + 1))
        if turn % 2 == 0 and turn:  # the tool-calling turn lost its reasoning: back to the turn before it
            assert 5 <= renders <= 2 * 5  # from message 22 on (the last entry would have left only 3)
        elif turn:
            assert renders <= 2 * 3


def test_the_start_cache_is_bounded_by_the_starts_it_holds():
    cache = StartCache(entries=100, starts=10)
    for n in range(6):
        cache.put(bytes([n]), Entry({i: (i, i) for i in range(1, 5)}, 4, b""))
    assert len(cache) == 2 and cache.get(bytes([5])) is not None and cache.get(bytes([0])) is None
