"""Request validation: every refusal is a 400 naming its field; defaults and the context rule."""

from __future__ import annotations

import attrs
import pytest

from tensorfold.engine.api import Sampling
from tensorfold.server.errors import ApiError
from tensorfold.server.fields import parse_body
from tensorfold.server.params import parse_chat, parse_completion, parse_detokenize, parse_tokenize

HI = [{"role": "user", "content": "Hello!"}]


@pytest.fixture
def service(loaded, tokenizer):
    """The real tiny service (model `tiny`, context 64) with sampling defaults that differ from every field's own."""
    return attrs.evolve(loaded.service, tokenizer=tokenizer,
                        defaults=Sampling(temperature=0.7, top_p=0.9, top_k=20, max_tokens=16,
                                          stop_token_ids=tokenizer.eos_ids))


def refused(call, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    return caught.value


@pytest.mark.parametrize("raw", [b"{", b"not json", b"\xff\xfe", b""])
def test_malformed_json(raw):
    assert "not valid JSON" in refused(parse_body, raw).message


@pytest.mark.parametrize("raw", [b"[]", b"3", b'"x"', b"null"])
def test_body_must_be_object(raw):
    assert "JSON object" in refused(parse_body, raw).message


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", True), ("temperature", float("inf")),
    ("top_p", 0), ("top_p", 1.5), ("top_p", -1), ("top_k", -2), ("top_k", 1.5), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.1), ("seed", "x"), ("seed", 2**64), ("seed", 1.5),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", "10"), ("max_completion_tokens", 0),
    ("stream", "yes"), ("stream", 1), ("ignore_eos", "no"), ("return_token_ids", 0),
    ("stop", 5), ("stop", ["a", 3]), ("stop", {"x": 1}), ("model", 7), ("n", 17), ("n", 0), ("n", "1"),
    ("chat_template_kwargs", "x"), ("chat_template_kwargs", {"messages": []}),
    ("logprobs", "yes"), ("top_logprobs", 3), ("tools", "x"), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("response_format", {"type": "xml"}),
    ("logit_bias", [1]), ("logit_bias", {"x": 1}), ("logit_bias", {"1": 101}), ("logit_bias", {"1": "5"}),
    ("logit_bias", {"1": True}), ("logit_bias", {"-1": 1}), ("logit_bias", {str(10**9): 1}),
    ("logit_bias", {"1": 1, "01": 2}), ("min_tokens", -1), ("min_tokens", "2"), ("min_tokens", 10**6),
])
def test_bad_field_names_param(service, field, value):
    error = refused(parse_chat, {"messages": HI, field: value}, service)
    assert error.param == field, error.message
    assert field in error.message


def test_n_above_the_cap_says_so(service):
    assert "'n' must be at most 16" in refused(parse_chat, {"messages": HI, "n": 17}, service).message


def test_stream_options_need_stream(service):
    error = refused(parse_chat, {"messages": HI, "stream_options": {"include_usage": True}}, service)
    assert error.param == "stream_options"


@pytest.mark.parametrize("messages, param", [
    (None, "messages"), ([], "messages"), ("hi", "messages"), ([3], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"), ([{"role": 5, "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"), ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "video", "x": 1}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]"),
])
def test_bad_messages(service, messages, param):
    assert refused(parse_chat, {"messages": messages}, service).param == param


def test_images_refused_by_name(service):
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    error = refused(parse_chat, {"messages": [{"role": "user", "content": content}]}, service)
    assert error.message == "images are not supported by this server"
    assert error.param == "messages[0].content[1]"


def test_text_parts_joined(service, tokenizer):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    got = parse_chat({"messages": [{"role": "user", "content": parts}]}, service)
    want = tokenizer.encode(tokenizer.render([{"role": "user", "content": "Hello\nthere"}]))
    assert list(got.prompt) == want


def test_template_failure_is_400(service):
    raising = refused(parse_chat, {"messages": HI, "chat_template": "{{ raise_exception('no user here') }}"},
                      service)
    assert raising.param == "messages" and raising.message == "no user here"
    failing = refused(parse_chat, {"messages": HI, "chat_template": "{{ messages[0].content + 1 }}"}, service)
    assert failing.param == "messages" and "template" in failing.message


def test_null_content_renders_as_empty(service, tokenizer):
    messages = [*HI, {"role": "assistant", "content": None}, {"role": "user", "content": "And?"}]
    rendered = tokenizer.render([{**m, "content": m["content"] or ""} for m in messages], add_generation_prompt=True)
    assert list(parse_chat({"messages": messages}, service).prompt) == tokenizer.encode(rendered)


