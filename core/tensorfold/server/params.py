"""Request bodies to validated records: pure functions, so every refusal is testable without a server."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from tensorfold.engine.api import KeepMarks, Sampling
from tensorfold.engine.grammar import GrammarSpec
from tensorfold.server.errors import bad_request, model_not_found
from tensorfold.server.fields import (
    SEED_MAX,
    SEED_MIN,
    json_type,
    read_bool,
    read_float,
    read_int,
    read_logit_bias,
    read_object,
    read_stop,
    read_str,
    read_token_ids,
)
from tensorfold.server.messages import continued, for_template, read_messages, read_template_kwargs, render
from tensorfold.server.prompts import chat_ids
from tensorfold.server.starts import keep_marks, start_positions, starts_of
from tensorfold.server.structured import read_grammar
from tensorfold.server.tooling import NONE, ToolChoice, read_tool_choice, read_tools
from tensorfold.service import Service

CONTEXT_CODE = "context_length_exceeded"
MAX_LOGPROBS = 20       # top logprobs a token may carry (vLLM's default --max-logprobs)
MAX_REPETITION = 10.0   # a repetition penalty past it leaves nothing a sampler can tell apart
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: temperatures under it sample greedily
MAX_CHOICES = 16     # `n` and `best_of`: the streams one request may run (each holds a slot: server/choices.py)
# Fields an OpenAI client may send that this server cannot honour: refused unless they hold their no-op value.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v == [],
    "suffix": lambda v: v == "",
    # vLLM's extra fields this server does not honour yet: refused by name, never silently ignored
    "bad_words": lambda v: v == [],
    "allowed_token_ids": lambda v: False,
    "truncate_prompt_tokens": lambda v: False,
    "guided_decoding_backend": lambda v: False,
    "guided_whitespace_pattern": lambda v: False,
}


@attrs.frozen
class Generate:
    """A validated chat or completion request: what to submit and how to answer."""

    model: str
    prompt: tuple[int, ...]
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    include_stop: bool = False  # (vLLM) include_stop_str_in_output: the text ends after the stop string
    starts: tuple[int, ...] = ()  # where the chat's messages start in `prompt`, with the request-starts switch
    marks: KeepMarks = KeepMarks()  # where states are worth keeping (history, system and rewind), likewise
    cache_salt: str | None = None  # kept states are shared only among requests with the same salt (and key)
    grammar: GrammarSpec | None = None  # structured output: the reply follows it (engine/grammar.py)
    tools: tuple[dict[str, Any], ...] = ()  # a chat's tools, for parsing calls out of the reply
    tool_choice: ToolChoice = ToolChoice(NONE)
    reasoning_open: bool = False  # the prompt ends inside the family's think block: the reply starts in reasoning
    n: int = 1        # choices returned (server/choices.py)
    best_of: int = 1  # choices generated: the n with the highest cumulative logprob are returned
    echo: str | None = None  # completions' `echo`: the prompt's text, put before the completion (and its logprobs)
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs`: the prompt's logprobs as their own field


@attrs.frozen
class Tokenize:
    """A validated /tokenize request."""

    tokens: tuple[int, ...]


@attrs.frozen
class ChatPrompt:
    """A chat body rendered: the messages as the template saw them, its variables, the text and its ids."""

    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]
    add: bool
    text: str
    ids: list[int]
    tools: list[dict[str, Any]]
    choice: ToolChoice


def chat_prompt(body: Mapping[str, Any], service: Service, specials_in_content: bool) -> ChatPrompt:
    """Render a chat body: messages for the template, tools, chat_template_kwargs, a request's own chat_template,
    add_generation_prompt and continue_final_message."""
    messages = for_template(read_messages(body), service.tokenizer.template_source)
    kwargs = read_template_kwargs(body)
    tools = read_tools(body)
    choice = read_tool_choice(body, tools)
    if tools:
        kwargs["tools"] = tools
    source = read_str(body, "chat_template")
    if source is not None:
        try:
            kwargs["template"] = service.tokenizer.compile(source)
        except ValueError as err:
            raise bad_request(str(err), "chat_template") from err
    add = read_bool(body, "add_generation_prompt", default=True)
    text = render(service.tokenizer, messages, add_generation_prompt=add, kwargs=kwargs)
    if read_bool(body, "continue_final_message"):
        if add:
            raise bad_request("'continue_final_message' needs 'add_generation_prompt': false (the reply continues "
                              "the final message instead of opening a new one)", "continue_final_message")
        text = continued(text, messages)
    ids = chat_ids(service.tokenizer, messages, text, add, kwargs, specials_in_content)
    return ChatPrompt(messages, kwargs, add, text, ids, tools, choice)


def parse_chat(body: Mapping[str, Any], service: Service, specials_in_content: bool = True) -> Generate:
    """POST /v1/chat/completions: render the messages with the checkpoint's template, then validate the rest;
    without `specials_in_content`, special-token text in message content is encoded as text (server/prompts.py)."""
    model = check_common(body, service)
    if read_bool(body, "echo"):
        raise bad_request("'echo' is for /v1/completions, not /v1/chat/completions", "echo")
    chat = chat_prompt(body, service, specials_in_content)
    if not chat.ids:
        raise bad_request("the messages render to an empty prompt", "messages")
    grammar = read_grammar(body, chat.tools, chat.choice, service.grammars)
    params = attrs.evolve(generate(body, service, chat.ids, "messages", model, grammar, chat=True),
                          tools=tuple(chat.tools),
                          tool_choice=chat.choice, reasoning_open=reasoning_open(service, chat.text))
    if not service.request_starts or not chat.add:  # starts are proven on a prompt ending with the generation prompt
        return params
    positions = start_positions(service.tokenizer, chat.messages, chat.ids, chat.kwargs, chat.text,
                                specials_in_content, service.starts_cache)
    return attrs.evolve(params, starts=starts_of(positions), marks=keep_marks(chat.messages, positions))


def parse_completion(body: Mapping[str, Any], service: Service) -> Generate:
    """POST /v1/completions: one prompt, as text or as token ids."""
    model = check_common(body, service)
    for field in ("tools", "tool_choice"):
        if body.get(field) is not None:
            raise bad_request(f"'{field}' is for /v1/chat/completions, not /v1/completions", field)
    prompt = read_prompt(body, service)
    echo = read_bool(body, "echo")
    grammar = read_grammar(body, [], ToolChoice(NONE), service.grammars)
    params = generate(body, service, prompt, "prompt", model, grammar, echo=echo)
    if not echo:
        return params
    text = body["prompt"]
    text = text[0] if isinstance(text, list) and text and isinstance(text[0], str | list) else text
    return attrs.evolve(params, echo=text if isinstance(text, str) else service.tokenizer.decode(prompt))


def parse_tokenize(body: Mapping[str, Any], service: Service, specials_in_content: bool = True) -> Tokenize:
    """POST /tokenize: a `prompt` string, or `messages` rendered by the template (encoded as chat requests are)."""
    if body.get("messages") is not None:
        return Tokenize(tuple(chat_prompt(body, service, specials_in_content).ids))
    text = read_str(body, "prompt")
    if text is None:
        raise bad_request("give 'prompt' (a string) or 'messages'", "prompt")
    return Tokenize(tuple(service.tokenizer.encode(text)))


def parse_detokenize(body: Mapping[str, Any], service: Service) -> list[int]:
    """POST /detokenize: `tokens`, a list of ids."""
    if body.get("tokens") is None:
        raise bad_request("'tokens' is required", "tokens")
    return read_token_ids(body["tokens"], "tokens", service.tokenizer.vocab_size)


def check_common(body: Mapping[str, Any], service: Service) -> str:
    """Fields either endpoint refuses: a model not served (404), and features this server does not have. Returns
    the model name the answer carries: the one asked for, else the first served."""
    model = read_str(body, "model")
    if model is not None and model not in service.names:
        raise model_not_found(model, service.names)
    for name, is_noop in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not is_noop(value):
            raise bad_request(f"'{name}' is not supported by this server", name)
    return model if model is not None else service.model_name


def read_prompt(body: Mapping[str, Any], service: Service) -> list[int]:
    """`prompt`: a string, a list of ids, or a one-element list of either."""
    value = body.get("prompt")
    if value is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) != 1:
            raise bad_request(f"'prompt' must be one prompt: this server takes no batches, got {len(value)}",
                              "prompt")
        value = value[0]
    if isinstance(value, str):
        ids = service.tokenizer.encode(value)
    elif isinstance(value, list):
        ids = read_token_ids(value, "prompt", service.tokenizer.vocab_size)
    else:
        raise bad_request(f"'prompt' must be a string or an array of token ids, not {json_type(value)}", "prompt")
    if not ids:
        raise bad_request("'prompt' is empty: give at least one token", "prompt")
    return ids


def generate(body: Mapping[str, Any], service: Service, prompt: list[int], prompt_param: str,
             model: str | None = None, grammar: GrammarSpec | None = None, chat: bool = False,
             echo: bool = False) -> Generate:
    """Sampling, stop strings and stream options, with the context rule applied to this prompt; with `echo`
    (completions) max_tokens may be 0 and the prompt's logprobs come with the completion's."""
    stream = read_bool(body, "stream")
    options = read_object(body, "stream_options")
    if options and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = read_bool(options, "include_usage") if options else False
    n, best_of = read_choices(body, service, stream, chat)
    sampling = read_sampling(body, service, len(prompt), prompt_param, zero_ok=echo)
    logprobs = read_logprobs(body, chat)
    shown = read_int(body, "prompt_logprobs", low=0, high=MAX_LOGPROBS)
    if shown is not None and stream:
        raise bad_request("'prompt_logprobs' comes with a whole answer, not with 'stream'", "prompt_logprobs")
    if sampling.max_tokens == 0 and best_of > 1:
        raise bad_request("'max_tokens' 0 (the prompt alone) makes every choice the same: ask for one", "max_tokens")
    echoed = logprobs if echo else None
    scored = max((v for v in (shown, echoed) if v is not None), default=None)
    return Generate(n=n, best_of=best_of, model=model or service.model_name, prompt=tuple(prompt),
                    sampling=attrs.evolve(sampling, logprobs=logprobs, prompt_logprobs=scored),
                    prompt_logprobs=shown is not None, stop=read_stop(body),
                    stream=stream, include_usage=include_usage,
                    return_token_ids=read_bool(body, "return_token_ids"), cache_salt=read_salt(body),
                    include_stop=read_bool(body, "include_stop_str_in_output"), grammar=grammar)


def read_choices(body: Mapping[str, Any], service: Service, stream: bool, chat: bool) -> tuple[int, int]:
    """`n` and `best_of` (best_of defaults to n): each choice is a stream of its own, so together they may hold no
    more than the engine's slots (--parallel); best_of, as OpenAI has it, only on /v1/completions and not streamed."""
    n = read_int(body, "n", low=1, high=MAX_CHOICES)
    n = 1 if n is None else n
    best_of = read_int(body, "best_of", low=1, high=MAX_CHOICES)
    if best_of is not None and best_of > 1 and (chat or stream):
        where = "/v1/chat/completions" if chat else "a streamed request"
        raise bad_request(f"'best_of' is not allowed on {where}: it is for /v1/completions, not streamed", "best_of")
    if best_of is not None and best_of < n:
        raise bad_request(f"'best_of' must be at least 'n' ({n}), got {best_of}", "best_of")
    best_of = n if best_of is None else best_of
    slots = service.plan.get("parallel")
    if isinstance(slots, int) and best_of > slots:
        name = "best_of" if best_of > n else "n"
        raise bad_request(f"'{name}' of {best_of} is more than this server runs at once (--parallel {slots})", name)
    return n, best_of


