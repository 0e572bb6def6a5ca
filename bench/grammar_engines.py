"""Grammar engines for structured output on the CPU: llguidance and xgrammar, compile time and per-token mask time.

For each engine, tokenizer and grammar, one JSON line per measurement:

    setup      building the engine's tokenizer object from the vocabulary (once per served model)
    compile    a grammar compiled cold (no cache): what the first request with a new schema waits for
    matcher    a per-request matcher from the compiled grammar (llguidance: deep_copy of a pristine one)
    mask       per token of a valid output: filling the next-token bitmask (int32 words), then consuming the token;
               n, mean, p50, p90, p99 and max in microseconds
    apply      the engine's side, whichever library fills the masks: the sampler's pass (engine/sampler.py
               `adjusted`) unpacking the bitmasks of R constrained rows of a [B, V] step and masking them, on the CPU

Grammars: `tool_call` (an OpenAI tool-call JSON schema: nested objects, arrays, enums), `json_object` (the schema
{"type": "object"}) and `regex` (an e-mail address). Tokenizers: a ~50k byte-level BPE trained here on Python's
own sources (cached under --cache), and the tiny tokenizer of the test checkpoints. The matchers of both run one
at a time on one thread, as the engine's step loop calls them. Never run in CI.

    pip install llguidance                                                          # the engine we serve with
    pip install --target /tmp/xg --no-deps xgrammar apache-tvm-ffi                  # never let it touch torch
    PYTHONPATH=/tmp/xg python bench/grammar_engines.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tensorfold.engine.api import Sampling
from tensorfold.engine.sampler import Allowed, SampleRow, adjusted
from tensorfold.testing.tiny_tokenizer import build_tokenizer

EOS = "<|endoftext|>"
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search_flights", "book_hotel"]},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "object", "properties": {
                    "city": {"type": "string"}, "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
                    "coordinates": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}},
                    "required": ["city", "country"], "additionalProperties": False},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "include": {"type": "array", "items": {"type": "string", "enum": ["wind", "rain", "uv", "pollen"]}},
                "passengers": {"type": "array", "items": {"type": "object", "properties": {
                    "name": {"type": "string"}, "age": {"type": "integer"},
                    "seat": {"type": "string", "enum": ["aisle", "window", "middle"]}},
                    "required": ["name", "age"], "additionalProperties": False}},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_CALL = {"name": "get_weather", "arguments": {
    "location": {"city": "Paris", "country": "FR", "coordinates": [48.8566, 2.3522]}, "unit": "celsius", "days": 3,
    "include": ["wind", "rain"], "passengers": [{"name": "Ada Lovelace", "age": 36, "seat": "window"}]}}
ANY_OBJECT = {"id": "chatcmpl-123", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
              "logprobs": None, "finish_reason": "stop"}], "usage": {"prompt_tokens": 9, "completion_tokens": 12},
              "tags": ["a", "b", 3, 4.5, True, False, None], "nested": {"deep": {"deeper": {"deepest": [[], {}]}}}}
EMAIL = r"[a-z0-9._%+-]{1,64}@[a-z0-9.-]{1,253}\.[a-z]{2,10}"
CASES = {  # name: (kind, source, a valid output)
    "tool_call": ("json_schema", json.dumps(TOOL_SCHEMA), json.dumps(TOOL_CALL)),
    "json_object": ("json_schema", json.dumps({"type": "object"}), json.dumps(ANY_OBJECT)),
    "regex": ("regex", EMAIL, "ada.lovelace+engines@analytical-society.example.org"),
}


def python_sources(limit_bytes: int) -> Iterator[str]:
    """Text of the Python stdlib's sources, up to `limit_bytes`: a realistic mix of code, prose and symbols."""
    total = 0
    for path in sorted(Path(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}")
                       .rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total >= limit_bytes:
            return


def trained_bpe(vocab_size: int, cache: Path) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids trained on the stdlib's sources, cached as tokenizer.json."""
    path = cache / f"bpe-{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(python_sources(40_000_000), trainer=trainer)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds one call took, and what it returned."""
    started = time.perf_counter()
    out = call()
    return time.perf_counter() - started, out


def spread(seconds: list[float]) -> dict[str, float | int]:
    """n, mean, p50, p90, p99 and max of a list of durations, in microseconds."""
    us = sorted(s * 1e6 for s in seconds)
    at = lambda q: us[min(len(us) - 1, int(q * len(us)))]  # noqa: E731
    return {"n": len(us), "mean_us": round(statistics.fmean(us), 1), "p50_us": round(at(0.5), 1),
            "p90_us": round(at(0.9), 1), "p99_us": round(at(0.99), 1), "max_us": round(us[-1], 1)}


class Llguidance:
    """llguidance 1.9: LLTokenizer from tokenizer.json, LLMatcher per grammar, bitmask filled in place."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        import llguidance

        self.llg = llguidance
        self.vocab = tokenizer.get_vocab_size()
        self.setup_s, self.tokenizer = timed(lambda: llguidance.LLTokenizer(tokenizer.to_str(), eos_token=[eos]))

    def compile(self, kind: str, source: str) -> Any:
        matcher = self.llg.LLMatcher(self.tokenizer, self.llg.grammar_from(kind, source), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, row: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    """xgrammar 0.2: TokenizerInfo from the byte-level vocabulary, GrammarCompiler (cache off), GrammarMatcher."""

    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.vocab = tokenizer.get_vocab_size()
        by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])

        def setup() -> Any:
            info = xgrammar.TokenizerInfo([token for token, _ in by_id], xgrammar.VocabType.BYTE_LEVEL,
                                          vocab_size=self.vocab, stop_token_ids=[eos])
            return xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

        self.setup_s, self.compiler = timed(setup)

    def compile(self, kind: str, source: str) -> Any:
        if kind == "regex":
            return self.compiler.compile_regex(source)
        return self.compiler.compile_json_schema(source)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, row: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(row[None], 0)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


def allowed(row: torch.Tensor, token: int) -> bool:
    """Whether the bitmask row allows `token` (bit token % 32 of word token // 32)."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def measure(engine: Any, tokenizer_name: str, tokenizer: Tokenizer, repeats: int) -> Iterator[dict[str, Any]]:
    """The JSON lines of one engine on one tokenizer."""
    base = {"engine": engine.name, "tokenizer": tokenizer_name, "vocab": engine.vocab}
    yield {**base, "what": "setup", "seconds": round(engine.setup_s, 4)}
    row = torch.zeros((engine.vocab + 31) // 32, dtype=torch.int32)
    for case, (kind, source, output) in CASES.items():
        compiles = []
        for _ in range(repeats):
            seconds, compiled = timed(lambda kind=kind, source=source: engine.compile(kind, source))
            compiles.append(seconds)
        yield {**base, "case": case, "what": "compile", "seconds": round(min(compiles), 5),
               "all": [round(s, 5) for s in compiles]}
        tokens = tokenizer.encode(output, add_special_tokens=False).ids
        fills: list[float] = []
        consumes: list[float] = []
        starts: list[float] = []
        for _ in range(repeats):
            seconds, matcher = timed(lambda compiled=compiled: engine.matcher(compiled))
            starts.append(seconds)
            for token in tokens:
                seconds, _ = timed(lambda matcher=matcher: engine.fill(matcher, row))
                fills.append(seconds)
                if not allowed(row, token):
                    raise AssertionError(f"{engine.name} {case}: the mask refuses token {token} of a valid output")
                seconds, ok = timed(lambda matcher=matcher, token=token: engine.consume(matcher, token))
                consumes.append(seconds)
                if not ok:
                    raise AssertionError(f"{engine.name} {case}: token {token} of a valid output not consumed")
        yield {**base, "case": case, "what": "matcher", **spread(starts)}
        yield {**base, "case": case, "what": "mask", "tokens": len(tokens), **spread(fills)}
        yield {**base, "case": case, "what": "consume", **spread(consumes)}


def packed(keep: torch.Tensor) -> torch.Tensor:
    """Booleans [R, 32 * W] as the engine's int32 bitmask [R, W] (bit t % 32 of word t // 32)."""
    words = (keep.view(keep.shape[0], -1, 32).long() << torch.arange(32)).sum(-1)
    return words.to(torch.int32)  # wraps the top bit into the sign, as the int32 words hold it


PATTERNS: dict[str, Callable[[torch.Tensor, torch.Generator], None]] = {
    "few": lambda keep, _: keep[:, ::997].fill_(True),                 # a structural point: 1 token in 997
    "most": lambda keep, _: keep.fill_(True)[:, ::13].fill_(False),    # inside a string: all but 1 in 13
    "random": lambda keep, g: keep.copy_(torch.rand(keep.shape, generator=g) > 0.5),  # no grammar: the worst case
}


def apply_cost(vocab: int, repeats: int) -> Iterator[dict[str, Any]]:
    """The sampler's mask pass for R constrained rows of B, for each mask pattern: what a step with grammars adds."""
    generator = torch.Generator().manual_seed(0)
    for batch, constrained in ((1, 1), (8, 1), (8, 8), (64, 8)):
        for name, pattern in PATTERNS.items():
            logits = torch.randn((batch, vocab), generator=generator)
            rows = [SampleRow.of(Sampling(temperature=0.0))] * batch
            allowed = Allowed.empty(range(constrained), vocab, logits.device)
            keep = torch.zeros((constrained, allowed.bits.shape[1] * 32), dtype=torch.bool)
            pattern(keep, generator)
            allowed.bits.copy_(packed(keep))
            counters = [0] * batch

            def step(logits: torch.Tensor = logits, rows: list[SampleRow] = rows, counters: list[int] = counters,
                     allowed: Allowed = allowed) -> torch.Tensor:
                return adjusted(logits, rows, counters, allowed)

            seconds = [timed(step)[0] for _ in range(20 * repeats)]
            yield {"what": "apply", "vocab": vocab, "batch": batch, "constrained": constrained, "mask": name,
                   **spread(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="llguidance,xgrammar")
    parser.add_argument("--vocab", type=int, default=50_000, help="ids of the BPE trained on the stdlib")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/tensorfold-grammar-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds, big = timed(lambda: trained_bpe(args.vocab, args.cache))
    print(json.dumps({"what": "train_bpe", "vocab": big.get_vocab_size(), "seconds": round(seconds, 2)}), flush=True)
    tiny = build_tokenizer(512)
    tokenizers = {f"bpe{args.vocab // 1000}k": (big, big.token_to_id(EOS)),
                  "tiny512": (tiny, tiny.token_to_id("<|im_end|>"))}
    for line in apply_cost(big.get_vocab_size(), args.repeats):
        print(json.dumps(line), flush=True)
    kinds = {"llguidance": Llguidance, "xgrammar": Xgrammar}
    for name in args.engines.split(","):
        for tokenizer_name, (tokenizer, eos) in tokenizers.items():
            for line in measure(kinds[name](tokenizer, eos), tokenizer_name, tokenizer, args.repeats):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
