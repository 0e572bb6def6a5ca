"""Logprobs and penalties through the openai client on a real server: entries match the returned tokens, the
greedy token is the most likely one, streamed entries equal the whole answer's, and penalties move greedy replies
the same way every time; bad values are 400s naming the field."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Tell me about the sea."}]


def test_chat_logprobs_match_the_tokens(client, model):
    reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                           top_logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == reply.usage.completion_tokens == len(choice.model_extra["token_ids"]) == 8
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy takes the raw argmax
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True, extra_body={"ignore_eos": True})
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_sampled_tokens_carry_their_own_logprob(client, model):
    reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=1.5, seed=4,
                                           logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
    entries = reply.choices[0].logprobs.content
    assert any(e.logprob < e.top_logprobs[0].logprob for e in entries)  # hot sampling leaves the argmax
    assert all(e.logprob <= e.top_logprobs[0].logprob for e in entries)


def test_completion_logprobs(client, model):
    reply = client.completions.create(model=model, prompt="The sea is", max_tokens=6, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert logprobs.text_offset[0] == 0
    offsets = logprobs.text_offset
    assert all(offsets[i + 1] - offsets[i] == len(logprobs.tokens[i]) for i in range(5))
    assert all(len(logprobs.top_logprobs[i]) <= 2 and max(logprobs.top_logprobs[i].values()) ==
               logprobs.token_logprobs[i] for i in range(6))


def test_penalties_move_greedy_replies_and_repeat(client, model):
    def reply(**fields) -> str:
        return client.chat.completions.create(model=model, messages=ASK, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True, **fields}).choices[0].message.content

    plain = reply()
    for fields in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        once = reply(**fields)
        assert once == reply(**fields)
        assert once != plain or len(set(plain)) == len(plain)


@pytest.mark.parametrize(("field", "value"), [("frequency_penalty", 2.5), ("presence_penalty", -3),
                                              ("repetition_penalty", 0), ("top_logprobs", 21),
                                              ("top_logprobs", 2)])
def test_bad_values_name_the_field(client, model, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, extra_body={field: value})
    assert caught.value.body["param"] == field