def reasoning_open(service: Service, text: str) -> bool:
    """Whether the rendered prompt leaves the reply inside the family's think block (a thinking template opens it
    in the generation prompt)."""
    format = service.chat_format
    if format is None or format.think_start is None:
        return False
    tail = text.rstrip()
    return tail.endswith(format.think_start) or (
        format.think_end is not None and tail.rfind(format.think_start) > tail.rfind(format.think_end))


def read_salt(body: Mapping[str, Any]) -> str | None:
    """`cache_salt` (as vLLM takes it): a non-empty string; requests share kept states only with equal salts."""
    salt = read_str(body, "cache_salt")
    if salt is not None and not salt:
        raise bad_request("'cache_salt' must be a non-empty string (leave it out to share kept states)",
                          "cache_salt")
    return salt


def read_sampling(body: Mapping[str, Any], service: Service, prompt_tokens: int, prompt_param: str,
                  zero_ok: bool = False) -> Sampling:
    """The request's sampling fields over the served defaults; max_tokens checked against the context (0, the prompt
    alone, only when `zero_ok`: completions' echo). Every value
    in range forms a distribution: the sampler keeps the most likely token whatever top_p, top_k and min_p drop (a
    top_p that rounds to 0 in float32 samples it), so none is refused for that (engine/sampler.py)."""
    defaults = service.defaults
    temperature = read_float(body, "temperature", low=0.0)
    top_p = read_float(body, "top_p", low=0.0, high=1.0, low_open=True)
    top_k = read_int(body, "top_k", low=-1)
    min_p = read_float(body, "min_p", low=0.0, high=1.0)
    seed = read_int(body, "seed", low=SEED_MIN, high=SEED_MAX)
    legacy = read_int(body, "max_tokens", low=0 if zero_ok else 1)
    asked = read_int(body, "max_completion_tokens", low=0 if zero_ok else 1)
    asked = legacy if asked is None else asked
    max_tokens = check_context(service.context, prompt_tokens, asked, defaults.max_tokens, prompt_param)
    ignore_eos = read_bool(body, "ignore_eos")
    min_tokens = read_int(body, "min_tokens", low=0)
    if min_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' {min_tokens} is more than max_tokens {max_tokens}", "min_tokens")
    stops = body.get("stop_token_ids")
    asked_stops = () if stops is None else tuple(read_token_ids(stops, "stop_token_ids", service.tokenizer.vocab_size))
    eos = () if ignore_eos else (*service.tokenizer.eos_ids, *defaults.stop_token_ids)
    return attrs.evolve(
        defaults,
        temperature=defaults.temperature if temperature is None else greedy_below(temperature),
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else max(top_k, 0),
        min_p=defaults.min_p if min_p is None else min_p,
        seed=defaults.seed if seed is None else seed,
        max_tokens=max_tokens,
        stop_token_ids=tuple(dict.fromkeys((*eos, *asked_stops))),  # ignore_eos drops the EOS ids, not these
        logit_bias=read_logit_bias(body, service.tokenizer.vocab_size),
        min_tokens=min_tokens or 0,
        repetition_penalty=read_float(body, "repetition_penalty", low=0.0, low_open=True, high=MAX_REPETITION)
        or defaults.repetition_penalty,
        frequency_penalty=read_float(body, "frequency_penalty", low=-2.0, high=2.0) or 0.0,
        presence_penalty=read_float(body, "presence_penalty", low=-2.0, high=2.0) or 0.0,
    )


