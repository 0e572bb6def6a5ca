"""`tensorfold serve --tp N` as real processes: the server (rank 0) starts its followers itself, answers the openai
client with the greedy tokens of a `--tp 1` server, concurrent == solo; a follower killed makes the server exit
with status 3 and the lost rank's line, the other followers with it; SIGTERM, or Ctrl-C to the whole process
group, stops every rank cleanly (each follower exits 0 after Stop); a server killed outright takes its followers
with it; a follower that cannot start ends `serve` with its reason (exit 2). Followers are found through /memory's
plan (`ranks`: every rank's pid) or the startup log (`rank K of N follows: pid P on D`); a process still there is
one /proc lists as anything but a zombie. The tests that start a server of their own are marked slow (several
seconds each: every rank imports torch).

Tolerance: TP=2 against TP=1 is compared as greedy token ids, exactly (the logits rows agree within 1e-4 in
float32: tests/core/follow/test_follow_example.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tensorfold.launch import ENGINE_DEAD_STATUS
from tensorfold.ports import free_port
from tensorfold.testing.process import healthy, tail
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights
from tensorfold_example import load as loader
from tensorfold_example.model import ExampleConfig
from tensorfold_example.plugin import TINY_CONFIG, draw

START_TIMEOUT_S = 120.0   # guards against a hang, not measurements
EXIT_TIMEOUT_S = 30.0
TP_FLAGS = ("--prompt-cache-gib", "0", "--host-cache-gib", "0", "--context", "256", "--parallel", "4")
CHATS = ("Hello there", "Name three rivers of France.", "Count: one, two, three,", "Why is the sky blue?")
FOLLOWS = re.compile(r"rank (\d+) of (\d+) follows: pid (\d+) on (\S+)")

FAULTY_MODULE = '''
"""The example family, except that rank 1's family_load raises: a follower that cannot start."""
from tensorfold.hookspecs import hookimpl
from tensorfold_example import load as loader
from tensorfold_example.plugin import (family_chat_format, family_identity, family_kv_layout, family_make_tiny,
                                       family_model_types, family_refusals, family_request_starts_switch,
                                       family_state_image, family_tensor_parallel)


@hookimpl
def family_load(checkpoint, dtype, device, shard):
    if shard.rank == 1:
        raise RuntimeError("rank 1 cannot load its part")
    return loader.load(checkpoint, dtype, device, shard=shard)