def test_defaults_fill_unset_fields(service, tokenizer):
    got = parse_chat({"messages": HI}, service)
    s = got.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop_token_ids) == (0.7, 0.9, 20, 16, (2,))
    assert not got.stream and not got.include_usage and not got.return_token_ids and got.stop == ()
    assert list(got.prompt) == tokenizer.encode(tokenizer.render(HI, add_generation_prompt=True))


def test_request_fields_override(service):
    body = {"messages": HI, "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0.1, "seed": 7,
            "max_tokens": 5, "max_completion_tokens": 4, "stop": "x", "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True,
            "n": 1, "logprobs": False, "presence_penalty": 0, "model": "tiny"}
    got = parse_chat(body, service)
    s = got.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.max_tokens) == (0.0, 1.0, 0, 0.1, 7, 4)
    assert s.stop_token_ids == ()
    assert got.stop == ("x",) and got.stream and got.include_usage and got.return_token_ids
    assert got.model == "tiny"


def test_a_model_not_served_is_404_model_not_found(service):
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": HI, "model": "whatever"}, service)
    assert (caught.value.status, caught.value.code, caught.value.param) == (404, "model_not_found", "model")
    assert "'whatever' does not exist; this server serves 'tiny'" in caught.value.message


def test_stop_list_drops_empty_and_duplicates(service):
    assert parse_chat({"messages": HI, "stop": ["a", "", "a", "b"]}, service).stop == ("a", "b")


def test_default_max_tokens_shrinks_to_context(service):
    service = attrs.evolve(service, context=20, defaults=Sampling(max_tokens=4096))
    got = parse_completion({"prompt": list(range(3, 15))}, service)
    assert got.sampling.max_tokens == 20 - 12


def test_prompt_filling_context_refused(service):
    error = refused(parse_completion, {"prompt": [5] * 64}, service)
    assert error.code == "context_length_exceeded" and error.param == "prompt"
    assert error.message.startswith("This server's maximum context length is 64 tokens. However, you requested "
                                    "64 tokens (64 in the prompt, 0 in the completion)")


def test_prompt_plus_max_tokens_over_context_refused(service):
    error = refused(parse_chat, {"messages": HI, "max_tokens": 60}, service)
    assert error.code == "context_length_exceeded" and error.param == "messages"
    assert "in the messages, 60 in the completion" in error.message
    parse_completion({"prompt": [5] * 54, "max_tokens": 10}, service)  # exactly the context: fine


@pytest.mark.parametrize("prompt", [None, 5, "", [], [[1, 2], [3]], ["a", "b"], [1, "a"], [True], [512], [-1],
                                    {"a": 1}])
def test_bad_prompts(service, prompt):
    assert refused(parse_completion, {"prompt": prompt}, service).param == "prompt"


@pytest.mark.parametrize("prompt", ["Hello", [[42, 348]], ["Hello"], [42, 348, 81]])
def test_good_prompts(service, tokenizer, prompt):
    got = parse_completion({"prompt": prompt}, service)
    assert list(got.prompt)[:2] == [42, 348]


def test_tokenize_prompt_and_messages(service, tokenizer):
    assert list(parse_tokenize({"prompt": "Hello"}, service).tokens) == tokenizer.encode("Hello")
    no_gen = parse_tokenize({"messages": HI, "add_generation_prompt": False}, service).tokens
    with_gen = parse_tokenize({"messages": HI}, service).tokens
    assert list(no_gen) == tokenizer.encode(tokenizer.render(HI, add_generation_prompt=False))
    assert len(with_gen) > len(no_gen)
    assert refused(parse_tokenize, {}, service).param == "prompt"
    assert refused(parse_tokenize, {"prompt": 3}, service).param == "prompt"


def test_detokenize_checks_ids(service):
    assert parse_detokenize({"tokens": [42, 348]}, service) == [42, 348]
    for tokens in (None, "x", [1.5], [600], [-3]):
        assert refused(parse_detokenize, {"tokens": tokens}, service).param == "tokens"


def test_both_max_token_fields_are_checked(service):
    error = refused(parse_chat, {"messages": HI, "max_tokens": 0, "max_completion_tokens": 4}, service)
    assert error.param == "max_tokens"


