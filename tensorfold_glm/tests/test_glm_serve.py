"""GLM through real `tensorfold serve --family glm` processes on the embedded tiny checkpoint (no --model; NaN-
poisoned pages): chat and completions answer the real openai client; an image part is refused by name with a 400;
the reuse gate (tools/reuse_gate.py, every scenario) passes against a cache-on server with small device and host
tiers and a cache-off replay; and with --learn-conversations a state written at SIGTERM is read by a new server
process, whose next turn's token ids equal a fresh server's and resume at the first turn's history end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tensorfold.embedded import embedded_checkpoint
from tensorfold.plugins import load_families
from tensorfold.testing.process import serving, tail
from tensorfold.testing.served import ask, check_chat_and_completions, openai_client, turns
from tensorfold.tokenizer import ChatTokenizer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

GATE = Path(__file__).resolve().parents[2] / "tools" / "reuse_gate.py"
GATE_GRID = ["--prefill-chunk", "512", "--min-chunk", "32"]
GATE_SERVE = ["--family", "glm", "--context", "4096"]
# about 0.3 and 0.6 MiB: the eviction scenario pushes states device -> host -> out with a few fillers
GATE_CACHED = ["--prompt-cache-gib", "0.0003", "--host-cache-gib", "0.0006"]
GATE_SCALE = "0.5"  # messages at half length: histories still cross the 512-row grid, in half the time

LEARN_GRID = ["--family", "glm", "--context", "1024", "--page-rows", "16", "--prefill-chunk", "128",
              "--min-chunk", "16", "--parallel", "2"]
NO_TIERS = ["--prompt-cache-gib", "0", "--host-cache-gib", "0"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """XDG_CACHE_HOME of every server here: the first one writes the embedded default, the others read it."""
    return tmp_path_factory.mktemp("glm-cache")


def env(cache: Path, **more: str) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(cache), "TF_KV_POISON": "1", "PYTHONUNBUFFERED": "1", **more}


@pytest.fixture(scope="module")
def base(cache):
    log = cache / "server.log"
    with serving(["--family", "glm", "--context", "512", "--parallel", "4"], log, env=env(cache)) as url:
        yield url
    assert "wrote the embedded default of family glm" in tail(log)


@pytest.fixture(scope="module")
def tokenizer(base, cache) -> ChatTokenizer:
    """The embedded checkpoint's tokenizer (the directory the first server wrote, found as serve finds it)."""
    return ChatTokenizer(embedded_checkpoint(load_families(["glm"])["glm"], cache / "tensorfold"))


def test_chat_and_completions_on_the_embedded_glm(base):
    assert check_chat_and_completions(base, "Hello, GLM").startswith("glm-")


def test_an_image_is_refused_by_name(base):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "image" in error["message"] and error["param"] == "messages[0].content[1]"
    client = openai_client(base)
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])


# -- the reuse gate ---------------------------------------------------------------------------------------------


def gate(cache: Path, *args: str | Path) -> subprocess.CompletedProcess:
    """Run the gate's command line (a server it starts finds the embedded default in `cache`)."""
    return subprocess.run([sys.executable, str(GATE), *map(str, args)], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "XDG_CACHE_HOME": str(cache)})


def test_the_reuse_gate_passes(base, cache, tmp_path):
    with serving([*GATE_SERVE, *GATE_CACHED, *GATE_GRID], tmp_path / "cached.log", env=env(cache)) as url:
        recorded = gate(cache, "record", "--url", url, "--out", tmp_path / "recorded.json", "--scale", GATE_SCALE,
                        *GATE_GRID)
        assert recorded.returncode == 0, recorded.stderr + tail(tmp_path / "cached.log")
    replayed = gate(cache, "replay", tmp_path / "recorded.json", "--serve", " ".join(GATE_SERVE),
                    "--out", tmp_path / "replay.json", "--log", tmp_path / "fresh.log")
    assert replayed.returncode == 0, replayed.stderr + tail(tmp_path / "fresh.log")
    compared = gate(cache, "compare", tmp_path / "recorded.json", tmp_path / "replay.json",
                    "--json", tmp_path / "verdict.json")
    print("\n" + compared.stdout)
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert compared.returncode == 0 and verdict["passed"], compared.stdout
    scenarios = verdict["scenarios"]
    assert list(scenarios) == ["nine-turns", "alternating", "edited-first", "regenerate", "two-at-once", "eviction"]
    assert scenarios["nine-turns"]["resumed"] == 8 and scenarios["alternating"]["resumed"] == 5
    assert all(numbers["resumed"] > 0 for numbers in scenarios.values())
    record = json.loads((tmp_path / "recorded.json").read_text())
    replay = json.loads((tmp_path / "replay.json").read_text())
    assert record["meta"]["poison"] and replay["meta"]["poison"] and record["integrity"] == replay["integrity"] == "ok"
    assert set(record["meta"]["tiers"]) == {"device", "host"}
    eviction = next(s for s in record["scenarios"] if s["name"] == "eviction")["tiers"]
    assert eviction["device"]["evicted"] > 0 and eviction["host"]["hits"] == 1 and eviction["host"]["evicted"] > 0
    from_host = [e for e in record["exchanges"] if e["expected_tier"] == "host"]
    assert len(from_host) == 1 and from_host[0]["reply"]["cached_tokens"] == from_host[0]["expected_cached"] > 0


# -- the disk tier: a state written at SIGTERM, read by a new server process ------------------------------------


def learn_args(root: Path) -> list[str]:
    return [*LEARN_GRID, "--learn-conversations", "--learn-dir", str(root), "--learn-min-free-gib", "0"]


def test_a_state_written_at_sigterm_is_read_by_a_new_server_process(base, cache, tokenizer, tmp_path):
    one, _ = turns(None)
    with serving([*LEARN_GRID, *NO_TIERS], tmp_path / "fresh.log", env=env(cache)) as url:
        fresh_first = ask(url, one)
        two = turns(fresh_first)[1]
        fresh_second = ask(url, two)
    assert fresh_second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    history = len(tokenizer.encode(tokenizer.render(one, False)))
    root, log = tmp_path / "learned", tmp_path / "server.log"
    learning = env(cache, TF_IMPRINT_VERIFY="1")
    with serving(learn_args(root), log, env=learning) as url:
        first = ask(url, one)
        assert first["choices"][0]["token_ids"] == fresh_first["choices"][0]["token_ids"]
        assert httpx.get(f"{url}/memory", timeout=10).json()["now"]["disk_states"] == 0  # RAM keeps it so far
    text = log.read_text()  # the server got SIGTERM: what RAM kept is on disk
    assert f"kept at {history} (history end) on disk" in text, tail(log)
    assert "disk tier closed: 2 states written at shutdown" in text and ", 0 dropped" in text, tail(log)
    with serving(learn_args(root), log, env=learning) as url:
        second = ask(url, two)
        now = httpx.get(f"{url}/memory", timeout=10).json()["now"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert second["choices"][0]["token_ids"] == fresh_second["choices"][0]["token_ids"]
    assert second["usage"]["prompt_tokens"] == fresh_second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == history
    assert 'tensorfold_tier_hits_total{tier="disk"} 1.0' in metrics
    assert now["tiers"]["disk"]["hits"] == 1 and now["tiers"]["disk"]["cached_tokens"] == history
    assert now["disk_failed_reads"] == now["disk_declined"] == 0 and now["integrity_when_idle"] == "ok"
    assert now["disk_verify_mismatches"] == 0
    assert f"resumed at {history} of {second['usage']['prompt_tokens']} from disk" in log.read_text()