'''


def still_there(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> list[int]:
    """The processes (not zombies) whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def start(model: Path, log: Path, *flags: str, family: str = "example", env: dict[str, str] | None = None,
          session: bool = False) -> tuple[subprocess.Popen, str]:
    """`tensorfold serve MODEL --family F FLAGS` on a free port, output to `log`; not waited for."""
    port = free_port()
    with log.open("a") as out:
        process = subprocess.Popen([sys.executable, "-m", "tensorfold", "serve", str(model), "--family", family,
                                    "--port", str(port), *flags], stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                   start_new_session=session)
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"tensorfold serve did not come up (exit {process.poll()}):\n{tail(log)}")
        time.sleep(0.2)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


@contextlib.contextmanager
def serving(model: Path, log: Path, *flags: str, session: bool = False) -> Iterator[tuple[subprocess.Popen, str]]:
    process, url = start(model, log, *flags, session=session)
    try:
        wait_healthy(process, url, log)
        yield process, url
    finally:
        stop(process)


def ranks(url: str) -> list[dict]:
    """Every rank's pid and device, from /memory's plan."""
    return httpx.get(f"{url}/memory", timeout=10).json()["plan"]["ranks"]


def greedy(client: openai.OpenAI, text: str) -> list[int]:
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                           max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    return reply.choices[0].model_extra["token_ids"]


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@contextlib.contextmanager
def servers_of(model: Path, root: Path, flags: dict, family: str = "example") -> Iterator[dict]:
    """Servers of one checkpoint started together, one per entry of `flags` ({name: serve flags}), each healthy
    before the block runs: {name: (process, url, log)}; every one stopped after it."""
    started = {name: (*start(model, root / f"{name}.log", *more, family=family), root / f"{name}.log")
               for name, more in flags.items()}
    try:
        for process, url, log in started.values():
            wait_healthy(process, url, log)
        yield started
    finally:
        for process, _, _ in started.values():
            stop(process)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, tuple]]:
    """A `--tp 1` and a `--tp 2` server with the same flags, started together: {tp: (process, url, log)}."""
    with servers_of(tiny_checkpoint, tmp_path_factory.mktemp("tp-pair"),
                    {tp: (*TP_FLAGS, "--tp", str(tp)) for tp in (1, 2)}) as started:
        yield started


def test_tp2_chat_replies_equal_tp1(pair):
    one, two = (client_of(pair[tp][1]) for tp in (1, 2))
    solo = [greedy(two, text) for text in CHATS]
    assert all(len(ids) == 12 for ids in solo)
    assert solo == [greedy(one, text) for text in CHATS]


def test_tp2_concurrent_equals_solo(pair):
    two = client_of(pair[2][1])
    solo = [greedy(two, text) for text in CHATS]
    with ThreadPoolExecutor(len(CHATS)) as pool:
        together = list(pool.map(lambda text: greedy(two, text), CHATS))
    assert together == solo


def test_tp2_lists_its_ranks_and_logs_each_follower(pair):
    process, url, log = pair[2]
    found = ranks(url)
    assert [(r["rank"], r["device"]) for r in found] == [(0, "cpu"), (1, "cpu")]
    assert found[0]["pid"] == process.pid
    assert found[1]["pid"] in children(process.pid)
    assert [m.groups() for m in FOLLOWS.finditer(log.read_text())] == [("1", "2", str(found[1]["pid"]), "cpu")]
    plan = httpx.get(f"{url}/memory", timeout=10).json()["plan"]
    assert plan["tensor_parallel"] == 2 and plan["prompt_cache_gib"] == 0 and plan["host_cache_bytes"] == 0
    assert httpx.get(f"{pair[1][1]}/memory", timeout=10).json()["plan"]["tensor_parallel"] == 1


@pytest.fixture(scope="module")
def tiny_tp3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example family's tiny checkpoint with 6 heads, 3 KV heads and 96 MLP columns: it splits in 3."""
    directory = tmp_path_factory.mktemp("tp3") / "tiny"
    directory.mkdir()
    config = write_tiny_config(directory, {**TINY_CONFIG, "num_attention_heads": 6, "num_key_value_heads": 3,
                                           "intermediate_size": 96})
    write_tiny_weights(directory, loader.expected_shapes(ExampleConfig.from_dict(config)), draw, 0)
    return directory


@pytest.mark.slow
def test_a_killed_follower_stops_the_server_and_every_other_rank(tiny_tp3, tmp_path):
    log = tmp_path / "server.log"
    with serving(tiny_tp3, log, *TP_FLAGS, "--tp", "3") as (process, url):
        assert greedy(client_of(url), CHATS[0])
        found = ranks(url)
        assert [r["rank"] for r in found] == [0, 1, 2]
        victim, other = found[1]["pid"], found[2]["pid"]
        os.kill(victim, signal.SIGKILL)
        try:
            status = process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit after its follower died:\n{tail(log)}")
    assert status == ENGINE_DEAD_STATUS, tail(log)
    assert not still_there(victim) and not still_there(other)
    reason = f"a tensor-parallel rank is lost: rank 1 of 3 (pid {victim}) exited: killed by SIGKILL"
    exits = [line for line in log.read_text().splitlines() if "exiting with status" in line]
    assert len(exits) == 1 and exits[0].endswith(f"exiting with status {ENGINE_DEAD_STATUS} for a supervisor to "
                                                 f"restart the server: the engine stopped: {reason}"), tail(log)
    assert re.search(rf"rank 2 \(pid {other}\) ended: (killed by SIGKILL|exit status 1)\n", log.read_text()), tail(log)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the server", "Ctrl-C to its process group"])
def test_a_stop_ends_every_rank_cleanly(tiny_checkpoint, tmp_path, how):
    log = tmp_path / "server.log"
    with serving(tiny_checkpoint, log, *TP_FLAGS, "--tp", "2", session=True) as (process, url):
        assert greedy(client_of(url), CHATS[1])
        follower = ranks(url)[1]["pid"]
        helpers = children(process.pid)
        if how.startswith("SIGTERM"):
            process.send_signal(signal.SIGTERM)
        else:
            os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, tail(log)
    assert not still_there(follower)
    deadline = time.monotonic() + EXIT_TIMEOUT_S   # multiprocessing's resource tracker ends once its pipe closes
    while any(still_there(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in helpers if still_there(pid)] == []
    text = log.read_text()
    assert "rank 1: rank 0 stopped after" in text and f"rank 1 (pid {follower}) ended: exit status 0" in text
    assert "Traceback" not in text and text.rstrip().endswith("tensorfold.launch: stopped"), tail(log)


@pytest.mark.slow
def test_a_killed_server_takes_its_followers_with_it(tiny_checkpoint, tmp_path):
    log = tmp_path / "server.log"
    with serving(tiny_checkpoint, log, *TP_FLAGS, "--tp", "2") as (process, url):
        follower = ranks(url)[1]["pid"]
        process.kill()
        process.wait()
        deadline = time.monotonic() + EXIT_TIMEOUT_S   # the follower sees rank 0's pipe or socket close
        while still_there(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not still_there(follower), tail(log)
    text = log.read_text()   # whichever the follower saw first: its pipe from rank 0, or its wait for a step
    assert "rank 1: rank 0 (the server) is gone; exiting" in text or \
        "rank 1 of 2 stops: rank 1 of 2: waiting for a step failed, a rank is gone" in text, tail(log)


def install_faulty_family(root: Path) -> Path:
    """A family `faulty` on PYTHONPATH at `root` whose rank 1 cannot load."""
    root.mkdir()
    (root / "tensorfold_faulty_tp_test.py").write_text(textwrap.dedent(FAULTY_MODULE))
    info = root / "tensorfold_faulty_tp_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorfold-faulty-tp-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tensorfold]\nfaulty = tensorfold_faulty_tp_test\n")
    return root


@pytest.mark.slow
def test_a_follower_that_cannot_start_ends_serve_with_its_reason(tiny_checkpoint, tmp_path):
    path = install_faulty_family(tmp_path / "plugin")
    log = tmp_path / "server.log"
    process, _ = start(tiny_checkpoint, log, *TP_FLAGS, "--tp", "2", family="faulty",
                       env={"PYTHONPATH": os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH")) if p)})
    try:
        status = process.wait(timeout=START_TIMEOUT_S)
    finally:
        stop(process)
    text = log.read_text()
    [(rank, world, pid, _)] = [m.groups() for m in FOLLOWS.finditer(text)]
    assert status == 2 and (rank, world) == ("1", "2"), tail(log)
    assert text.rstrip().endswith(f"rank 1 of 2 (pid {pid}) failed to start: PluginError: family 'faulty' (plugin "
                                  "tensorfold_faulty_tp_test): family_load raised RuntimeError: rank 1 cannot load "
                                  "its part"), tail(log)
    assert not still_there(int(pid))
