"""The kit's server checks on the template family's embedded default: the openai client's view, seeded turns."""

from __future__ import annotations

import pytest

from tensorfold.testing.process import serving
from tensorfold.testing.served import FIRST, SECOND, SYSTEM, ask, check_chat_and_completions, turns

pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_the_example_answers_the_openai_client_and_a_seeded_turn_repeats(tmp_path):
    with serving(["--family", "example", "--context", "512"], tmp_path / "server.log",
                 env={"XDG_CACHE_HOME": str(tmp_path)}) as url:
        model = check_chat_and_completions(url, "Hello, example")
        one, empty = turns(None)
        first, again = ask(url, one), ask(url, one)
        two = turns(first)[1]
        second = ask(url, two)
    assert model
    assert one == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    assert empty[2] == {"role": "assistant", "content": ""} and empty[3] == {"role": "user", "content": SECOND}
    said = first["choices"][0]
    assert said["token_ids"] == again["choices"][0]["token_ids"] and 1 <= len(said["token_ids"]) <= 8
    assert two[2] == {"role": "assistant", "content": said["message"]["content"]}
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
