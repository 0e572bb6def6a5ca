"""The incremental stop-string decoder equals the full-decode one it replaced (tests/server/full_decode.py), output
for output, on random id sequences of the tiny tokenizer and of a byte-level BPE full of multibyte characters,
with random stop strings: the same piece after every token, the same rest at the end, the same stop and ids."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from full_decode import FullDecodeStopText
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tensorfold.server.detok import WINDOW, StopText
from tensorfold.testing.tiny_tokenizer import SPECIALS, build_tokenizer

MULTIBYTE = (
    "café naïve résumé Ärger Øresund ß — “quotes” … 日本語のテキスト 中文字符 한국어 문장 Привет мир "
    "Ελληνικά עברית العربية हिन्दी 🙂🚀👍🏽 🇫🇷 e\u0301 ﬁ ½ € £ ¥ ∑ ∞ ≠ 𝔘𝔫𝔦 Hello, world! 0123456789 "
)


def multibyte_tokenizer() -> Tokenizer:
    """A byte-level BPE with few merges, so most multibyte characters span several ids; specials included."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + len(SPECIALS) + 60, special_tokens=list(SPECIALS),
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([MULTIBYTE] * 4 + MULTIBYTE.split(), trainer=trainer)
    return tokenizer


def decoder_of(tokenizer: Tokenizer) -> Callable[[Sequence[int]], str]:
    """Decode as the server does (tokenizer.py): special tokens left out."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


TOKENIZERS = {"tiny": build_tokenizer(512), "multibyte": multibyte_tokenizer()}
DECODERS = {name: decoder_of(tok) for name, tok in TOKENIZERS.items()}


def run(decoder, ids: Sequence[int], extra: Sequence[int]) -> tuple[list[str], str, bool, list[int]]:
    """Push `ids` (then `extra`, which after a stop must change nothing); the pieces, the rest, stopped, ids."""
    pieces = [decoder.push(i) for i in ids] + [decoder.push(i) for i in extra]
    return pieces, decoder.finish(), decoder.stopped, list(decoder.ids)


def ids_of(name: str) -> st.SearchStrategy[list[int]]:
    """Random ids, and runs of the ids that decode to nothing or to bytes that are no character."""
    vocab = TOKENIZERS[name].get_vocab_size()
    return st.lists(st.one_of(st.integers(0, vocab - 1), st.sampled_from(range(len(SPECIALS)))), max_size=60)


@st.composite
def stops_for(draw: st.DrawFn, text: str) -> list[str]:
    """0-3 stop strings: pieces of the text the ids decode to (so they hit), or short strings of its characters."""
    alphabet = sorted(set(text)) or ["a"]
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.booleans()):
            a = draw(st.integers(0, len(text) - 1))
            stops.append(text[a:a + draw(st.integers(1, 6))])
        else:
            stops.append(draw(st.text(alphabet=st.sampled_from(alphabet), min_size=0, max_size=4)))
    return stops


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_incremental_equals_full_decode(name, data):
    decode = DECODERS[name]
    ids = data.draw(ids_of(name))
    extra = data.draw(st.lists(st.integers(0, TOKENIZERS[name].get_vocab_size() - 1), max_size=3))
    stops = data.draw(stops_for(decode(ids)))
    assert run(StopText(decode, stops), ids, extra) == run(FullDecodeStopText(decode, stops), ids, extra)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_every_character_split_over_ids_equals_full_decode(name):
    """Each multibyte character of the text, alone and among others, fed as the tokenizer splits it."""
    decode = DECODERS[name]
    ids = TOKENIZERS[name].encode(MULTIBYTE).ids
    assert any("\ufffd" in decode([i]) for i in ids)  # characters really span several ids
    for stops in ([], ["語の"], ["🚀"], ["\u0301 ﬁ"], ["world!", "мир"], ["zzz"]):
        assert run(StopText(decode, stops), ids, []) == run(FullDecodeStopText(decode, stops), ids, [])


def test_a_run_of_text_free_ids_keeps_the_window_short():
    """Ids that decode to nothing (special tokens, left out) move the window on past WINDOW of them."""
    tokenizer = TOKENIZERS["tiny"]
    decode = DECODERS["tiny"]
    seen: list[int] = []
    counting = StopText(lambda ids: seen.append(len(ids)) or decode(ids))
    hello = tokenizer.encode("Hello").ids
    ids = hello + [0] * 100 + tokenizer.encode(" there").ids
    assert "".join(counting.push(i) for i in ids) + counting.finish() == "Hello there"
    assert max(seen) <= WINDOW + 2
