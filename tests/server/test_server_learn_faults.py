"""The rows store's fault and cap gates (issue 7) with real server processes, real files and real signals: a
server writes a conversation's states, the files are damaged (or the disk refuses, fills, or a cap bites), and a
new server process on the same --learn-dir serves the conversation's next turn. Every time: no crash, token ids
equal a fresh server's, cached_tokens is 0 or the row of a shorter undamaged state, and the fault is counted on
/memory (or in the log where it only happens at shutdown) and logged."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from learn_cases import (
    ENV,
    FIRST,
    NO_TIERS,
    SECOND,
    SYSTEM,
    ask,
    check_resumed,
    fresh_server,
    memory,
    sample,
    serve_args,
    settled,
    written,
)
from learn_files import blocks_of, data_bytes, data_files, kept, learned

from tensorfold.ports import free_port
from tensorfold.testing.process import serving, tail

pytestmark = pytest.mark.slow

BLOCK_ROWS = 16          # the conversation's history end (58 rows) spans three blocks and a tail; its system end two
OTHER = ("You are a careful historian who answers in short paragraphs.", "When was the Eiffel Tower built?",
         "Who designed it, and how tall is it?")
GIB = 2**30


def learning(model: Path, root: Path, *extra: str, floor: str = "0") -> list[str]:
    """serve's flags with the disk tier on `root`, blocks of BLOCK_ROWS rows and a free-space floor of `floor` GiB."""
    return serve_args(model, "--learn-conversations", "--learn-dir", str(root), "--learn-block-rows",
                      str(BLOCK_ROWS), "--learn-min-free-gib", floor, *extra)


@pytest.fixture(scope="module")
def fresh(tiny_checkpoint, tokenizer, tmp_path_factory) -> dict[str, dict]:
    """A server that keeps nothing: conversations a and b (unrelated system prompts), their two turns each."""
    a, b = fresh_server(tiny_checkpoint, tmp_path_factory.mktemp("fresh") / "server.log", tokenizer,
                        (SYSTEM, FIRST, SECOND), OTHER)
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def store(tiny_checkpoint, tmp_path_factory, fresh) -> Path:
    """A --learn-dir a server wrote at SIGTERM: conversation a's system end and history end (each test damages a
    copy)."""
    root = tmp_path_factory.mktemp("written") / "learned"
    log = root.parent / "server.log"
    with serving(learning(tiny_checkpoint, root), log, env=ENV) as url:
        first = ask(url, fresh["a"]["one"])
    assert first["choices"][0]["token_ids"] == fresh["a"]["first"]["choices"][0]["token_ids"]
    assert "disk tier closed: 2 states written at shutdown" in log.read_text(), tail(log)
    states = kept(root)
    assert len(states) == 2 and fresh["a"]["history"] in states, states
    return root


@pytest.fixture(autouse=True)
def no_tracebacks(tmp_path):
    """0 crashes: no server log a test leaves holds a traceback (the I/O thread logs one for a write that raised)."""
    yield
    for log in tmp_path.glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), tail(log)


def copy(store: Path, tmp_path: Path) -> Path:
    """A private copy of the written store."""
    return Path(shutil.copytree(store, tmp_path / "learned"))


def shorter(states: dict[int, Path], fresh: dict) -> int:
    """The row of the state below the history end: the system end (33 rows; its blocks are the first two of the
    history end's)."""
    (at,) = set(states) - {fresh["history"]}
    return at


def serve_second_turn(model: Path, root: Path, log: Path, fresh: dict, *extra: str,
                      before: Callable[[str], None] | None = None) -> tuple[dict, dict, set[Path]]:
    """A new server process on `root` answers a conversation's second turn: its reply, /memory's numbers after it,
    and the state and block files then (`before(url)` runs between startup and the request). /metrics's text
    rides along in the numbers as "metrics_text"."""
    with serving(learning(model, root, *extra), log, env=ENV) as url:
        if before is not None:
            before(url)
        second = ask(url, fresh["messages"])
        now = {**memory(url)["now"], "metrics_text": httpx.get(f"{url}/metrics", timeout=10).text}
        files = data_files(root)
    return second, now, files


# -- damaged files ----------------------------------------------------------------------------------------------


