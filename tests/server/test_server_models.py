"""Model names, through a real server and the official openai client: every --served-model-name is listed and
answered to (the reply names the one asked for), and any other name is a 404 `model_not_found`, as vLLM does."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from tensorfold.testing.process import serving


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", "example", str(root / "tiny")],
                   check=True, capture_output=True, timeout=120)
    with serving([str(root / "tiny"), "--family", "example", "--served-model-name", "alpha",
                  "--served-model-name", "beta"], root / "log") as base:
        yield base


def test_every_served_name_is_listed_and_answers(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    assert [card.id for card in client.models.list().data] == ["alpha", "beta"]
    assert client.models.retrieve("beta").id == "beta"
    for name in ("alpha", "beta"):
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2, temperature=0)
        assert reply.model == name and reply.usage.completion_tokens == 2
    chunks = list(client.completions.create(model="beta", prompt="Hello", max_tokens=2, stream=True))
    assert {chunk.model for chunk in chunks} == {"beta"}


def test_a_request_without_a_model_gets_the_first_name(url):
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == "alpha"


def test_another_name_is_model_not_found(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for call in (lambda: client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "Hi"}]),
                 lambda: client.completions.create(model="gamma", prompt="Hi"),
                 lambda: client.models.retrieve("gamma")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        error = caught.value.body
        assert caught.value.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        assert "'gamma' does not exist; this server serves 'alpha', 'beta'" in error["message"]
