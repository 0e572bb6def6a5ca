"""Qwen3.5 through the real server: the embedded default answers chat and completions with the real openai
client, an image is refused by name, and `tensorfold explain` prices the default config from config.json alone."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tensorfold.cli import app
from tensorfold.testing.process import serving, tail

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


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_and_completions_on_the_embedded_qwen(base):
    c = client(base)
    model = c.models.list().data[0].id
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello, Qwen"}],
                                     max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "length"
    again = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello, Qwen"}],
                                      max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == chat.choices[0].message.content
    done = c.completions.create(model=model, prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=0,
                                extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(done.choices[0].token_ids) == 6 and done.usage.prompt_tokens == 5
    chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Stream it"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5


def test_an_image_is_refused_by_name(base):
    c = client(base)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="image"):
        c.chat.completions.create(model="m", max_tokens=4, messages=[
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
