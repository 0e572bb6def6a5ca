"""Chat request preparation on the CPU: parse_chat (render the messages, encode them, prove the message starts)
for chats of 100 / 1,000 / 2,000 messages, the first turn (nothing cached) and the next turn (two messages more,
the first turn's starts cached in the Service's StartCache).

Prints one JSON line per measurement: the chat's messages, characters and prompt tokens, the turn, the seconds of
the whole preparation (best of --repeat) and of its parts: rendering and encoding the prompt once, and proving the
starts (renders of probes and the proof's encodes). The next turn's start proving is flat in the history's length;
what grows with it is the one render and encode of the prompt every request needs.

    python bench/prepare_chat.py --template tests/core/chat/templates/Qwen3.5-4B.jinja --sizes 100 1000 2000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import attrs
from tokenizers import AddedToken, Tokenizer

from tensorfold.chat.start_cache import StartCache
from tensorfold.engine.api import Sampling
from tensorfold.server.params import parse_chat
from tensorfold.server.starts import start_positions
from tensorfold.service import Service
from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold.tokenizer import ChatTokenizer

SPECIALS = ("<|im_start|>", "<|im_end|>")
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
WORDS = ("the kept state resumes where the conversation left off and no token is prefilled twice "
         "attention layers grow a cache of keys and values while mamba layers carry a recurrent state ").split()


def tokenizer(directory: Path, template: Path | None) -> ChatTokenizer:
    """The tests' tiny byte-level tokenizer, with the Qwen family's added tokens (single tokens, as in the
    checkpoint), and the given template (default: ChatML)."""
    write_tiny_tokenizer(directory, 512)
    inner = Tokenizer.from_file(str(directory / "tokenizer.json"))
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    inner.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    inner.save(str(directory / "tokenizer.json"))
    return ChatTokenizer(directory, template=template.read_text() if template else None)


def chat(messages: int, chars: int, seed: int = 0) -> list[dict]:
    """A system prompt, then user and assistant turns alternating, ending with a user message."""
    def text(n: int) -> str:
        words = [WORDS[(n * 7 + i) % len(WORDS)] for i in range(chars // 6)]
        return f"turn {n}: " + " ".join(words)
    out = [{"role": "system", "content": "You are a helpful assistant. " + text(seed)}]
    while len(out) < messages - 1:
        out.append({"role": "user", "content": text(len(out))})
        out.append({"role": "assistant", "content": text(len(out))})
    return out[:messages - 1] + [{"role": "user", "content": text(messages)}]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", type=Path, default=None, help="a chat template file (default: ChatML)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 2000])
    parser.add_argument("--chars", type=int, default=500, help="characters per message")
    parser.add_argument("--repeat", type=int, default=3, help="runs per next-turn measurement (the best is kept)")
    args = parser.parse_args()
    tok = tokenizer(Path(tempfile.mkdtemp()), args.template)
    template = args.template.name if args.template else "chatml"
    service = Service(engine=None, tokenizer=tok, model_name="bench", family="bench", context=1 << 40,
                      defaults=Sampling(), request_starts=True)
    for size in args.sizes:
        first = chat(size, args.chars)
        nxt = first + [{"role": "assistant", "content": "Because air scatters blue light more."},
                       {"role": "user", "content": "Why is the sky blue?"}]
        for turn, messages in (("first", first), ("next", nxt)):
            runs = []
            for _ in range(1 if turn == "first" else args.repeat):
                warm = attrs.evolve(service, starts_cache=StartCache())
                if turn == "next":  # the first turn's starts are cached, as a served conversation's are
                    parse_chat({"messages": first, "max_tokens": 1}, warm)
                prepare, params = timed(lambda s=warm, m=messages: parse_chat({"messages": m, "max_tokens": 1}, s))
                cache = StartCache()
                if turn == "next":
                    parse_chat({"messages": first, "max_tokens": 1}, attrs.evolve(service, starts_cache=cache))
                ids = list(params.prompt)
                text = tok.render(messages, add_generation_prompt=True)
                prompt_s, _ = timed(lambda m=messages: tok.encode(tok.render(m, add_generation_prompt=True)))
                starts_s, _ = timed(lambda c=cache, t=text, i=ids, m=messages:
                                    start_positions(tok, m, i, {}, t, True, c))
                runs.append((prepare, prompt_s, starts_s, params))
            prepare, prompt_s, starts_s, params = min(runs, key=lambda r: r[0])
            print(json.dumps({"bench": "prepare_chat", "template": template, "messages": len(messages),
                              "chars": len(text), "prompt_tokens": len(params.prompt), "turn": turn,
                              "starts": len(params.starts), "prepare_s": round(prepare, 4),
                              "prompt_render_encode_s": round(prompt_s, 4), "starts_s": round(starts_s, 4)}),
                  flush=True)


if __name__ == "__main__":
    main()
