"""Qwen3.5 through the real server: the embedded default answers chat and completions with the real openai
client, an image is refused by name, and `tensorfold explain` prices the default config from config.json alone."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tensorfold.cli import app
from tensorfold.testing.process import serving, tail
from tensorfold.testing.served import check_chat_and_completions, openai_client

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cache = tmp_path_factory.mktemp("qwen-cache")
    log = cache / "server.log"
    with serving(["--family", "qwen", "--context", "512", "--parallel", "4"], log,
                 env={"XDG_CACHE_HOME": str(cache), "TF_KV_POISON": "1"}) as url:
        yield url
    assert "wrote the embedded default of family qwen" in tail(log)


def test_chat_and_completions_on_the_embedded_qwen(base):
    check_chat_and_completions(base, "Hello, Qwen")


def test_an_image_is_refused_by_name(base):
    c = openai_client(base)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="image"):
        c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])


def test_explain_prices_the_default_config_from_config_json(tmp_path):
    from transformers import Qwen3_5TextConfig

    (tmp_path / "config.json").write_text(json.dumps(Qwen3_5TextConfig().to_dict()))
    result = CliRunner().invoke(app, ["explain", "--family", "qwen", "--model", str(tmp_path), "--dtype", "bfloat16",
                                      "--device", "cpu", "--json", "--kv-gib", "64", "--context", "32768"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["bytes_per_token"] == 32768
    assert abs(plan["fixed_bytes_per_stream"] / 2**20 - 49.1) < 0.1
    assert plan["weights_bytes"] is None and plan["refusals"] == []


def test_reasoning_and_a_qwen3_coder_call_are_split_out(base):
    """The family's chat format through the server: text in its think block is reasoning, and a call in its
    qwen3_coder format after it is a tool call; a regex makes the random model write both, streamed and not."""
    c = openai_client(base)
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
    written = r"<think>\nThe user wants a word\.\n</think>\n\nLooking\.\n<tool_call>\n<function=lookup>\n" \
              r"<parameter=word>\ntide\n</parameter>\n</function>\n</tool_call>"
    fields = {"model": c.models.list().data[0].id, "messages": [{"role": "user", "content": "Define tide"}],
              "tools": [tool], "max_tokens": 120, "temperature": 0,
              "extra_body": {"guided_regex": written, "chat_template_kwargs": {"enable_thinking": False}}}
    choice = c.chat.completions.create(**fields).choices[0]
    message = choice.message
    assert message.model_extra["reasoning_content"].strip() == "The user wants a word."
    assert message.content.strip() == "Looking." and choice.finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"word": "tide"}
    reasoning, content, pieces = [], [], []
    for chunk in c.chat.completions.create(stream=True, **fields):
        delta = chunk.choices[0].delta
        reasoning += [delta.model_extra.get("reasoning_content") or ""]
        content += [delta.content or ""]
        pieces += [part.function.arguments or "" for part in delta.tool_calls or ()]
    assert "".join(reasoning).strip() == "The user wants a word." and "".join(content).strip() == "Looking."
    assert json.loads("".join(pieces)) == {"word": "tide"}
