"""Structured output: a request's grammar turned into the allowed-token mask of each next token (llguidance).

    spec       GrammarSpec(kind, source): a JSON schema (its text), any JSON object, a regex, a JSON list of choice
               strings, or a Lark grammar (llguidance's dialect)
    grammars   Grammars is built once at startup from the served tokenizer, the model's vocabulary size and its end
               tokens; llguidance is imported, and its tokenizer built, when the first request with a grammar comes,
               so a server without llguidance starts and only such requests are refused (`problem`)
    compile    each (kind, source) is compiled once into a pristine matcher, kept in a bounded LRU with the problems
               of invalid specs; a request's Matcher is a copy of it
    JSON       between JSON tokens, up to `json_whitespace` whitespace characters (room to indent, never the endless
               run of spaces or newlines a model may fall into once whitespace is free); a schema's own
               "x-guidance" options (llguidance's) win over this
    mask       Matcher.allowed writes the next token's mask as int32 words, bit t % 32 of word t // 32 allowing
               token t (`mask_words`); ids past the tokenizer's are never allowed, special tokens only where
               the grammar spells them, the end tokens once the grammar may end; once it must end, only they
    threads    Grammars may be called from any thread (a lock); a Matcher is used on the engine thread alone
Why llguidance and not xgrammar: docs/structured-output.md.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
CACHED_GRAMMARS = 256       # compiled grammars (and invalid specs) kept, least recently used dropped first
PROBLEM_CHARS = 500         # an engine's error message is cut to this for a client
JSON_WHITESPACE = 20        # whitespace characters between two JSON tokens: a newline and indentation to depth 9
ANY_OBJECT = '{"type": "object"}'
MISSING = "structured output needs the llguidance package: pip install 'llguidance>=1.9.1,<1.10'"


def mask_words(vocab: int) -> int:
    """Int32 words of one row's allowed-token bitmask: bit t % 32 of word t // 32 allows token t (llguidance's and
    xgrammar's layout, so the engine fills a row in place; the sampler unpacks it)."""
    return (vocab + 31) // 32


class GrammarError(ValueError):
    """A grammar cannot go on: it refused the sampled token, or its matcher failed; fails that request alone."""


@attrs.frozen
class GrammarSpec:
    """What a request's output must match: `source` is the schema's JSON text, a regex, a JSON list of choice
    strings or a Lark grammar; for json_object it is unused ("")."""

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    source: str = ""


