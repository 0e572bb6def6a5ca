"""Request starts: where each message (and the generated turn) starts in a rendered chat prompt, proven by an
exact token prefix; a start that cannot be proven is skipped, never guessed."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from starlette.testclient import TestClient

from tensorfold.engine.api import Request
from tensorfold.server import build_app
from tensorfold.server.starts import message_starts
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
    assert starts == message_starts(chatml, CHAT, prompt, {})[1:]  # only the start after the system message goes


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