def test_tiny_temperature_is_greedy(service):
    assert parse_chat({"messages": HI, "temperature": 1e-9}, service).sampling.temperature == 0.0
    assert parse_chat({"messages": HI, "temperature": 0.5}, service).sampling.temperature == 0.5


def test_audio_refused_by_name(service):
    content = [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]
    error = refused(parse_chat, {"messages": [{"role": "user", "content": content}]}, service)
    assert error.message == "audio is not supported by this server"


def test_template_kwargs_reach_the_template(service, tokenizer):
    class Recording:
        """The real tokenizer, noting the template variables of every render (the prompt's and the starts')."""

        def __init__(self):
            self.seen: list[dict] = []

        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def render(self, messages, add_generation_prompt=True, **kwargs):
            self.seen.append(kwargs)
            return tokenizer.render(messages, add_generation_prompt=add_generation_prompt)

    recording = Recording()
    service = attrs.evolve(service, tokenizer=recording)
    parse_chat({"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}, service)
    assert recording.seen and all(kwargs == {"enable_thinking": False} for kwargs in recording.seen)


@pytest.mark.parametrize(("field", "value"), [
    ("bad_words", ["x"]), ("allowed_token_ids", [1, 2]), ("truncate_prompt_tokens", 8),
    ("guided_decoding_backend", "xgrammar"), ("guided_whitespace_pattern", " ")])
def test_vllm_fields_not_honoured_are_refused_by_name(service, field, value):
    for parse, body in ((parse_chat, {"messages": HI}), (parse_completion, {"prompt": "Hi"})):
        error = refused(parse, {**body, field: value}, service)
        assert error.param == field and error.message == f"'{field}' is not supported by this server"


def test_vllm_fields_at_their_no_op_values_pass(service):
    body = {"messages": HI, "continue_final_message": False,
            "bad_words": []}
    assert parse_chat(body, service).sampling == parse_chat({"messages": HI}, service).sampling


def test_stop_token_ids_add_to_the_eos_ids_and_survive_ignore_eos(service, tokenizer):
    eos = tuple(tokenizer.eos_ids)
    got = parse_chat({"messages": HI, "stop_token_ids": [7, 9, 7]}, service).sampling.stop_token_ids
    assert got == (*eos, 7, 9)
    got = parse_completion({"prompt": "Hi", "stop_token_ids": [7], "ignore_eos": True}, service).sampling
    assert got.stop_token_ids == (7,)
    error = refused(parse_chat, {"messages": HI, "stop_token_ids": [10**9]}, service)
    assert error.param == "stop_token_ids" and "outside the vocabulary" in error.message
    assert refused(parse_chat, {"messages": HI, "stop_token_ids": "7"}, service).param == "stop_token_ids"


def test_add_generation_prompt_false_renders_without_it(service, tokenizer):
    off = parse_chat({"messages": HI, "add_generation_prompt": False}, service)
    assert list(off.prompt) == tokenizer.encode(tokenizer.render(HI, add_generation_prompt=False))
    on = parse_chat({"messages": HI}, service)
    assert len(off.prompt) < len(on.prompt) and list(on.prompt[: len(off.prompt)]) == list(off.prompt)


def test_logit_bias_and_min_tokens_reach_the_sampling(service):
    got = parse_chat({"messages": HI, "logit_bias": {"7": 5, "3": -100.0, 9: 0.5}, "min_tokens": 4,
                      "max_tokens": 8}, service).sampling
    assert got.logit_bias == ((3, -100.0), (7, 5.0), (9, 0.5)) and got.min_tokens == 4
    plain = parse_completion({"prompt": "Hi"}, service).sampling
    assert plain.logit_bias == () and plain.min_tokens == 0


def test_continue_final_message_ends_the_prompt_inside_the_assistant_turn(service, tokenizer):
    said = [*HI, {"role": "assistant", "content": "The capital of France is"}]
    got = parse_chat({"messages": said, "continue_final_message": True, "add_generation_prompt": False}, service)
    whole = tokenizer.render(said, add_generation_prompt=False)
    cut = whole[: whole.rindex("The capital of France is") + len("The capital of France is")]
    assert list(got.prompt) == tokenizer.encode(cut) and len(cut) < len(whole)
    assert got.starts == ()
    for body, why in (({"messages": said, "continue_final_message": True}, "needs 'add_generation_prompt': false"),
                      ({"messages": HI, "continue_final_message": True, "add_generation_prompt": False},
                       "needs a final assistant message")):
        error = refused(parse_chat, body, service)
        assert error.param == "continue_final_message" and why in error.message
