"""`n` and `best_of` through the real openai client on a real server: choice i of a seeded request is the n=1
request with seed + i, streamed choices reassemble into the whole answer, usage counts the prompt once and every
returned completion token, best_of returns the choice whose tokens' logprobs sum highest, and the refusals name
the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from tensorfold.testing.fuzz_http import idle_memory

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Tell me about the sea."}]
PROMPT = "The sea is"
SEED = 1234
HOT = {"temperature": 1.0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}


def chat(client, model, **fields):
    return client.chat.completions.create(model=model, messages=ASK, **{**HOT, **fields})


def text(client, model, **fields):
    return client.completions.create(model=model, prompt=PROMPT, **{**HOT, **fields})


def reassembled(chunks, field: str) -> tuple[dict[int, str], dict[int, list[str]], dict[int, int]]:
    """Per choice index: its text, its finish reasons, and how many role chunks it had."""
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    roles: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content if field == "delta" else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
            if field == "delta" and choice.delta.role == "assistant":
                roles[choice.index] = roles.get(choice.index, 0) + 1
    return texts, reasons, roles


def test_chat_n_choices_are_the_seeded_singles(client, model):
    reply = chat(client, model, n=3, seed=SEED)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in reply.choices)
    singles = [chat(client, model, seed=SEED + i) for i in range(3)]
    assert [c.message.content for c in reply.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in reply.choices}) == 3
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == 30
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 30
    assert chat(client, model, n=3, seed=SEED).choices == reply.choices  # reproducible


def test_chat_stream_reassembles_into_the_whole_answer(client, model):
    whole = chat(client, model, n=3, seed=SEED)
    chunks = list(chat(client, model, n=3, seed=SEED, stream=True, stream_options={"include_usage": True}))
    texts, reasons, roles = reassembled(chunks, "delta")
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {0: ["length"], 1: ["length"], 2: ["length"]} and roles == {0: 1, 1: 1, 2: 1}
    assert all(chunk.usage is None for chunk in chunks[:-1]) and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 30)
    assert len({chunk.id for chunk in chunks}) == 1
    indexes = [chunk.choices[0].index for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert indexes != sorted(indexes)  # the choices' chunks interleave: one engine step makes a token of each


def test_completion_n_choices_streamed_and_whole(client, model):
    whole = text(client, model, n=3, seed=SEED)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.choices[0].text == text(client, model, seed=SEED).choices[0].text
    assert whole.choices[2].text == text(client, model, seed=SEED + 2).choices[0].text
    assert whole.usage.completion_tokens == 30
    chunks = list(text(client, model, n=3, seed=SEED, stream=True, stream_options={"include_usage": True}))
    texts, reasons, _ = reassembled(chunks, "text")
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_greedy_choices_are_equal(client, model):
    reply = chat(client, model, n=4, temperature=0)
    assert len({c.message.content for c in reply.choices}) == 1
    assert reply.choices[0].message.content == chat(client, model, temperature=0).choices[0].message.content


def test_each_choice_has_its_own_logprobs(client, model):
    reply = chat(client, model, n=2, seed=SEED, logprobs=True, top_logprobs=2)
    for choice in reply.choices:
        assert len(choice.logprobs.content) == 10
        assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content
    single = chat(client, model, seed=SEED + 1, logprobs=True, top_logprobs=2).choices[0]
    assert [e.logprob for e in reply.choices[1].logprobs.content] == [e.logprob for e in single.logprobs.content]


def cumulative(choice) -> float:
    return sum(choice.logprobs.token_logprobs)


def test_best_of_returns_the_most_likely_choice(client, model, server):
    singles = [text(client, model, seed=SEED + i, logprobs=0).choices[0] for i in range(3)]
    top = max(singles, key=cumulative)
    best = text(client, model, seed=SEED, best_of=3, n=1)
    assert len(best.choices) == 1 and best.choices[0].index == 0 and best.choices[0].logprobs is None
    assert best.choices[0].text == top.text and best.usage.completion_tokens == 10
    shown = text(client, model, seed=SEED, best_of=3, n=2, logprobs=0)
    ranked = sorted(singles, key=cumulative, reverse=True)
    assert [c.index for c in shown.choices] == [0, 1]
    assert [c.text for c in shown.choices] == [c.text for c in ranked[:2]]
    assert [cumulative(c) for c in shown.choices] == pytest.approx([cumulative(c) for c in ranked[:2]])
    assert shown.usage.completion_tokens == 20
    now = idle_memory(httpx.Client(), server.base_url)
    assert now["slots_free"] == now["slots"]


def refused(call, **fields) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call(**fields)
    return caught.value


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 3, "extra_body": {"best_of": 2}}, "best_of"),
    ({"extra_body": {"best_of": 2}}, "best_of"),
])
def test_chat_refusals_name_the_field(client, model, fields, param):
    error = refused(client.chat.completions.create, model=model, messages=ASK, max_tokens=2, **fields)
    assert error.status_code == 400 and error.body["param"] == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
    ({"best_of": 17}, "best_of"),
])
def test_completion_refusals_name_the_field(client, model, fields, param):
    error = refused(client.completions.create, model=model, prompt=PROMPT, max_tokens=2, **fields)
    assert error.status_code == 400 and error.body["param"] == param


def test_more_choices_than_slots_is_refused(client, model, server):
    slots = httpx.get(server.base_url + "/memory").json()["plan"]["parallel"]
    if slots >= 16:
        pytest.skip("the server runs 16 streams at once")
    error = refused(client.chat.completions.create, model=model, messages=ASK, max_tokens=2, n=slots + 1)
    assert error.body["param"] == "n" and f"--parallel {slots}" in error.body["message"]
