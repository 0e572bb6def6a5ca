"""Grammars through the real engine on the template family's random-weight model and its byte-level tokenizer:
every reply decodes to text its grammar accepts (greedy and seeded), a free stream's tokens never change with a
constrained neighbour and a constrained stream's never change with others, a complete grammar ends its stream
with `stop`, a matcher that fails fails its stream alone, and no decode step is launched ahead of a stream with a
grammar."""

from __future__ import annotations

import json
import re

import attrs
import pytest
import torch

from tensorfold.engine.api import DoneEvent, ErrorEvent, Sampling
from tensorfold.engine.grammar import Grammars, GrammarSpec
from tensorfold.engine.runner import Engine
from tensorfold.plan import StepPlan
from tensorfold.settings import DEFAULT_MIN_CHUNK
from tensorfold.testing import kit
from tensorfold.testing.engine_gates import Client, Rig, running
from tensorfold.testing.fixtures import one_thread  # noqa: F401  (autouse: a tiny model gains nothing from threads)
from tensorfold.tokenizer import ChatTokenizer

RIG = Rig(context=256, chunk=32, min_chunk=DEFAULT_MIN_CHUNK, page_rows=16, max_waiting=16)
CITIES = ["Paris", "Berlin", "New York"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "place": {"type": "object", "properties": {"city": {"enum": CITIES},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                  "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["ok", "n", "color", "tags", "place"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
LARK = 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'
SPECS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "json_object": GrammarSpec("json_object"),
    "regex": GrammarSpec("regex", EMAIL),
    "choice": GrammarSpec("choice", json.dumps(CITIES)),
    "lark": GrammarSpec("lark", LARK),
}


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 31 + salt * 17) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


@pytest.fixture(scope="module")
def chat(tiny_dir) -> ChatTokenizer:
    return ChatTokenizer(tiny_dir)


@pytest.fixture(scope="module")
def grammars(subject, chat) -> Grammars:
    # one whitespace character between JSON tokens: a random model would otherwise fill every gap to the bound
    return Grammars(chat.tokenizer, subject.model.vocab_size, chat.eos_ids, json_whitespace=1)


def sampling(chat: ChatTokenizer, seed: int | None, max_tokens: int = 200, stops: bool = True,
             bias: tuple[tuple[int, float], ...] = ()) -> Sampling:
    stop_ids = chat.eos_ids if stops else ()
    if seed is None:
        return Sampling(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_ids, logit_bias=bias)
    return Sampling(temperature=1.0, top_p=0.95, seed=seed, max_tokens=max_tokens, stop_token_ids=stop_ids,
                    logit_bias=bias)


def closing(chat: ChatTokenizer) -> tuple[tuple[int, float], ...]:
    """logit_bias toward the tokens that close a JSON string or object: a random model's free text in a string
    goes on for hundreds of tokens, and the bias is applied in the same pass as the mask."""
    return tuple((chat.tokenizer.token_to_id(piece), 4.0) for piece in ('"',))


def client(name: str, salt: int, sampling: Sampling, grammar: object | None = None, length: int = 20) -> Client:
    out = Client(name, prompt(length, salt), sampling)
    out.request.grammar = grammar
    return out


def serve(subject, clients: list[Client], parallel: int, model: object | None = None,
          overlap: bool = False) -> list[DoneEvent | ErrorEvent]:
    """The clients' requests submitted at once to one engine; their last events, memory checked whole after."""
    mem = RIG.memory(subject, parallel)
    engine = Engine(model if model is not None else subject.model, mem, prefill_chunk=RIG.chunk,
                    context=RIG.context, max_waiting=16, overlap=overlap)
    if isinstance(model, Ahead):
        model.engine = engine
    with running(engine):
        for one in clients:
            engine.submit(one.request)
        events = [one.done.get(timeout=120) for one in clients]
    mem.check_integrity()
    assert mem.slots.free == parallel and mem.pool is not None and mem.pool.free == mem.pool.total
    return events


def reply(chat: ChatTokenizer, tokens: list[int]) -> str:
    """The text of a reply without its end token."""
    return chat.tokenizer.decode([t for t in tokens if t not in chat.eos_ids], skip_special_tokens=False)


def check_schema(value: object) -> None:
    assert isinstance(value, dict) and list(value) == ["ok", "n", "color", "tags", "place"], value
    assert isinstance(value["ok"], bool)
    assert isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 99
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(tag, str) and len(tag) <= 6 for tag in value["tags"])
    place = value["place"]
    assert isinstance(place, dict) and set(place) == {"city", "zip"} and place["city"] in CITIES
    assert re.fullmatch("[0-9]{5}", place["zip"])


def check(kind: str, text: str) -> None:
    """The reply satisfies the spec of `kind`, read by hand."""
    if kind == "json_schema":
        check_schema(json.loads(text))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(EMAIL, text), text
    elif kind == "choice":
        assert text in CITIES
    else:
        assert re.fullmatch(r"x=[0-9]{1,3}(,[0-9]{1,3})*", text), text


