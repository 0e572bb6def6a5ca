"""The rows store's fault cases on the nemotron family, with real server processes on the embedded tiny checkpoint:
a server writes a conversation's states at SIGTERM (its system end and its history end), a file is damaged, and a new
server process on the same --learn-dir serves the conversation's next turn. Every time: no crash, token ids equal a
fresh server's, the turn resumes from the shorter undamaged state, and the fault is counted on /memory.

A nemotron state's own part is its fixed states (Mamba2 conv tails and float32 SSM states), which no block shares:
a byte flipped there must fail the state's hash like a byte of its rows.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from tensorfold.rows.files import STATE, read_header
from tensorfold.testing.process import serving, tail
from tensorfold.testing.served import ask, turns

pytestmark = pytest.mark.slow

BLOCK_ROWS = 16
GRID = ["--family", "nemotron", "--context", "1024", "--page-rows", "16", "--prefill-chunk", "128", "--min-chunk",
        "16", "--parallel", "2"]
NO_TIERS = ["--prompt-cache-gib", "0", "--host-cache-gib", "0"]


def env(cache: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(cache), "TF_KV_POISON": "1", "TF_IMPRINT_VERIFY": "1", "PYTHONUNBUFFERED": "1"}


def learning(root: Path) -> list[str]:
    return [*GRID, "--learn-conversations", "--learn-dir", str(root), "--learn-block-rows", str(BLOCK_ROWS),
            "--learn-min-free-gib", "0"]


def kept(root: Path) -> dict[int, Path]:
    """Every state file under the root, by the rows it covers."""
    return {read_header(path, STATE).words["at"]: path for path in root.glob("*/states/*.st")}


def blocks_of(state: Path) -> list[Path]:
    return [state.parent.parent / "blocks" / f"{name}.blk" for name in read_header(state, STATE).words["blocks"]]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nemotron-faults-cache")


@pytest.fixture(scope="module")
def fresh(cache) -> dict:
    """A server that keeps nothing: the conversation's two turns."""
    with serving([*GRID, *NO_TIERS], cache / "fresh.log", env=env(cache)) as url:
        one, _ = turns(None)
        first = ask(url, one)
        two = turns(first)[1]
        second = ask(url, two)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return {"one": one, "first": first, "two": two, "second": second}


@pytest.fixture(scope="module")
def store(cache, fresh) -> Path:
    """A --learn-dir a server wrote at SIGTERM: the first turn's system end and history end."""
    root = cache / "written" / "learned"
    log = cache / "writer.log"
    with serving(learning(root), log, env=env(cache)) as url:
        first = ask(url, fresh["one"])
    assert first["choices"][0]["token_ids"] == fresh["first"]["choices"][0]["token_ids"]
    assert "disk tier closed: 2 states written at shutdown" in log.read_text(), tail(log)
    assert len(kept(root)) == 2
    return root


def second_turn(cache: Path, root: Path, log: Path, fresh: dict) -> tuple[dict, dict]:
    """A new server on `root` answers the second turn: its reply and /memory's numbers after it."""
    with serving(learning(root), log, env=env(cache)) as url:
        second = ask(url, fresh["two"])
        now = httpx.get(f"{url}/memory", timeout=10).json()["now"]
    assert "Traceback" not in log.read_text(errors="replace"), tail(log)
    return second, now


def check_resumed(second: dict, fresh: dict, at: int) -> None:
    assert second["choices"][0]["token_ids"] == fresh["second"]["choices"][0]["token_ids"]
    assert second["usage"]["prompt_tokens"] == fresh["second"]["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == at


def test_a_flipped_byte_in_a_states_ssm_part_fails_its_hash_and_the_turn_falls_back(cache, store, fresh, tmp_path):
    """A byte of the history end's own part (its fixed states, right after the tokens) flipped: the header still
    checks at startup, the read's sha256 does not; the state is forgotten and the turn resumes at the system end."""
    root = Path(shutil.copytree(store, tmp_path / "learned"))
    states = kept(root)
    history, system_end = max(states), min(states)
    path = states[history]
    header = read_header(path, STATE)
    data = bytearray(path.read_bytes())
    head = 12 + int.from_bytes(data[8:12], "little")            # magic, version, words length, words
    own = head + 4 * history                                    # then the tokens as int32, then the own part
    assert header.words["own"] > 0
    data[own + header.words["own"] // 2] ^= 0x40
    path.write_bytes(bytes(data))
    log = tmp_path / "server.log"
    second, now = second_turn(cache, root, log, fresh)
    check_resumed(second, fresh, at=system_end)
    assert now["disk_failed_reads"] == 1 and now["disk_damaged"] == 1 and now["disk_states"] == 1, now
    text = log.read_text()
    assert f"the state at {history} on disk failed its check ({path}: sha256 of the payload differs" in text, tail(log)
    assert f"resumed at {system_end} of {second['usage']['prompt_tokens']} from disk" in text, tail(log)


def test_a_truncated_block_forgets_its_state_at_startup_and_the_turn_resumes_from_the_shorter_one(
        cache, store, fresh, tmp_path):
    root = Path(shutil.copytree(store, tmp_path / "learned"))
    states = kept(root)
    history, system_end = max(states), min(states)
    only_history = [b for b in blocks_of(states[history]) if b not in blocks_of(states[system_end])]
    assert only_history
    os.truncate(only_history[0], only_history[0].stat().st_size - 7)
    second, now = second_turn(cache, root, tmp_path / "server.log", fresh)
    check_resumed(second, fresh, at=system_end)
    assert now["disk_damaged"] == 1 and now["disk_failed_reads"] == 0 and now["tiers"]["disk"]["hits"] == 1, now