def test_a_truncated_block_forgets_its_state_at_startup_and_the_turn_resumes_from_the_shorter_one(
        tiny_checkpoint, tmp_path, store, fresh):
    """The block only the history end lists (rows 32-48), 7 bytes short: startup's size check forgets that state
    (counted in disk_damaged) and removes the block; the system end is whole, so the turn resumes there."""
    a, root, log = fresh["a"], copy(store, tmp_path), tmp_path / "server.log"
    states = kept(root)
    system_end = shorter(states, a)
    only_history = [b for b in blocks_of(states[a["history"]]) if b not in blocks_of(states[system_end])]
    assert len(only_history) == 1
    os.truncate(only_history[0], only_history[0].stat().st_size - 7)
    second, now, files = serve_second_turn(tiny_checkpoint, root, log, a)
    check_resumed(second, a, at=system_end)
    assert now["disk_damaged"] == 1 and now["disk_orphans_removed"] == 1 and now["disk_failed_reads"] == 0, now
    assert now["tiers"]["disk"]["hits"] == 1 and states[a["history"]] not in files and only_history[0] not in files
    text = log.read_text()
    assert f"rows store: forgot {states[a['history']]} at startup: its block 2" in text, tail(log)
    assert f"resumed at {system_end} of {second['usage']['prompt_tokens']} from disk" in text, tail(log)


def test_a_flipped_byte_in_a_state_file_body_fails_its_hash_and_the_turn_falls_back_to_the_shorter_state(
        tiny_checkpoint, tmp_path, store, fresh):
    """A byte of the history end's tail rows flipped: its header still checks at startup, the read's sha256 does
    not; the state is forgotten (disk_failed_reads, disk_damaged, on /memory and /metrics) and the admitted request
    falls back to the next shorter state on disk, the system end (tiers/chain.py), so its reply equals fresh."""
    a, root, log = fresh["a"], copy(store, tmp_path), tmp_path / "server.log"
    states = kept(root)
    system_end = shorter(states, a)
    path = states[a["history"]]
    data = bytearray(path.read_bytes())
    data[len(data) - 40 - 100] ^= 0x40      # 100 bytes before the trailer: inside the body
    path.write_bytes(bytes(data))
    second, now, files = serve_second_turn(tiny_checkpoint, root, log, a)
    check_resumed(second, a, at=system_end)
    assert now["disk_failed_reads"] == 1 and now["disk_damaged"] == 1 and now["disk_states"] == 1, now
    assert now["tiers"]["disk"]["hits"] == 1 and path not in files and states[system_end] in files
    metrics = now["metrics_text"]
    assert "tensorfold_disk_damaged_total 1.0" in metrics and "tensorfold_disk_failed_reads_total 1.0" in metrics
    assert sample(metrics, "tensorfold_disk_read_bytes_total") > 0
    text = log.read_text()
    assert f"the state at {a['history']} on disk failed its check ({path}: sha256 of the payload differs from its " \
           "trailer)" in text, tail(log)
    assert f"falling back to the state at {system_end} on the disk tier" in text, tail(log)
    assert f"resumed at {system_end} of {second['usage']['prompt_tokens']} from disk" in text, tail(log)


def test_a_block_deleted_under_a_running_server_is_a_counted_miss(tiny_checkpoint, tmp_path, store, fresh):
    """Block 0, which both states list, removed after the new server started (startup saw it): the read fails,
    both states are forgotten (disk_damaged 2, disk_failed_reads 1) and the turn prefills from row 0. (A block
    missing at startup is the store tests' case: the states listing it are forgotten before the first request.)"""
    a, root, log = fresh["a"], copy(store, tmp_path), tmp_path / "server.log"
    states = kept(root)
    shared = blocks_of(states[a["history"]])[0]
    assert shared in blocks_of(states[shorter(states, a)])
    second, now, files = serve_second_turn(tiny_checkpoint, root, log, a, before=lambda url: shared.unlink())
    check_resumed(second, a, at=0)
    assert now["disk_failed_reads"] == 1 and now["disk_damaged"] == 2 and now["disk_states"] == 0, now
    assert files == set()
    text = log.read_text()
    assert f"{shared}: cannot be read" in text and "rows store: forgot 2 state(s)" in text, tail(log)