class Matcher:
    """One request's grammar state: the next token's mask, advanced by each token sampled."""

    def __init__(self, inner: Any, vocab_size: int, words: int) -> None:
        self._inner = inner                  # llguidance.LLMatcher
        self._vocab = vocab_size
        self._scratch = torch.zeros(words, dtype=torch.int32) if words != mask_words(vocab_size) else None

    def allowed(self, out: torch.Tensor) -> None:
        """Write the mask of the tokens the grammar allows next into `out`, int32 [mask_words(vocab)] on the host,
        contiguous; raises GrammarError if the matcher failed (it would allow only the end tokens)."""
        if out.dtype != torch.int32 or out.device.type != "cpu" or out.shape != (mask_words(self._vocab),) \
                or not out.is_contiguous():
            raise ValueError(f"a mask row is int32 [{mask_words(self._vocab)}] contiguous on the host, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        target = out if self._scratch is None else self._scratch
        self._inner.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        if self._inner.is_error():
            raise GrammarError(f"the grammar failed: {_first_line(self._inner.get_error())}")
        if self._scratch is not None:
            out.copy_(self._scratch[: out.numel()])

    def advance(self, token_id: int) -> None:
        """Take the sampled token; raises GrammarError if the grammar does not allow it here."""
        if not 0 <= token_id < self._vocab or not self._inner.consume_token(token_id):
            error = self._inner.get_error() if token_id < self._vocab else ""
            raise GrammarError(f"the grammar does not allow token {token_id} here"
                               + (f": {_first_line(error)}" if error else ""))

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing may follow but an end token: the stream ends with "stop"."""
        return bool(self._inner.is_stopped()) and not self._inner.is_error()


class Grammars:
    """The served model's grammar compiler: checks specs and hands out per-request Matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...],
                 cached: int = CACHED_GRAMMARS, json_whitespace: int = JSON_WHITESPACE) -> None:
        if not eos_ids:
            raise ValueError("a grammar needs at least one end token id to finish on")
        if any(not 0 <= eos < vocab_size for eos in eos_ids):
            raise ValueError(f"end token ids {eos_ids} must lie in the vocabulary of {vocab_size}")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self._cached = cached
        self._json_options = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{json_whitespace}}}"}
        self._words = mask_words(max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True)))
        self._lock = threading.Lock()
        self._library: Any = None       # the llguidance module, once imported
        self._ll_tokenizer: Any = None  # its LLTokenizer, built at the first grammar
        self._compiled: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()

    def problem(self, spec: GrammarSpec) -> str | None:
        """Why `spec` cannot be served (for a 400), or None; compiles it once, so a valid spec's matcher is ready."""
        compiled = self._compile(spec)
        return compiled if isinstance(compiled, str) else None

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for one request; raises ValueError with `problem`'s words for an invalid spec."""
        compiled = self._compile(spec)
        if isinstance(compiled, str):
            raise ValueError(compiled)
        with self._lock:
            inner = compiled.deep_copy()
        return Matcher(inner, self.vocab_size, self._words)

    def _compile(self, spec: GrammarSpec) -> Any:
        """The pristine matcher of a spec, or the problem with it, from the LRU or compiled now."""
        key = (spec.kind, "" if spec.kind == "json_object" else spec.source)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
            library = self._load()
            if library is None:
                return MISSING
            compiled = self._build(library, *key)
            self._compiled[key] = compiled
            while len(self._compiled) > self._cached:
                self._compiled.popitem(last=False)
            return compiled

    def _load(self) -> Any:
        """llguidance and its tokenizer, on first use (under the lock); None when it is not installed."""
        if self._library is None:
            try:
                import llguidance
            except ImportError:
                return None
            vocab = max(self.vocab_size, self._tokenizer.get_vocab_size(with_added_tokens=True))
            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.to_str(), n_vocab=vocab,
                                                        eos_token=list(self.eos_ids))
            self._library = llguidance
        return self._library

    def _build(self, library: Any, kind: str, source: str) -> Any:
        """Compile one spec: its pristine LLMatcher, or a string saying what is wrong with it."""
        problem = _source_problem(kind, source)
        if problem is not None:
            return problem
        try:
            if kind in ("json_schema", "json_object"):
                grammar = library.LLMatcher.grammar_from_json_schema(source if kind == "json_schema" else ANY_OBJECT,
                                                                     defaults=self._json_options)
            else:
                grammar = library.grammar_from(kind, source)
            matcher = library.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        except (ValueError, TypeError, RuntimeError) as err:
            return _cut(f"invalid {_WHAT[kind]}: {err}")
        if matcher.is_error():
            return _cut(f"invalid {_WHAT[kind]}: {matcher.get_error()}")
        return matcher


_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "choice": "choice list", "lark": "Lark grammar"}


def _source_problem(kind: str, source: str) -> str | None:
    """What the engine can tell of a source before compiling it: JSON that does not parse, the wrong JSON shape."""
    if kind in ("regex", "lark") and not source:
        return f"the {_WHAT[kind]} is empty"
    if kind not in ("json_schema", "choice"):
        return None
    try:
        value = json.loads(source)
    except ValueError as err:
        return f"the {_WHAT[kind]} is not valid JSON: {err}"
    if kind == "json_schema" and not isinstance(value, dict | bool):
        return "a JSON schema must be a JSON object (or a boolean)"
    if kind == "choice" and (not isinstance(value, list) or not value
                             or not all(isinstance(item, str) and item for item in value)):
        return "choices must be a JSON list of at least one non-empty string"
    return None


def _first_line(message: str) -> str:
    """The first line of an engine's message (its later lines dump the parser state)."""
    return message.strip().splitlines()[0] if message.strip() else "no reason given"


def _cut(message: str) -> str:
    """A problem short enough for a client."""
    message = message.strip()
    return message if len(message) <= PROBLEM_CHARS else message[: PROBLEM_CHARS - 3] + "..."
