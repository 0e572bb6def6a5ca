"""The reuse gate end to end: tools/reuse_gate.py records every scenario against a real cache-on server (small
device and host tiers, so states move device → host → evicted), replays the requests to a real cache-off server
it starts itself, and compares: identical tokens, the predicted resume rows, /metrics in step with usage, and
resumed turns faster to their first token. Then the same files, altered, must fail the gate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gate.records import Run
from tensorfold.testing.process import serving, tail

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
    assert verdict["ttft_ratio"] < 0.8


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
                                            ("slow resume", "median TTFT resumed is")])
def test_an_altered_run_fails_the_gate(runs, what, says, tmp_path):
    recorded, replay, _ = runs

    def change(data):
        exchanges = [e for e in data["exchanges"] if e["reply"]["cached_tokens"] > 0]
        if what == "token":
            exchanges[0]["reply"]["token_ids"][0] += 1
        elif what == "resume row":
            exchanges[0]["expected_cached"] -= 1
        elif what == "slow resume":
            for e in data["exchanges"]:
                e["reply"]["ttft_s"] = 10.0

    if what == "cached on the fresh server":
        def change_fresh(data):
            data["exchanges"][-1]["reply"]["cached_tokens"] = 5
        replay = altered(replay, tmp_path / "replay.json", change_fresh)
    else:
        recorded = altered(recorded, tmp_path / "recorded.json", change)
    compared = gate("compare", recorded, replay)
    assert compared.returncode == 1 and says in compared.stdout, compared.stdout
