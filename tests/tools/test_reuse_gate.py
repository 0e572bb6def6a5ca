"""The reuse gate end to end: tools/reuse_gate.py records every scenario against a real cache-on server (small
device and host tiers, so states move device → host → evicted), replays the requests to a real cache-off server
it starts itself, and compares: identical tokens, the predicted resume rows, /metrics in step with usage. What
proves the resumes is counted, not timed: each turn's cached_tokens and the rows each server prefilled. The TTFT
ratio is reported, never asserted here (a loaded CI machine moves it; bench/reuse_ttft.py measures it). Then the
same files, altered, must fail the gate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gate.records import Exchange, Run
from tensorfold.testing.process import serving, tail
from tensorfold.tokenizer import ChatTokenizer

GATE = Path(__file__).resolve().parents[2] / "tools" / "reuse_gate.py"
GRID = ["--prefill-chunk", "512", "--min-chunk", "32"]
SERVE = ["--context", "4096"]
CACHED = ["--prompt-cache-gib", "0.002", "--host-cache-gib", "0.004"]  # about 2 and 4 MiB: eviction is reached
pytestmark = pytest.mark.slow  # two servers and every scenario, recorded once for the module


def gate(*args: str | Path) -> subprocess.CompletedProcess:
    """Run the gate's command line."""
    return subprocess.run([sys.executable, str(GATE), *map(str, args)], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A recording (against a server started here) and its replay (a cache-off server the gate starts)."""
    root = tmp_path_factory.mktemp("reuse-gate")
    made = subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", "qwen", str(root / "m")],
                          capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr
    model = ["--family", "qwen", "--model", str(root / "m"), *SERVE]
    with serving([*model, *CACHED, *GRID], root / "cached.log", env={"TF_KV_POISON": "1"}) as url:
        recorded = gate("record", "--url", url, "--out", root / "recorded.json", *GRID)
        assert recorded.returncode == 0, recorded.stderr + tail(root / "cached.log")
    replayed = gate("replay", root / "recorded.json", "--serve", " ".join(model), "--out", root / "replay.json",
                    "--log", root / "fresh.log")
    assert replayed.returncode == 0, replayed.stderr + tail(root / "fresh.log")
    return root / "recorded.json", root / "replay.json", root


def test_every_scenario_passes_the_gate(runs):
    recorded, replay, root = runs
    compared = gate("compare", recorded, replay, "--json", root / "verdict.json")
    verdict = json.loads((root / "verdict.json").read_text())
    assert compared.returncode == 0 and verdict["passed"], compared.stdout
    scenarios = verdict["scenarios"]
    assert list(scenarios) == ["nine-turns", "alternating", "edited-first", "regenerate", "two-at-once", "eviction"]
    assert scenarios["nine-turns"]["resumed"] == 8 and scenarios["alternating"]["resumed"] == 5
    assert all(numbers["resumed"] > 0 for numbers in scenarios.values())
    assert all(numbers["prefilled"] < numbers["prefilled_fresh"] == numbers["prompt_tokens"]
               for numbers in scenarios.values())  # rows counted: with the cache on, every scenario prefills less
    assert verdict["reused"] >= 8  # nine-turns' last eight turns each resumed most of a prompt of 512+ tokens
    assert verdict["ttft_limit"] is None and isinstance(verdict["ttft_ratio"], float)  # measured, not checked
    assert "measured, not checked" in compared.stdout


def history_end(tokenizer: ChatTokenizer, turn: Exchange) -> int:
    """Where a chat turn's generated reply starts: its messages rendered without the generation prompt."""
    ids = tokenizer.encode(tokenizer.render(turn.body["messages"], add_generation_prompt=False))
    assert tuple(ids) == turn.reply.prompt_token_ids[:len(ids)]
    return len(ids)


def test_each_turn_resumes_where_the_last_ended_and_prefills_only_what_is_new(runs):
    recorded, replay = Run.read(runs[0]), Run.read(runs[1])
    tokenizer = ChatTokenizer(runs[2] / "m")
    turns = [e for e in recorded.exchanges if e.scenario == "nine-turns"]
    ends = [history_end(tokenizer, turn) for turn in turns]
    assert [t.reply.cached_tokens for t in turns] == [t.expected_cached for t in turns] == [0, *ends[:-1]]
    assert len({turn.reply.prompt_tokens - end for turn, end in zip(turns, ends, strict=True)}) == 1  # + gen prompt
    # the conversation is prefilled once: its last prompt, plus each earlier turn's generation prompt (the next
    # turn puts the reply where it stood); the cache-off server prefills every prompt from its first token
    prefilled = sum(t.reply.prompt_tokens - t.reply.cached_tokens for t in turns)
    generation_prompts = sum(t.reply.prompt_tokens - end for t, end in zip(turns[:-1], ends, strict=False))
    assert prefilled == turns[-1].reply.prompt_tokens + generation_prompts
    fresh = [e for e in replay.exchanges if e.scenario == "nine-turns"]
    assert [e.reply.cached_tokens for e in fresh] == [0] * 9
    assert [e.reply.prompt_tokens for e in fresh] == [t.reply.prompt_tokens for t in turns]
    again = next(e for e in recorded.exchanges if e.same_as is not None)  # the regenerated turn: same request
    assert again.reply.cached_tokens == history_end(tokenizer, again) == again.expected_cached
    assert again.reply.token_ids == recorded.exchanges[again.same_as].reply.token_ids


def test_the_runs_are_what_the_gate_says(runs):
    recorded, replay = Run.read(runs[0]), Run.read(runs[1])
    assert recorded.meta["poison"] and replay.meta["poison"]
    assert set(recorded.meta["tiers"]) == {"device", "host"} and replay.meta["tiers"] == {}
    assert recorded.integrity == replay.integrity == "ok"
    eviction = next(s for s in recorded.scenarios if s.name == "eviction")
    assert eviction.tiers["device"]["evicted"] > 0 and eviction.tiers["host"]["kept"] > 0
    assert eviction.tiers["host"]["hits"] == 1 and eviction.tiers["host"]["evicted"] > 0
    from_host = [e for e in recorded.exchanges if e.expected_tier == "host"]
    assert len(from_host) == 1 and from_host[0].reply.cached_tokens == from_host[0].expected_cached > 0
    histories = [e.reply.prompt_tokens for e in recorded.exchanges if e.scenario == "nine-turns"]
    assert histories[-1] > 1500  # long enough that prefill, not HTTP, is what resuming saves


def altered(path: Path, out: Path, change) -> Path:
    """A copy of a gate file with `change` applied to its JSON."""
    data = json.loads(path.read_text())
    change(data)
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(("what", "says"), [("token", "generated tokens differ"),
                                            ("resume row", "the keep policy says"),
                                            ("cached on the fresh server", "the cache-off server reported"),
                                            ("nothing resumed", "too few to show reuse"),
                                            ("slow resume", "median TTFT resumed is")])
def test_an_altered_run_fails_the_gate(runs, what, says, tmp_path):
    recorded, replay, _ = runs

    def change(data):
        exchanges = [e for e in data["exchanges"] if e["reply"]["cached_tokens"] > 0]
        if what == "token":
            exchanges[0]["reply"]["token_ids"][0] += 1
        elif what == "resume row":
            exchanges[0]["expected_cached"] -= 1
        elif what == "nothing resumed":
            for e in exchanges:
                e["reply"]["cached_tokens"] = e["expected_cached"] = 0
        elif what == "slow resume":
            every_ttft(data, 10.0)

    if what == "cached on the fresh server":
        def change_fresh(data):
            data["exchanges"][-1]["reply"]["cached_tokens"] = 5
        replay = altered(replay, tmp_path / "replay.json", change_fresh)
    elif what == "slow resume":
        recorded = altered(recorded, tmp_path / "recorded.json", change)
        replay = altered(replay, tmp_path / "replay.json", lambda data: every_ttft(data, 1.0))
    else:
        recorded = altered(recorded, tmp_path / "recorded.json", change)
    limit = ["--ttft-ratio", "0.8"] if what == "slow resume" else []
    compared = gate("compare", recorded, replay, *limit)
    assert compared.returncode == 1 and says in compared.stdout, compared.stdout


def every_ttft(data, seconds: float) -> None:
    """Every reply of a gate file `seconds` to its first token (set, not measured: the ratio is then exact)."""
    for e in data["exchanges"]:
        e["reply"]["ttft_s"] = seconds


def test_ttft_is_reported_and_checked_only_when_asked(runs, tmp_path):
    recorded, replay, _ = runs
    slow = altered(recorded, tmp_path / "recorded.json", lambda data: every_ttft(data, 10.0))
    replay = altered(replay, tmp_path / "replay.json", lambda data: every_ttft(data, 1.0))
    compared = gate("compare", slow, replay, "--json", tmp_path / "verdict.json")
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert compared.returncode == 0 and verdict["passed"] and verdict["ttft_ratio"] == 10.0, compared.stdout
    assert "10.000 (measured, not checked)" in compared.stdout
    checked = gate("compare", slow, replay, "--ttft-ratio", "0.8")
    assert checked.returncode == 1 and "--ttft-ratio wants at most 0.8×" in checked.stdout, checked.stdout