def read_logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """How many top logprobs each token carries (None: no logprobs): chat's `logprobs` (bool) and `top_logprobs`,
    or completions' `logprobs` (an integer)."""
    if chat:
        wanted = read_bool(body, "logprobs")
        top = read_int(body, "top_logprobs", low=0, high=MAX_LOGPROBS)
        if top is not None and not wanted:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if wanted else None
    value = body.get("logprobs")
    if isinstance(value, bool):
        raise bad_request("'logprobs' on /v1/completions is an integer: how many top logprobs per token", "logprobs")
    return read_int(body, "logprobs", low=0, high=MAX_LOGPROBS)


def greedy_below(temperature: float) -> float:
    """A temperature too small to divide by safely means greedy, as vLLM reads it."""
    return 0.0 if temperature < GREEDY_BELOW else temperature


def check_context(context: int, prompt_tokens: int, asked: int | None, default: int, param: str) -> int:
    """max_tokens for this prompt: a prompt that fills the context, or prompt + max_tokens past it, is a 400."""
    wanted = asked if asked is not None else 0
    if prompt_tokens >= context or (asked is not None and prompt_tokens + asked > context):
        where = "messages" if param == "messages" else "prompt"
        raise bad_request(
            f"This server's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the {where}, {wanted} in the completion). "
            f"Please reduce the length of the {where} or the completion.", param, code=CONTEXT_CODE)
    return asked if asked is not None else max(1, min(default, context - prompt_tokens))
