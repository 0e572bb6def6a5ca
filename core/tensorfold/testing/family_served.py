"""The served gates a family runs through real `tensorfold serve --family NAME` processes on its embedded tiny
checkpoint (no --model; NaN-poisoned pages):

* `fixtures(family)`: pytest fixtures `cache` (the servers' XDG_CACHE_HOME), `base` (a server on the embedded default,
  which must say it wrote it) and `tokenizer` (the embedded checkpoint's);
* `check_image_refused(url)`: an image part is refused by name with a 400, also through the real openai client;
* `check_reuse_gate(family, cache, tmp_path)`: the reuse gate (tools/reuse_gate.py, every scenario) passes against a
  cache-on server with small device and host tiers and a cache-off replay;
* `check_learned_restart(family, cache, tokenizer, tmp_path)`: with --learn-conversations a state written at SIGTERM
  is read by a new server process, whose next turn's token ids equal a fresh server's and resume at the first
  turn's history end.

Only tests import this module: it needs pytest, httpx and openai, which `pip install 'tensorfold[testing]'` brings.
The reuse gate is a script of a tensorfold checkout, not of the installed package: outside this repository pass
`ServedFamily(gate=...)` its path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from tensorfold.embedded import embedded_checkpoint
from tensorfold.plugins import load_families
from tensorfold.testing.extras import need
from tensorfold.testing.process import serving, tail
from tensorfold.testing.served import ask, openai_client, turns
from tensorfold.tokenizer import ChatTokenizer

httpx = need("httpx", __name__)
pytest = need("pytest", __name__)

REUSE_GATE = Path(__file__).resolve().parents[3] / "tools" / "reuse_gate.py"  # this checkout's
BASE = ("--context", "512", "--parallel", "4")  # the `base` fixture's server, less --family
GATE_GRID = ("--prefill-chunk", "512", "--min-chunk", "32")
LEARN_GRID = ("--context", "1024", "--page-rows", "16", "--prefill-chunk", "128", "--min-chunk", "16",
              "--parallel", "2")  # the --learn-conversations servers and their fresh reference, less --family
NO_TIERS = ("--prompt-cache-gib", "0", "--host-cache-gib", "0")
SCENARIOS = ["nine-turns", "alternating", "edited-first", "regenerate", "two-at-once", "eviction"]


@attrs.frozen
class ServedFamily:
    """What a family's served gates differ in: its name; the reuse gate's cache-on tier flags (`--prompt-cache-gib
    G --host-cache-gib H`, small enough that the eviction scenario pushes states device -> host -> out with a few
    fillers: they depend on how large the family's states are), prefill grid, message scale and context; the
    --learn-conversations servers' flags; and where the gate's script is."""

    name: str
    cached: tuple[str, ...] = attrs.field(converter=tuple)
    grid: tuple[str, ...] = attrs.field(default=GATE_GRID, converter=tuple)
    scale: str = "0.5"  # messages at half length: histories still cross a 512-row grid, in half the time
    context: int = 4096
    learn: tuple[str, ...] = attrs.field(default=LEARN_GRID, converter=tuple)
    gate: Path = REUSE_GATE

    def gate_serve(self) -> list[str]:
        """The serve flags of both of the gate's servers (the cache-on one adds `cached` and `grid`)."""
        return ["--family", self.name, "--context", str(self.context)]

    def learn_grid(self) -> list[str]:
        return ["--family", self.name, *self.learn]


def server_env(cache: Path, **more: str) -> dict[str, str]:
    """A family server's environment: the embedded default under `cache`, NaN-poisoned pages, unbuffered logs."""
    return {"XDG_CACHE_HOME": str(cache), "TF_KV_POISON": "1", "PYTHONUNBUFFERED": "1", **more}


def fixtures(family: ServedFamily) -> tuple[Callable[..., Any], ...]:
    """Module-scoped pytest fixtures `cache`, `base` and `tokenizer` for `family`; a test module turns them on by
    binding them: `cache, base, tokenizer = family_served.fixtures(FAMILY)`."""

    @pytest.fixture(scope="module", name="cache")
    def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
        """XDG_CACHE_HOME of every server here: the first one writes the embedded default, the others read it."""
        return tmp_path_factory.mktemp(f"{family.name}-cache")

    @pytest.fixture(scope="module", name="base")
    def base(cache: Path):
        """A server on the embedded default: its base URL; afterwards its log must say it wrote that default."""
        log = cache / "server.log"
        with serving(["--family", family.name, *BASE], log, env=server_env(cache)) as url:
            yield url
        assert f"wrote the embedded default of family {family.name}" in tail(log)

    @pytest.fixture(scope="module", name="tokenizer")
    def tokenizer(base: str, cache: Path) -> ChatTokenizer:
        """The embedded checkpoint's tokenizer (the directory the first server wrote, found as serve finds it)."""
        return ChatTokenizer(embedded_checkpoint(load_families([family.name])[family.name], cache / "tensorfold"))

    return cache, base, tokenizer


def check_image_refused(url: str) -> None:
    """An image part is refused by name: a 400 naming `messages[0].content[1]`, and openai's BadRequestError."""
    openai = need("openai", __name__)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "image" in error["message"] and error["param"] == "messages[0].content[1]"
    client = openai_client(url)
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])