def test_leftover_parts_are_removed_at_startup_and_everything_else_is_served(tiny_checkpoint, tmp_path, store, fresh):
    """A torn state file, a torn block and a torn budget.json, as a crash mid-write leaves them: removed at startup
    (disk_parts_removed), and the turn resumes from the history end on disk."""
    a, root, log = fresh["a"], copy(store, tmp_path), tmp_path / "server.log"
    states = kept(root)
    whole = states[a["history"]].read_bytes()
    parts = [states[a["history"]].parent / f"{'e' * 64}.st.part", blocks_of(states[a["history"]])[0].parent /
             f"{'f' * 64}.blk.part", root / "budget.json.part"]
    for part in parts:
        part.write_bytes(whole[: len(whole) // 2])
    second, now, files = serve_second_turn(tiny_checkpoint, root, log, a)
    check_resumed(second, a)
    assert now["disk_parts_removed"] == 3 and now["disk_damaged"] == 0 and now["tiers"]["disk"]["hits"] == 1, now
    assert not any(part.exists() for part in parts) and not list(root.rglob("*.part")) and len(files) == 5
    assert "rows store: removed 3 leftover .part files at startup" in log.read_text(), tail(log)


# -- a crash mid-write ------------------------------------------------------------------------------------------


def stopped(pid: int) -> bool:
    """Whether every thread of the process is stopped (SIGSTOP has taken effect; a thread gone meanwhile counts)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state not in "tTZX":
            return False
    return True


def stop_mid_write(pid: int, root: Path, blocks: int, seconds: float) -> list[Path]:
    """Freeze the server while a file is half written, once at least `blocks` block files are whole: SIGSTOP the
    moment a `.part` shows, and keep it stopped only if a `.part` is still there once every thread has stopped;
    the `.part` files, or [] (running again) when none was caught within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(root.glob("*/*/*.part")) or len(list(root.glob("*/blocks/*.blk"))) < blocks:
            continue
        os.kill(pid, signal.SIGSTOP)
        while not stopped(pid):
            time.sleep(0.0005)
        caught = list(root.glob("*/*/*.part"))
        if caught:
            return caught
        os.kill(pid, signal.SIGCONT)
    return []


def test_sigkill_mid_write_leaves_nothing_read_as_valid(tiny_checkpoint, tmp_path, fresh):
    """A server with the RAM tiers off writes each keep point at once; long prompts (about 60 blocks each) keep its
    I/O thread writing while we wait for a `.part`, freeze the process there and SIGKILL it. A new server removes
    the torn file and the blocks no state lists (disk_parts_removed, disk_orphans_removed), `tensorfold learned
    verify` passes, and conversation a's next turn resumes from its history end, equal to fresh."""
    a, root, log = fresh["a"], tmp_path / "learned", tmp_path / "server.log"
    with serving(learning(tiny_checkpoint, root, *NO_TIERS), log, env=ENV) as url:
        ask(url, a["one"])
        assert written(url, 2)["disk_written"] == 2
        pid = int((root / "lock").read_text())
        caught: list[Path] = []
        for attempt in range(1, 9):
            talk = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Tell me everything about river number {attempt}. " * 21}]
            asking = threading.Thread(target=_try, args=(url, talk), daemon=True)
            asking.start()
            caught = stop_mid_write(pid, root, len(list(root.glob("*/blocks/*.blk"))) + 3, seconds=3)
            if caught:
                break
            asking.join()
            settled(url)
        assert caught, f"no write caught in {attempt} long prompts:\n{tail(log)}"
        os.kill(pid, signal.SIGKILL)
        asking.join(timeout=10)
    complete = attempt - 1                   # the long states written before the one the kill tore
    assert all(part.exists() for part in caught), caught
    with serving(learning(tiny_checkpoint, root), log, env=ENV) as url:
        now = memory(url)["now"]
        assert not list(root.rglob("*.part")), list(root.rglob("*.part"))
        verified = learned(root, "verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        second = ask(url, a["messages"])
        after = memory(url)["now"]
    check_resumed(second, a)
    assert now["disk_parts_removed"] == len(caught) and now["disk_orphans_removed"] >= 3, now
    assert now["disk_damaged"] == 0, now
    assert now["disk_states"] == 2 + complete, now
    assert after["tiers"]["disk"]["hits"] == 1, after
    assert f"rows store: removed {len(caught)} leftover .part file" in log.read_text(), tail(log)


def _try(url: str, messages: list[dict]) -> None:
    """Ask, and take a connection the server's death cuts as the answer."""
    try:
        ask(url, messages)
    except httpx.HTTPError:
        pass


# -- a directory the server cannot write ------------------------------------------------------------------------


def refusal(model: Path, root: Path, log: Path) -> str:
    """serve's output when it refuses to start on this --learn-dir (it must exit, not serve)."""
    with log.open("a") as out:
        done = subprocess.run([sys.executable, "-m", "tensorfold", "serve", *learning(model, root), "--port",
                               str(free_port())], stdout=out, stderr=subprocess.STDOUT, timeout=60,
                              env={**os.environ, **ENV})
    assert done.returncode == 2, tail(log)
    return log.read_text()


def test_a_learn_dir_that_cannot_be_made_or_opened_is_refused_at_startup_by_name(tiny_checkpoint, tmp_path, store):
    """As root, permission bits stop nothing, so the honest unwritable directories are these: a --learn-dir whose
    parent is a regular file, and a store whose identity's states/ folder is a file; serve refuses both, naming
    the directory and the error, before it serves."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    text = refusal(tiny_checkpoint, blocker / "learned", tmp_path / "made.log")
    assert f"--learn-dir {blocker / 'learned'} cannot be created: Not a directory" in text, text[-2000:]
    root = copy(store, tmp_path)
    (states,) = root.glob("*/states")
    shutil.rmtree(states)
    states.write_text("a file where the states folder was")
    text = refusal(tiny_checkpoint, root, tmp_path / "opened.log")
    assert f"--learn-dir: {root}: the rows store cannot be opened: [Errno 17] File exists: '{states}'" in text, \
        text[-2000:]


def test_writes_the_file_system_refuses_are_counted_and_serving_goes_on(tiny_checkpoint, tmp_path, fresh):
    """The identity's states/ folder replaced by a file under a running server (RAM tiers off, so each keep point
    is written at once): every write fails (disk_write_failed, logged once, the blocks it wrote removed), the
    replies equal fresh, and the next turn, with nothing kept anywhere, prefills."""
    a, root, log = fresh["a"], tmp_path / "learned", tmp_path / "server.log"
    with serving(learning(tiny_checkpoint, root, *NO_TIERS), log, env=ENV) as url:
        states = root / memory(url)["plan"]["learn_identity"] / "states"
        states.rmdir()
        states.write_text("a file where the states folder was")
        first = ask(url, a["one"])
        now = settled(url)
        second = ask(url, a["messages"])
        after = settled(url)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert first["choices"][0]["token_ids"] == a["first"]["choices"][0]["token_ids"]
    check_resumed(second, a, at=0)
    assert now["disk_write_failed"] == 2 and now["disk_states"] == 0 and now["disk_written"] == 0, now
    assert after["disk_write_failed"] >= 3 and after["integrity_when_idle"] == "ok", after
    assert f'tensorfold_tier_refused_total{{tier="disk"}} {float(after["disk_write_failed"])}' in metrics
    assert not list((states.parent / "blocks").iterdir())
    assert log.read_text().count(f"rows store: cannot write to {states.parent}") == 1, tail(log)


def test_a_floor_above_the_free_space_pauses_writes_and_reads_go_on(tiny_checkpoint, tmp_path, store, fresh):
    """--learn-min-free-gib far above the free space: the state on disk is still read (the turn resumes from it),
    every new state is skipped (disk_skipped_floor, logged once), and conversation b, kept nowhere, prefills."""
    a, b, root, log = fresh["a"], fresh["b"], copy(store, tmp_path), tmp_path / "server.log"
    floor = str(shutil.disk_usage(root).free / GIB * 1000)
    with serving(learning(tiny_checkpoint, root, *NO_TIERS, floor=floor), log, env=ENV) as url:
        second = ask(url, a["messages"])
        ask(url, b["one"])
        other = ask(url, b["messages"])
        now = settled(url)
    check_resumed(second, a)
    check_resumed(other, b, at=0)
    assert now["disk_skipped_floor"] >= 3 and now["disk_written"] == 0 and now["disk_states"] == 2, now
    assert now["tiers"]["disk"]["hits"] == 1
    assert log.read_text().count("would leave less than --learn-min-free-gib") == 1, tail(log)


# -- caps -------------------------------------------------------------------------------------------------------


def test_the_cap_keeps_the_conversation_used_last(tiny_checkpoint, tmp_path, store, fresh):
    """--learn-gib between one conversation's bytes and two: a then b are kept on the device and written at
    SIGTERM, b (used last) first; a's states, stamped older, go as soon as they are written. The state and block
    files stay within the cap (the small JSON files and the lock are outside it by design), b's next turn resumes
    from disk and a's prefills, both equal to fresh."""
    a, b, root, log = fresh["a"], fresh["b"], tmp_path / "learned", tmp_path / "server.log"
    gib = f"{data_bytes(store) * 3 // 2 / GIB:.12f}"
    capped, cap = ["--learn-gib", gib], int(float(gib) * GIB)      # the bytes the server makes of the flag
    with serving(learning(tiny_checkpoint, root, *capped), log, env=ENV) as url:
        ask(url, a["one"])
        ask(url, b["one"])
    states = kept(root)
    assert b["history"] in states and a["history"] not in states and len(states) == 2, states
    assert 0 < data_bytes(root) <= cap
    text = log.read_text()
    assert "disk tier closed: 4 states written at shutdown" in text, tail(log)
    assert f"not kept on disk at {a['history']} (history end): --learn-gib evicted it as soon as it was written" \
        in text, tail(log)
    with serving(learning(tiny_checkpoint, root, *capped), log, env=ENV) as url:
        on_a = ask(url, a["messages"])
        on_b = ask(url, b["messages"])
        now = memory(url)["now"]
    check_resumed(on_b, b)
    check_resumed(on_a, a, at=0)
    assert now["tiers"]["disk"]["hits"] == 1 and now["disk_bytes"] <= cap and now["disk_budget"] == cap, now
    assert data_bytes(root) <= cap


def test_a_spent_daily_budget_keeps_states_in_ram_only(tiny_checkpoint, tmp_path, store, fresh):
    """--learn-daily-gib that one conversation spends: with the RAM tiers off a's states are written, b's skipped
    (disk_skipped_daily, logged once with why); a's next turn resumes from disk and b's prefills. A second server
    the same day (RAM tiers on) still has no budget: b's turn resumes from the device, and at shutdown its states
    stay in RAM only, the log says why, and nothing more is written."""
    a, b, root, log = fresh["a"], fresh["b"], tmp_path / "learned", tmp_path / "server.log"
    daily = ["--learn-daily-gib", f"{data_bytes(store) * 3 // 2 / GIB:.12f}"]
    with serving(learning(tiny_checkpoint, root, *NO_TIERS, *daily), log, env=ENV) as url:
        ask(url, a["one"])
        assert written(url, 2)["disk_written"] == 2
        ask(url, b["one"])
        now = settled(url)
        on_a = ask(url, a["messages"])
        on_b = ask(url, b["messages"])
        after = settled(url)
    assert now["disk_skipped_daily"] == 2 and now["disk_states"] == 2, now
    check_resumed(on_a, a)
    check_resumed(on_b, b, at=0)
    assert after["disk_skipped_daily"] >= 3 and after["tiers"]["disk"]["hits"] == 1, after
    said = "is spent for"
    assert log.read_text().count(said) == 1 and "states stay in RAM only until tomorrow" in log.read_text()
    before = {p.name for p in root.rglob("*.st")}
    with serving(learning(tiny_checkpoint, root, *daily), log.with_name("again.log"), env=ENV) as url:
        ask(url, b["one"])
        on_b = ask(url, b["messages"])
        now = memory(url)["now"]
    check_resumed(on_b, b)
    assert now["tiers"]["device"]["hits"] == 1 and now["tiers"]["disk"]["hits"] == 0, now
    again = log.with_name("again.log").read_text()
    assert "disk tier closed: 0 states written at shutdown" in again and said in again, tail(log.with_name("again.log"))
    assert again.count("the day's write budget (--learn-daily-gib) is spent") >= 2
    assert {p.name for p in root.rglob("*.st")} == before


def test_another_identity_never_reads_the_first_ones_states(tiny_checkpoint, tmp_path, store, fresh):
    """Two other identities on a copy of the written store: the checkpoint copied with a config.json key nothing
    reads (the same bits, another config hash; its reply equals fresh) and --dtype bfloat16. Neither reads the
    first server's states (cached_tokens 0, no disk hit), the first's states are left as they were, and
    `tensorfold learned ls` lists all three identities with their facts."""
    a, root = fresh["a"], copy(store, tmp_path)
    (identity,) = (p.parent.name for p in root.glob("*/identity.json"))
    states = set(root.glob(f"{identity}/states/*.st"))
    edited = Path(shutil.copytree(tiny_checkpoint, tmp_path / "edited" / tiny_checkpoint.name))
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "tensorfold_test_note": "changes nothing"}))
    second, now, _ = serve_second_turn(edited, root, tmp_path / "edited.log", a)
    check_resumed(second, a, at=0)
    assert now["disk_states"] == 0 and now["tiers"]["disk"]["hits"] == 0, now
    second, now, _ = serve_second_turn(tiny_checkpoint, root, tmp_path / "bf16.log", a, "--dtype", "bfloat16")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert now["disk_states"] == 0 and now["tiers"]["disk"]["hits"] == 0, now
    assert set(root.glob(f"{identity}/states/*.st")) == states
    listed = json.loads(learned(root, "ls", "--json").stdout)
    assert len(listed) == 3, listed
    assert next(i for i in listed if i["identity"] == identity)["states"] == 2
    assert {i["facts"]["dtype"] for i in listed} == {"float32", "bfloat16"}
    assert len({i["facts"]["checkpoint.config_sha256"] for i in listed}) == 2
