"""Qwen3.5 through the real server: the embedded default answers chat and completions with the real openai
client, an image is refused by name, and `tensorfold explain` prices the default config from config.json alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from tensorfold.cli import app

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cache = tmp_path_factory.mktemp("qwen-cache")
    port = free_port()
    log = open(cache / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tensorfold", "serve", "--family", "qwen", "--port", str(port),
                             "--context", "512", "--parallel", "4"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "XDG_CACHE_HOME": str(cache), "TF_KV_POISON": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise RuntimeError("server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.seek(0)
        text = log.read()
        print(text[-3000:])
        assert "wrote the embedded default of family qwen" in text


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
