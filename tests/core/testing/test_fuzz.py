"""The fuzz generator: the same seed gives the same bytes, every mutation is drawn, raw fragments land where asked,
and error bodies are judged against OpenAI's envelope exactly."""

from __future__ import annotations

import json

from tensorfold.testing.fuzz import CHAT, ENDPOINTS, Case, Fuzzer, Limits, leaf_paths, nested, with_raw
from tensorfold.testing.fuzz_http import envelope_problem, judge

LIMITS = Limits(context=256, max_body=1 << 20, vocab=512)


def test_a_seed_gives_the_same_cases_and_every_kind() -> None:
    first = list(Fuzzer(7, LIMITS).cases(300))
    assert first == list(Fuzzer(7, LIMITS).cases(300))
    assert first != list(Fuzzer(8, LIMITS).cases(300))
    assert {case.kind for case in first} == set(Fuzzer(7, LIMITS).mutations)
    assert {case.path for case in first} == set(ENDPOINTS)
    assert [case.index for case in first] == list(range(300))
    assert max(len(case.body) for case in first) <= LIMITS.max_body + 512


def test_raw_fragments_go_where_asked() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert with_raw(dict(body), ("max_tokens",), "NaN") == b'{"messages": [{"role": "user", "content": "hi"}], ' \
                                                          b'"max_tokens": NaN}'
    raw = with_raw(json.loads(json.dumps(body)), ("messages", 0, "content"), '"\\ud800"')
    assert json.loads(raw)["messages"][0]["content"] == "\ud800"
    assert leaf_paths(body) == [("messages",), ("messages", 0), ("messages", 0, "role"),
                                ("messages", 0, "content"), ("max_tokens",)]


def test_nesting_and_reproducers_are_compact() -> None:
    import random

    deep = nested(2000, random.Random(0))
    assert len(deep) in (4001, 2000 * 6 + 1)
    case = Case(3, "big-int", CHAT, b'{"n": ' + b"9" * 4400 + b"}", hang_up_after=1)
    assert case.reproducer() == ("curl -X POST $URL/v1/chat/completions -H 'content-type: application/json' "
                                 "--data-binary '{\"n\": «9×4400»}'  # hang up after 1 events")


def test_answers_are_judged_exactly() -> None:
    good = json.dumps({"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}})
    assert envelope_problem(good.encode()) is None
    assert judge(400, good.encode()) is None
    assert judge(200, b'{"ok": 1}') is None
    assert judge(500, b'{"error": {"message": "internal error: RecursionError"}}') == \
        "500: internal error: RecursionError"
    assert "not OpenAI's envelope" in judge(400, b'{"error": {"message": "m", "type": "t"}}')
    assert "not OpenAI's envelope" in judge(422, b'{"detail": "x"}')
    assert "not JSON" in judge(404, b"Not Found")
    assert "not a JSON object" in judge(200, b"[1]")
