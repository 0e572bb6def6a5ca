"""Completions' `echo` with prompt logprobs, and vLLM's `prompt_logprobs`, through the openai client on a real
server: the prompt's entries equal what the model gives each prefix as a prompt of its own, the echoed answer is
the prompt then the plain answer (streamed or not), max_tokens 0 scores the prompt alone, and misuse is a 400
naming the field."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

IDS = [(i * 37) % 400 + 20 for i in range(40)]


def scored(client, model, **fields):
    return client.completions.create(model=model, prompt=IDS, temperature=0, echo=True, logprobs=2,
                                     extra_body={"ignore_eos": True}, **fields).choices[0]


def test_max_tokens_zero_scores_the_prompt(client, model):
    choice = scored(client, model, max_tokens=0)
    lp = choice.logprobs
    assert choice.finish_reason == "length"
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(IDS)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(IDS))]


@pytest.mark.parametrize("k", [1, 2, 17, 39])
def test_each_entry_is_what_the_prefix_predicts(client, model, k):
    whole = scored(client, model, max_tokens=0).logprobs
    alone = client.completions.create(model=model, prompt=IDS[:k], max_tokens=1, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0].logprobs
    assert set(alone.top_logprobs[0]) == set(whole.top_logprobs[k])
    for token, value in alone.top_logprobs[0].items():
        assert whole.top_logprobs[k][token] == pytest.approx(value, abs=1e-4)
    greedy = alone.tokens[0]
    assert (whole.tokens[k] == greedy) == (whole.token_logprobs[k] == max(whole.top_logprobs[k].values()))


def test_echo_puts_the_prompt_before_the_plain_answer(client, model):
    plain = client.completions.create(model=model, prompt=IDS, max_tokens=6, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0]
    echoed = scored(client, model, max_tokens=6)
    prompt_text = scored(client, model, max_tokens=0).text
    assert echoed.text == prompt_text + plain.text
    lp = echoed.logprobs
    assert lp.tokens == scored(client, model, max_tokens=0).logprobs.tokens + plain.logprobs.tokens
    assert lp.token_logprobs[len(IDS):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-6)
    assert lp.text_offset[len(IDS):] == [len(prompt_text) + o for o in plain.logprobs.text_offset]
    stream = client.completions.create(model=model, prompt=IDS, max_tokens=6, temperature=0, echo=True,
                                       logprobs=2, stream=True, extra_body={"ignore_eos": True})
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert chunks[0].text == prompt_text and len(chunks[0].logprobs.tokens) == len(IDS)
    assert "".join(c.text for c in chunks) == echoed.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_echo_of_a_text_prompt_without_logprobs(client, model):
    text = "The sea is wide"
    plain = client.completions.create(model=model, prompt=text, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    echoed = client.completions.create(model=model, prompt=text, max_tokens=5, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text == text + plain.text and echoed.logprobs is None
    alone = client.completions.create(model=model, prompt=text, max_tokens=0, echo=True)
    assert alone.choices[0].text == text and alone.usage.completion_tokens == 0


def test_vllm_prompt_logprobs(client, model):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                           max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 2})
    shown = reply.model_extra["prompt_logprobs"]
    assert len(shown) == reply.usage.prompt_tokens and shown[0] is None
    for entry in shown[1:]:
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == [1, 2] and 2 <= len(entry) <= 3
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values())
    completion = client.completions.create(model=model, prompt=IDS, max_tokens=0, echo=True, logprobs=2,
                                           extra_body={"prompt_logprobs": 2}).choices[0]
    shown = completion.model_extra["prompt_logprobs"]
    assert [None if e is None else e[str(t)]["logprob"] for e, t in zip(shown, IDS, strict=True)] == \
        completion.logprobs.token_logprobs


@pytest.mark.parametrize(("call", "field"), [
    ("chat_echo", "echo"), ("zero_without_echo", "max_tokens"), ("streamed_prompt_logprobs", "prompt_logprobs"),
    ("zero_with_n", "max_tokens")])
def test_misuse_is_a_400_naming_the_field(client, model, call, field):
    messages = [{"role": "user", "content": "Hi"}]
    calls = {
        "chat_echo": lambda: client.chat.completions.create(model=model, messages=messages, extra_body={"echo": True}),
        "zero_without_echo": lambda: client.completions.create(model=model, prompt="Hi", max_tokens=0),
        "streamed_prompt_logprobs": lambda: client.completions.create(model=model, prompt="Hi", stream=True,
                                                                      extra_body={"prompt_logprobs": 1}),
        "zero_with_n": lambda: client.completions.create(model=model, prompt="Hi", max_tokens=0, echo=True, n=2),
    }
    with pytest.raises(openai.BadRequestError) as raised:
        calls[call]()
    assert raised.value.body["param"] == field
