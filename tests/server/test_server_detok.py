"""Incremental detokenization: whole characters only, stop strings cut and never leaked while streaming."""

from __future__ import annotations

from tensorfold.server.detok import StopText


def stream(tokenizer, text: str, stops=()) -> tuple[list[str], str, StopText]:
    """Push `text`'s tokens one by one; return the pieces, the final rest and the decoder."""
    decoder = StopText(tokenizer.decode, stops)
    pieces = [decoder.push(t) for t in tokenizer.encode(text)]
    return pieces, decoder.finish(), decoder


def test_pieces_add_up_to_the_decode(tokenizer):
    text = "Hello! How are you today? Paris is."
    pieces, rest, decoder = stream(tokenizer, text)
    assert "".join(pieces) + rest == text
    assert rest == "" and not decoder.stopped


def test_incomplete_utf8_is_held_back(tokenizer):
    text = "café 日本 🙂 ok"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the tiny BPE splits these characters
    pieces, rest, _ = stream(tokenizer, text)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + rest == text


def test_truncated_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("日")[:-1]  # the last byte never comes
    decoder = StopText(tokenizer.decode)
    assert "".join(decoder.push(t) for t in ids) == ""
    assert decoder.finish() == tokenizer.decode(ids)


def test_stop_string_cuts_before_it(tokenizer):
    pieces, rest, decoder = stream(tokenizer, "one two three four five", stops=["three"])
    assert "".join(pieces) + rest == "one two "
    assert decoder.stopped


def test_stop_string_tail_is_held_while_streaming(tokenizer):
    decoder = StopText(tokenizer.decode, ["four five"])
    sent = ""
    for token in tokenizer.encode("one two three four six"):
        sent += decoder.push(token)
        assert "four" not in sent or "four six" in sent  # "four" is held until it cannot begin the stop
    assert sent + decoder.finish() == "one two three four six"
    assert not decoder.stopped


def test_earliest_of_several_stops_wins(tokenizer):
    pieces, rest, _ = stream(tokenizer, "Monday Tuesday Wednesday", stops=["Wednesday", "Tues", "day"])
    assert "".join(pieces) + rest == "Mon"


def test_stop_inside_one_token(tokenizer):
    text = "Hello there"
    first = tokenizer.encode(text)[0]
    assert len(tokenizer.decode([first])) == 1  # "H": a stop of "ell" lands inside the next token
    pieces, rest, decoder = stream(tokenizer, text, stops=["ell"])
    assert "".join(pieces) + rest == "H" and decoder.stopped


def test_tokens_after_the_stop_are_ignored(tokenizer):
    decoder = StopText(tokenizer.decode, ["two"])
    ids = tokenizer.encode("one two three")
    out = "".join(decoder.push(t) for t in ids)
    kept = list(decoder.ids)
    assert decoder.push(ids[0]) == "" and decoder.ids == kept
    assert out + decoder.finish() == "one "
    assert tokenizer.decode(kept).startswith("one two")


def test_special_tokens_are_not_text(tokenizer):
    decoder = StopText(tokenizer.decode, ["<|im_end|>"])
    ids = tokenizer.encode("Paris is.") + list(tokenizer.eos_ids)
    assert "".join(decoder.push(t) for t in ids) + decoder.finish() == "Paris is."
    assert not decoder.stopped


def test_no_stops_sends_everything_at_once(tokenizer):
    decoder = StopText(tokenizer.decode)
    ids = tokenizer.encode("Hello!")
    assert [decoder.push(t) for t in ids] == [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):]
                                              for i in range(len(ids))]


def test_include_keeps_the_stop_string_and_nothing_after_it(tokenizer):
    text = "one two three four five"
    for stops, kept in ((["three"], "one two three"), (["two thr", "two"], "one two"), (["zzz"], text)):
        decoder = StopText(tokenizer.decode, stops, include=True)
        pieces = [decoder.push(t) for t in tokenizer.encode(text)]
        assert "".join(pieces) + decoder.finish() == kept
        without = StopText(tokenizer.decode, stops)
        plain = "".join(without.push(t) for t in tokenizer.encode(text)) + without.finish()
        assert kept == (plain + next(s for s in stops if kept.endswith(s)) if without.stopped else plain)
