"""What the --learn-conversations server tests share: the tiny server's flags, a conversation's turns, a fresh
server's replies to compare with, and the reads they make of a real server (/memory, the disk tier's counters)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from tensorfold.testing.process import serving
from tensorfold.testing.served import FIRST, SECOND, SYSTEM, ask, turns
from tensorfold.tokenizer import ChatTokenizer

FILLER = [{"role": "system", "content": "You are a patient tutor. " * 6},
          {"role": "user", "content": "Tell me everything about rivers. " * 9}]
GRID = ["--context", "1024", "--page-rows", "16", "--prefill-chunk", "128", "--min-chunk", "16", "--parallel", "2"]
# device: the conversation's two states (59 rows of pages and copies) fit, the filler's system end (86) beside
# them does not; host: both conversation states (91 rows) fit, the filler's history end (237) beside either not
SMALL_TIERS = ["--prompt-cache-gib", "0.000105", "--host-cache-gib", "0.00025"]
NO_TIERS = ["--prompt-cache-gib", "0", "--host-cache-gib", "0"]
ENV = {"TF_KV_POISON": "1", "TF_IMPRINT_VERIFY": "1", "PYTHONUNBUFFERED": "1"}


def serve_args(model: Path, *extra: str) -> list[str]:
    """serve's flags for the tiny example checkpoint on the tests' grid."""
    return ["--family", "example", "--model", str(model), *GRID, *extra]


def learn_args(root: Path) -> list[str]:
    """The disk tier on `root`, with no free-space floor (a test machine's disk may be nearly full)."""
    return ["--learn-conversations", "--learn-dir", str(root), "--learn-min-free-gib", "0"]


def sample(metrics: str, name: str) -> float:
    """One unlabelled sample's value in /metrics text."""
    found = re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)
    assert found is not None, f"{name} is not in /metrics"
    return float(found.group(1))


def memory(url: str) -> dict:
    """/memory: the plan and the numbers now."""
    return httpx.get(f"{url}/memory", timeout=10).json()


def written(url: str, states: int) -> dict:
    """/memory once the disk tier's I/O thread is idle with at least `states` states on disk."""
    deadline = time.monotonic() + 20
    while True:
        now = memory(url)["now"]
        if (now["disk_waiting"] == 0 and now["disk_states"] >= states) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def settled(url: str) -> dict:
    """/memory once the disk tier's I/O thread has nothing staged (whatever it did with it)."""
    deadline = time.monotonic() + 20
    while True:
        now = memory(url)["now"]
        if now["disk_waiting"] == 0 or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def fresh_conversation(url: str, tokenizer: ChatTokenizer, system: str = SYSTEM, question: str = FIRST,
                       more: str = SECOND) -> dict:
    """On a server that keeps nothing: a conversation's two turns, and where its first turn's history ends."""
    one, _ = turns(None, system, question, more)
    first = ask(url, one)
    two = turns(first, system, question, more)[1]
    second = ask(url, two)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    history = len(tokenizer.encode(tokenizer.render(one, False)))
    return {"first": first, "second": second, "history": history, "one": one, "messages": two}


def fresh_server(model: Path, log: Path, tokenizer: ChatTokenizer, *conversations: tuple[str, str, str]) -> list[dict]:
    """A server with every tier off: each conversation's fresh replies (fresh_conversation)."""
    with serving(serve_args(model, *NO_TIERS), log, env=ENV) as url:
        return [fresh_conversation(url, tokenizer, *talk) for talk in conversations]


def check_resumed(second: dict, fresh: dict, at: int | None = None) -> None:
    """The turn's token ids are the fresh server's, and it resumed at `at` (the history end when not given)."""
    assert second["choices"][0]["token_ids"] == fresh["second"]["choices"][0]["token_ids"]
    assert second["usage"]["prompt_tokens"] == fresh["second"]["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (fresh["history"] if at is None else at)
