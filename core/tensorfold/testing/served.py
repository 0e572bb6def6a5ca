"""What a family's tests ask of a real `tensorfold serve` (process.serving): the openai client's view of chat and
completions, and seeded chat turns of one conversation, to compare a resumed server's replies with a fresh one's.

Only tests import this module: it needs httpx and openai, which `pip install 'tensorfold[testing]'` brings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorfold.testing.extras import need

httpx = need("httpx", __name__)

if TYPE_CHECKING:
    import openai

SYSTEM = "You are a helpful assistant who answers in full sentences."
FIRST = "What is the capital of France, and why?"
SECOND = "Tell me more about its rivers."

Messages = list[dict[str, Any]]


def openai_client(url: str) -> openai.OpenAI:
    """The real openai client on a server's base URL, failing at once rather than retrying."""
    openai = need("openai", __name__)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def check_chat_and_completions(url: str, greeting: str) -> str:
    """Chat (the same reply twice at temperature 0), completions on token ids and a chat stream with usage each
    give the length asked for; returns the served model's id."""
    client = openai_client(url)
    model = client.models.list().data[0].id
    said = [{"role": "user", "content": greeting}]
    chat = client.chat.completions.create(model=model, messages=said, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "length"
    again = client.chat.completions.create(model=model, messages=said, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == chat.choices[0].message.content
    done = client.completions.create(model=model, prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(done.choices[0].token_ids) == 6 and done.usage.prompt_tokens == 5
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Stream it"}],
                                                 max_tokens=5, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5
    return model


def ask(url: str, messages: Messages) -> dict[str, Any]:
    """One seeded chat turn of 8 tokens, with its token ids: the reply's JSON."""
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 8, "temperature": 0.7, "seed": 3,
                             "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def turns(first: dict[str, Any] | None, system: str = SYSTEM, question: str = FIRST,
          more: str = SECOND) -> tuple[Messages, Messages]:
    """A conversation's first turn, and its second with the first reply (`ask`'s JSON; None: empty) in it."""
    one = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    said = first["choices"][0]["message"]["content"] if first else ""
    return one, [*one, {"role": "assistant", "content": said}, {"role": "user", "content": more}]
