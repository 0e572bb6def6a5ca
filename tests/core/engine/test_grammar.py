"""Grammars on their own (engine/grammar.py): the masks each kind of spec gives on the tiny byte-level tokenizer,
the end tokens once a grammar is complete, a refused token, the problems of invalid specs; the sampler's mask pass
(only the constrained rows change, batch-invariant); and no step launched ahead with a grammar stream in it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tensorfold.engine.ahead import InFlight, ahead_of
from tensorfold.engine.api import Request, Sampling
from tensorfold.engine.grammar import MISSING, GrammarError, Grammars, GrammarSpec, mask_words
from tensorfold.engine.sampler import Allowed, Sampler, SampleRow, probabilities, unpacked
from tensorfold.engine.stream import Stream
from tensorfold.memory import Claim
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.testing.tiny_tokenizer import build_tokenizer

VOCAB = 512
TOKENIZER = build_tokenizer(VOCAB)
EOS = TOKENIZER.token_to_id("<|im_end|>")
PAD = TOKENIZER.token_to_id("<|endoftext|>")


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOKENIZER, VOCAB, (EOS,))


def mask_of(matcher, vocab: int = VOCAB) -> list[int]:
    """The token ids a matcher allows next."""
    row = torch.zeros(mask_words(vocab), dtype=torch.int32)
    matcher.allowed(row)
    return unpacked(row[None], vocab)[0].nonzero().flatten().tolist()


def text(token: int) -> str:
    return TOKENIZER.decode([token])


def test_a_regex_allows_what_extends_it_then_the_end_token_alone(grammars):
    matcher = grammars.matcher(GrammarSpec("regex", "[0-9]{2}"))
    first = mask_of(matcher)
    assert first and all(text(t).isdigit() and len(text(t)) <= 2 for t in first)
    assert {text(t) for t in first} >= set("0123456789")
    matcher.advance(TOKENIZER.token_to_id("4"))
    assert not matcher.finished and {text(t) for t in mask_of(matcher)} == set("0123456789")
    matcher.advance(TOKENIZER.token_to_id("2"))
    assert matcher.finished and mask_of(matcher) == [EOS]


def test_every_end_token_closes_a_grammar_that_may_end():
    grammars = Grammars(TOKENIZER, VOCAB, (EOS, PAD))
    matcher = grammars.matcher(GrammarSpec("regex", "[0-9]{1,2}"))
    matcher.advance(TOKENIZER.token_to_id("7"))
    allowed = mask_of(matcher)
    assert {EOS, PAD} <= set(allowed) and not matcher.finished
    matcher.advance(EOS)
    assert matcher.finished and mask_of(matcher) == sorted((EOS, PAD))


def test_choices_allow_the_first_tokens_of_each_and_finish_on_one(grammars):
    matcher = grammars.matcher(GrammarSpec("choice", json.dumps(["Paris", "Berlin"])))
    assert all("Paris".startswith(text(t)) or "Berlin".startswith(text(t)) for t in mask_of(matcher))
    for token in TOKENIZER.encode("Berlin").ids:
        assert token in mask_of(matcher)
        matcher.advance(token)
    assert matcher.finished and mask_of(matcher) == [EOS]


def test_json_object_starts_with_a_brace_and_ids_past_the_tokenizer_are_never_allowed():
    grammars = Grammars(TOKENIZER, VOCAB + 20, (EOS,))
    matcher = grammars.matcher(GrammarSpec("json_object"))
    assert [text(t) for t in mask_of(matcher, VOCAB + 20)] == ["{"]
    for token in TOKENIZER.encode('{"a').ids:
        matcher.advance(token)
    inside = mask_of(matcher, VOCAB + 20)
    assert len(inside) > VOCAB // 2 and max(inside) < VOCAB  # free text in a string, no id past the tokenizer's
    with pytest.raises(GrammarError, match=f"token {VOCAB + 3}"):
        matcher.advance(VOCAB + 3)


def test_a_model_vocabulary_smaller_than_the_tokenizer_cuts_the_mask():
    vocab = 480
    matcher = Grammars(TOKENIZER, vocab, (EOS,)).matcher(GrammarSpec("json_object"))
    for token in TOKENIZER.encode('{"a').ids:
        matcher.advance(token)
    assert max(mask_of(matcher, vocab)) < vocab


def test_lark_and_json_schema_are_followed_token_by_token(grammars):
    lark = grammars.matcher(GrammarSpec("lark", 'start: "x=" NUM\nNUM: /[0-9]+/'))
    for token in TOKENIZER.encode("x=12").ids:
        assert token in mask_of(lark)
        lark.advance(token)
    assert EOS in mask_of(lark) and not lark.finished
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    matcher = grammars.matcher(GrammarSpec("json_schema", json.dumps(schema)))
    for token in TOKENIZER.encode('{"ok": true}').ids:
        matcher.advance(token)
    assert matcher.finished


def test_a_token_the_grammar_refuses_raises(grammars):
    matcher = grammars.matcher(GrammarSpec("regex", "[0-9]+"))
    with pytest.raises(GrammarError, match=f"does not allow token {TOKENIZER.token_to_id('a')}"):
        matcher.advance(TOKENIZER.token_to_id("a"))
    with pytest.raises(GrammarError, match="the grammar failed"):
        mask_of(matcher)  # a failed matcher would allow only the end token: it raises instead


def test_a_mask_row_of_the_wrong_shape_is_refused(grammars):
    matcher = grammars.matcher(GrammarSpec("json_object"))
    with pytest.raises(ValueError, match="int32"):
        matcher.allowed(torch.zeros(VOCAB, dtype=torch.bool))


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("regex", "[a-"), "invalid regex"),
    (GrammarSpec("regex", ""), "empty"),
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
    (GrammarSpec("json_schema", json.dumps({"type": "nope"})), "invalid JSON schema"),
    (GrammarSpec("json_schema", json.dumps({"$ref": "#/nowhere"})), "invalid JSON schema"),
    (GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "(a"})), "invalid JSON schema"),
    (GrammarSpec("choice", json.dumps("Paris")), "JSON list"),
    (GrammarSpec("choice", json.dumps([])), "at least one"),
    (GrammarSpec("choice", json.dumps(["a", ""])), "non-empty"),
    (GrammarSpec("lark", "start: nothing_here"), "invalid Lark grammar"),
])
def test_an_invalid_spec_has_a_problem_and_no_matcher(grammars, spec, words):
    problem = grammars.problem(spec)
    assert problem is not None and words in problem and len(problem) <= 500
    assert grammars.problem(spec) == problem  # cached: the same words
    with pytest.raises(ValueError, match="."):
        grammars.matcher(spec)


def test_valid_specs_have_no_problem_and_the_cache_is_bounded():
    grammars = Grammars(TOKENIZER, VOCAB, (EOS,), cached=2)
    specs = [GrammarSpec("regex", "a+"), GrammarSpec("json_object", "ignored"), GrammarSpec("choice", '["x"]')]
    assert [grammars.problem(spec) for spec in specs] == [None, None, None]
    assert len(grammars._compiled) == 2 and ("regex", "a+") not in grammars._compiled
    assert grammars.matcher(specs[0]) is not grammars.matcher(specs[0])  # each request its own matcher


def test_an_unknown_kind_is_refused_at_construction():
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("yaml", "a: 1")


def test_without_llguidance_a_grammar_has_a_problem_and_the_engine_still_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    grammars = Grammars(TOKENIZER, VOCAB, (EOS,))
    assert grammars.problem(GrammarSpec("regex", "a")) == MISSING
    code = "import sys, tensorfold.engine.runner, tensorfold.engine.grammar; assert 'llguidance' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_sampler_masks_only_the_constrained_rows_the_same_in_any_batch(grammars):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn((4, VOCAB), generator=generator)
    rows = [SampleRow.of(Sampling(temperature=0.0)), SampleRow.of(Sampling(temperature=1.0, seed=1)),
            SampleRow.of(Sampling(temperature=0.7, top_k=50, seed=2)), SampleRow.of(Sampling(temperature=0.0))]
    counters = [0, 3, 5, 1]
    matchers = [grammars.matcher(GrammarSpec("regex", "[0-9]+")), grammars.matcher(GrammarSpec("regex", "[a-z]+"))]
    allowed = Allowed.empty([1, 3], VOCAB, logits.device)
    for matcher, bits in zip(matchers, allowed.bits, strict=True):
        matcher.allowed(bits)
    sampler = Sampler()
    free = sampler.sample(logits, rows, counters)
    masked = sampler.sample(logits, rows, counters, allowed)
    assert masked[0] == free[0] and masked[2] == free[2]
    assert text(masked[1]).isdigit() and text(masked[3]).isalpha() and text(masked[3]).islower()
    for i, k in ((1, 0), (3, 1)):  # a constrained row alone draws what it drew in the batch
        alone = Allowed((0,), allowed.bits[k: k + 1].clone())
        assert sampler.sample(logits[i: i + 1], [rows[i]], [counters[i]], alone) == [masked[i]]
    spread = probabilities(logits[1], rows[1], counters[1], allowed.bits[0])
    keep = unpacked(allowed.bits[:1], VOCAB)[0]
    assert float(spread[~keep].sum()) == 0.0 and abs(float(spread[keep].sum()) - 1.0) < 1e-9


def test_a_row_whose_grammar_leaves_nothing_to_sample_is_refused_as_such(grammars):
    matcher = grammars.matcher(GrammarSpec("regex", "[0-9]"))
    matcher.advance(TOKENIZER.token_to_id("5"))           # complete: only the end token may follow
    allowed = Allowed.empty([0], VOCAB, torch.device("cpu"))
    matcher.allowed(allowed.bits[0])
    row = SampleRow.of(Sampling(temperature=0.0, stop_token_ids=(EOS,), min_tokens=3))  # holds the end token
    assert Sampler().sample(torch.zeros((1, VOCAB)), [row], [1], allowed) == [-1]


def stream(slot: int, grammar: object | None = None) -> Stream:
    sampling = Sampling(temperature=0.0, max_tokens=100)
    request = Request(f"r{slot}", tuple(range(1, 11)), sampling, lambda event: None, grammar=grammar)
    return Stream(request, Claim(slot, None), SampleRow.of(sampling), position=10 + slot, produced=1)


def test_no_step_is_launched_ahead_of_a_stream_with_a_grammar(grammars):
    constrained = stream(1, grammars.matcher(GrammarSpec("json_object")))
    streams = [stream(0), constrained, stream(2)]
    plan = StepPlan(tuple(StreamStep(s.claim.slot, s.position, (7,)) for s in streams))
    step = InFlight.launched(plan, streams, torch.arange(3) + 100, torch.zeros((3, 8)), started=0.0)
    assert ahead_of(step, 64) is None
    constrained.ended = True   # once it is out, the others go on ahead
    planned = ahead_of(step, 64)
    assert planned is not None and planned[1] == [streams[0], streams[2]]
