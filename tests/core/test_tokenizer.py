"""The checkpoint's tokenizer and chat template, checked against transformers' reading of the same files."""

from __future__ import annotations

import pytest

from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold.tokenizer import ChatTokenizer, TemplateError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(directory, 512)
    return directory


def test_render_and_encode_match_transformers(directory):
    from transformers import AutoTokenizer

    ours = ChatTokenizer(directory)
    theirs = AutoTokenizer.from_pretrained(directory)
    text = ours.render(MESSAGES)
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.vocab_size == 512


def test_decode_drops_special_tokens(directory):
    tokenizer = ChatTokenizer(directory)
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_eos_comes_from_generation_config_or_tokenizer_config(directory):
    assert ChatTokenizer(directory).eos_ids == (2,)
    assert ChatTokenizer(directory, {"eos_token_id": [2, 0]}).eos_ids == (2, 0)


def test_a_template_that_raises_is_a_template_error(directory):
    tokenizer = ChatTokenizer(directory)
    (directory / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    try:
        with pytest.raises(TemplateError, match="roles must alternate"):
            ChatTokenizer(directory).render(MESSAGES)
    finally:
        (directory / "chat_template.jinja").unlink()
    assert tokenizer.render(MESSAGES).startswith("<|im_start|>system")


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        ChatTokenizer(tmp_path)