# -- the reuse gate ---------------------------------------------------------------------------------------------


def run_gate(gate: Path, cache: Path, *args: str | Path) -> subprocess.CompletedProcess:
    """Run the gate's command line (a server it starts finds the embedded default in `cache`)."""
    if not gate.is_file():
        raise FileNotFoundError(f"no reuse gate at {gate}: pass ServedFamily(gate=) tools/reuse_gate.py of a "
                                "tensorfold checkout")
    return subprocess.run([sys.executable, str(gate), *map(str, args)], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "XDG_CACHE_HOME": str(cache)})


def check_reuse_gate(family: ServedFamily, cache: Path, tmp_path: Path) -> dict[str, Any]:
    """Record every scenario against a cache-on server (the family's small device and host tiers), replay them to
    a cache-off server the gate starts, and compare: the gate passes, every scenario resumes (nine-turns 8 times,
    alternating 5), both runs are poisoned and intact, and eviction reaches the host tier and beyond, with the one
    turn resumed from the host at its predicted row. Returns the verdict."""
    gate = family.gate
    with serving([*family.gate_serve(), *family.cached, *family.grid], tmp_path / "cached.log",
                 env=server_env(cache)) as url:
        recorded = run_gate(gate, cache, "record", "--url", url, "--out", tmp_path / "recorded.json",
                            "--scale", family.scale, *family.grid)
        assert recorded.returncode == 0, recorded.stderr + tail(tmp_path / "cached.log")
    replayed = run_gate(gate, cache, "replay", tmp_path / "recorded.json", "--serve", " ".join(family.gate_serve()),
                        "--out", tmp_path / "replay.json", "--log", tmp_path / "fresh.log")
    assert replayed.returncode == 0, replayed.stderr + tail(tmp_path / "fresh.log")
    compared = run_gate(gate, cache, "compare", tmp_path / "recorded.json", tmp_path / "replay.json",
                        "--json", tmp_path / "verdict.json")
    print("\n" + compared.stdout)
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert compared.returncode == 0 and verdict["passed"], compared.stdout
    scenarios = verdict["scenarios"]
    assert list(scenarios) == SCENARIOS
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
    return verdict


# -- the disk tier: a state written at SIGTERM, read by a new server process ------------------------------------


def learn_args(family: ServedFamily, root: Path) -> list[str]:
    """A --learn-conversations server's flags, its disk tier under `root`."""
    return [*family.learn_grid(), "--learn-conversations", "--learn-dir", str(root), "--learn-min-free-gib", "0"]


def check_learned_restart(family: ServedFamily, cache: Path, tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    """A fresh server (no tiers) answers two turns of one conversation; a --learn-conversations server answers the
    first alike and keeps it in RAM, writes it to disk at SIGTERM at the first turn's history end; a new server
    process on the same directory answers the second turn alike, resumed from disk at that row, verified, with no
    failed read."""
    one, _ = turns(None)
    with serving([*family.learn_grid(), *NO_TIERS], tmp_path / "fresh.log", env=server_env(cache)) as url:
        fresh_first = ask(url, one)
        two = turns(fresh_first)[1]
        fresh_second = ask(url, two)
    assert fresh_second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    history = len(tokenizer.encode(tokenizer.render(one, False)))
    root, log = tmp_path / "learned", tmp_path / "server.log"
    learning = server_env(cache, TF_IMPRINT_VERIFY="1")
    with serving(learn_args(family, root), log, env=learning) as url:
        first = ask(url, one)
        assert first["choices"][0]["token_ids"] == fresh_first["choices"][0]["token_ids"]
        assert httpx.get(f"{url}/memory", timeout=10).json()["now"]["disk_states"] == 0  # RAM keeps it so far
    text = log.read_text()  # the server got SIGTERM: what RAM kept is on disk
    assert f"kept at {history} (history end) on disk" in text, tail(log)
    assert "disk tier closed: 2 states written at shutdown" in text and ", 0 dropped" in text, tail(log)
    with serving(learn_args(family, root), log, env=learning) as url:
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
