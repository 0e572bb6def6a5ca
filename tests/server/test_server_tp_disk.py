"""The disk tier through `tensorfold serve --tp 2 --learn-conversations` (real processes, the openai client, qwen's
tiny hybrid checkpoint): a server answers a chat's first turn and is stopped with SIGTERM, which writes every
rank's part of the state kept at the turn's history end (rank 0's in --learn-dir, rank 1's in `rank-1/` below it);
a new `--tp 2` server on the same directory resumes the second turn from disk (usage cached_tokens, /memory and
/metrics say disk) with the greedy tokens of a `--tp 1` server with every tier off; a `--tp 1` server on the same
directory reads none of it (its identity names another TP world). Then `tensorfold learned` (real processes) lists
every rank's parts, verifies them, and removes a state, then the identity, from every rank's store at once. Slow:
each server starts its ranks."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from learn_files import learned
from test_server_tp import client_of

from tensorfold.plugins import load_families
from tensorfold.testing.process import serving

FLAGS = ("--family", "qwen", "--context", "256", "--parallel", "2", "--prefill-chunk", "32", "--min-chunk", "8",
         "--page-rows", "16")
OFF = ("--prompt-cache-gib", "0", "--host-cache-gib", "0")
SYSTEM = {"role": "system", "content": "You answer briefly."}
TURNS = ("Name three rivers of France.", "And three of Spain?")


def ask(client: openai.OpenAI, messages: list[dict]) -> tuple[list[int], str, int]:
    """One greedy turn: its token ids, its text and its cached prompt tokens."""
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = reply.choices[0]
    details = reply.usage.prompt_tokens_details
    return choice.model_extra["token_ids"], choice.message.content, details.cached_tokens if details else 0


def learning(root: Path, tp: str) -> list[str]:
    return ["--tp", tp, *FLAGS, "--learn-conversations", "--learn-dir", str(root), "--learn-min-free-gib", "0"]


@pytest.mark.slow
def test_a_tp2_server_resumes_from_the_parts_a_tp2_server_wrote_at_sigterm(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    load_families(["qwen"])["qwen"].make_tiny(model, seed=0)
    one = [SYSTEM, {"role": "user", "content": TURNS[0]}]
    with serving([str(model), "--tp", "1", *FLAGS, *OFF], tmp_path / "off.log") as url:
        plain_first, said, _ = ask(client_of(url), one)
        two = [*one, {"role": "assistant", "content": said}, {"role": "user", "content": TURNS[1]}]
        plain_second, _, _ = ask(client_of(url), two)
    root, log = tmp_path / "learned", tmp_path / "tp2.log"
    with serving([str(model), *learning(root, "2")], log) as url:
        assert ask(client_of(url), one)[0] == plain_first
    text = log.read_text()      # SIGTERM: rank 0 wrote its parts, rank 1 flushed its own before it exited
    assert "disk tier closed: 2 states written at shutdown" in text and ", 0 dropped" in text, text[-3000:]
    assert "rank 1: disk parts flushed" in text and "0 dropped" in text.split("rank 1: disk parts flushed")[1]
    assert len(list(root.glob("*/states/*.st"))) == len(list((root / "rank-1").glob("*/states/*.st"))) == 2

    with serving([str(model), *learning(root, "2")], log) as url:
        second, _, cached = ask(client_of(url), two)
        now = httpx.get(f"{url}/memory", timeout=10).json()["now"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert second == plain_second and cached > 0
    assert now["tiers"]["disk"]["hits"] == 1 and now["tiers"]["disk"]["cached_tokens"] == cached
    assert now["disk_failed_reads"] == 0 and now["integrity_when_idle"] == "ok"
    assert 'tensorfold_tier_hits_total{tier="disk"} 1.0' in metrics
    assert "from disk" in log.read_text() and "Traceback" not in log.read_text()

    with serving([str(model), *learning(root, "1")], tmp_path / "tp1.log") as url:
        alone, _, cached = ask(client_of(url), two)
        now = httpx.get(f"{url}/memory", timeout=10).json()["now"]
    assert alone == plain_second and cached == 0 and now["tiers"]["disk"]["hits"] == 0

    listed = {(i["store"], i["facts"].get("tp_world"), i["facts"].get("tp_rank")): i
              for i in json.loads(learned(root, "ls", "--json").stdout)}
    assert set(listed) == {(".", "2", "0"), ("rank-1", "2", "1"), (".", "1", None)}, listed
    rank0, rank1 = listed[(".", "2", "0")], listed[("rank-1", "2", "1")]
    assert rank0["states"] == rank1["states"] >= 2
    assert "tp=2 rank 1" in learned(root, "ls").stdout and learned(root, "verify").returncode == 0
    shown = json.loads(learned(root, "show", rank0["identity"][:12], "--json").stdout)
    longest = max(shown["states"], key=lambda e: e["tokens"])
    removed = learned(root, "rm", rank0["identity"][:12], "--state", longest["key"][:16])
    assert removed.returncode == 0, removed.stderr
    after = {(i["store"], i["facts"].get("tp_rank")): i["states"]
             for i in json.loads(learned(root, "ls", "--json").stdout)}
    assert after[(".", "0")] == after[("rank-1", "1")] == rank0["states"] - 1      # one state gone from both parts
    gone = learned(root, "rm", rank1["identity"][:12])                             # a follower's part names them all
    assert gone.returncode == 0, gone.stderr
    left = json.loads(learned(root, "ls", "--json").stdout)
    assert [(i["store"], i["facts"].get("tp_world")) for i in left] == [(".", "1")]
    assert not list((root / "rank-1").glob("*/states/*.st")) and learned(root, "verify").returncode == 0