@pytest.mark.parametrize("seed", [None, 7, 123], ids=["greedy", "seed7", "seed123"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_a_constrained_reply_satisfies_its_grammar(subject, chat, grammars, kind, seed):
    one = client(kind, 1, sampling(chat, seed, bias=closing(chat)), grammars.matcher(SPECS[kind]))
    [done] = serve(subject, [one], 1)
    assert isinstance(done, DoneEvent) and done.finish_reason == "stop", done
    assert done.completion_tokens == len(one.tokens)
    check(kind, reply(chat, one.tokens))


def test_constrained_and_free_streams_are_unchanged_by_each_other(subject, chat, grammars):
    def clients() -> list[Client]:
        return [client("free-greedy", 2, sampling(chat, None, 40), length=37),
                client("schema", 3, sampling(chat, 11), grammars.matcher(SPECS["json_schema"]), length=20),
                client("free-seeded", 4, sampling(chat, 5, 60), length=9),
                client("regex", 5, sampling(chat, None), grammars.matcher(SPECS["regex"]), length=45),
                client("free-top-k", 6, Sampling(temperature=0.8, top_k=30, seed=9, max_tokens=50), length=26)]

    alone = []
    for i in range(5):
        one = clients()[i]
        serve(subject, [one], 1)
        alone.append(one.tokens)
    for parallel in (5, 2):
        together = clients()
        events = serve(subject, together, parallel)
        assert all(isinstance(event, DoneEvent) for event in events), events
        assert [one.tokens for one in together] == alone, parallel
    check("json_schema", reply(chat, alone[1]))
    check("regex", reply(chat, alone[3]))


def test_a_complete_grammar_ends_the_stream_with_stop_before_max_tokens_does(subject, chat, grammars):
    first = client("choice", 8, sampling(chat, None, stops=False), grammars.matcher(SPECS["choice"]))
    [done] = serve(subject, [first], 1)
    assert done.finish_reason == "stop" and reply(chat, first.tokens) in CITIES
    assert not set(first.tokens) & set(chat.eos_ids)      # the grammar ended it, not an end token
    exact = client("choice", 8, sampling(chat, None, len(first.tokens), stops=False), grammars.matcher(SPECS["choice"]))
    [done] = serve(subject, [exact], 1)
    assert (done.finish_reason, done.completion_tokens, exact.tokens) == ("stop", len(first.tokens), first.tokens)


class FailingMatcher:
    """A matcher that allows every token and fails on its `at`-th call of `allowed` (`in_mask`) or `advance`."""

    def __init__(self, at: int, in_mask: bool) -> None:
        self.at, self.in_mask, self.calls = at, in_mask, 0
        self.finished = False

    def allowed(self, out: torch.Tensor) -> None:
        out.fill_(-1)
        self.calls += self.in_mask
        if self.in_mask and self.calls == self.at:
            raise RuntimeError("the mask broke")

    def advance(self, token_id: int) -> None:
        self.calls += not self.in_mask
        if not self.in_mask and self.calls == self.at:
            raise ValueError(f"token {token_id} refused")


def test_a_failing_matcher_fails_its_stream_alone(subject, chat):
    def clients() -> list[Client]:
        return [client("free", 2, sampling(chat, 3, 30), length=30),
                client("mask", 3, sampling(chat, None, 30), FailingMatcher(4, in_mask=True)),
                client("advance", 4, sampling(chat, 8, 30), FailingMatcher(6, in_mask=False), length=11)]

    alone = clients()[0]
    serve(subject, [alone], 1)
    together = clients()
    events = serve(subject, together, 3)
    assert together[0].tokens == alone.tokens and events[0].finish_reason == "length"
    assert isinstance(events[1], ErrorEvent) and "the mask broke" in events[1].message
    assert len(together[1].tokens) == 3                   # its 4th mask failed: no 4th token
    assert isinstance(events[2], ErrorEvent) and "refused" in events[2].message
    assert len(together[2].tokens) == 5                   # the 6th token was refused: never sent


class Ahead:
    """The template model with the engine's `forward_ahead` (engine/graphs.py's contract: each share's token is its
    row in the previous step's ids), recording steps launched ahead and checking none holds a grammar stream."""

    def __init__(self, model: object) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.engine: Engine | None = None
        self.ahead = 0

    def forward(self, plan: StepPlan, kv: object) -> torch.Tensor:
        return self.model.forward(plan, kv)

    def forward_ahead(self, plan: StepPlan, kv: object, source: torch.Tensor) -> torch.Tensor:
        assert self.engine is not None
        constrained = {s.claim.slot for s in self.engine.scheduler.running if s.request.grammar is not None}
        assert not constrained & {share.slot for share in plan.streams}, "a step launched ahead of a grammar row"
        self.ahead += 1
        ids = source.tolist()
        fed = StepPlan(tuple(attrs.evolve(share, tokens=(ids[share.tokens[0]],)) for share in plan.streams))
        return self.model.forward(fed, kv)


def test_no_step_is_launched_ahead_of_a_grammar_stream_and_the_tokens_are_the_same(subject, chat, grammars):
    def clients(which: str) -> list[Client]:
        free = client("free", 2, sampling(chat, 3, 40), length=30)
        schema = client("schema", 3, sampling(chat, None), grammars.matcher(SPECS["json_schema"]))
        choice = client("choice", 4, sampling(chat, 5), grammars.matcher(SPECS["choice"]), length=12)
        return {"free": [free], "schema": [schema], "both": [free, choice]}[which]

    # alone, the free stream goes ahead and the schema stream never does; together, the free one goes ahead only
    # once its constrained neighbour (a few tokens long) has ended: Ahead checks each step launched ahead
    for which in ("free", "schema", "both"):
        plain = clients(which)
        serve(subject, plain, 2)
        model = Ahead(subject.model)
        overlapped = clients(which)
        events = serve(subject, overlapped, 2, model, overlap=True)
        assert all(isinstance(event, DoneEvent) for event in events), events
        assert [one.tokens for one in overlapped] == [one.tokens for one in plain], which
        assert (model.ahead > 0) == (which != "schema"), (which, model.ahead)
