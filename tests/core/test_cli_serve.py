"""`tensorfold serve` as a user types it, each a real process: MODEL as an argument, the family found from the
checkpoint, vLLM's flag names, mistakes refused in one sentence each (exit 2, no traceback) before the weights load,
a clean exit 0 on SIGTERM and SIGINT, and --seed making unseeded requests repeat."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tensorfold.ports import free_port
from tensorfold.testing.process import serving, tail

pytestmark = pytest.mark.slow


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorfold", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("cli-serve") / "tiny"
    assert run("make-tiny", "--family", "example", str(directory)).returncode == 0
    return directory


def test_every_mistake_seen_before_loading_is_one_sentence_and_exit_2(tmp_path):
    proc = run("serve", "--family", "example", "--model", str(tmp_path / "nowhere"), "--port", "70000",
               "--log-level", "loud")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"--model {tmp_path / 'nowhere'} does not exist",
        "--port 70000 is not a port: give one from 1 to 65535",
        "--log-level 'loud' is not one of debug, info, warning, error, critical"]


def test_a_hub_id_is_told_to_download_first():
    proc = run("serve", "Qwen/Qwen3.5-9B", "--family", "example")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "TensorFold serves local checkpoint directories only" in proc.stderr
    assert "huggingface-cli download Qwen/Qwen3.5-9B --local-dir DIR" in proc.stderr


def test_a_busy_port_is_refused_before_the_weights_load(tiny):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        proc = run("serve", str(tiny), "--family", "example", "--port", str(port))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"port {port} on 127.0.0.1 is in use: stop what listens there or pick another --port"
    assert "loading" not in proc.stdout + proc.stderr


def test_flags_given_twice_or_not_built_are_refused(tiny):
    twice = run("serve", str(tiny), "--model", str(tiny.parent / "other"), "--family", "example")
    assert twice.returncode == 2 and "the model is given twice" in twice.stderr
    tp = run("serve", str(tiny), "--family", "example", "--tp", "3", "--learn-conversations", "--learn-dir",
             str(tiny.parent / "learned"))
    assert tp.returncode == 2 and "keeps no states on disk" not in tp.stderr, tp.stderr    # the disk tier works
    assert "--tensor-parallel-size 3 does not divide the KV heads (num_key_value_heads), 2" in tp.stderr
    assert "--host-cache-gib" not in tp.stderr and "--prompt-cache-gib" not in tp.stderr
    clash = run("serve", str(tiny), "--family", "example", "--max-model-len", "512", "--context", "1024")
    assert clash.returncode == 2 and "--max-model-len 512 and --context 1024 disagree" in clash.stderr
    budget = run("serve", str(tiny), "--family", "example", "--max-num-batched-tokens", "0")
    assert budget.returncode == 2 and "--max-step-rows 0 must be at least 1" in budget.stderr


def test_the_family_is_found_from_the_checkpoints_model_type(tmp_path):
    assert run("make-tiny", "--family", "qwen", str(tmp_path / "q")).returncode == 0
    proc = run("explain", str(tmp_path / "q"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"family": "qwen"' in proc.stdout
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "nobody_serves_this"}')
    odd = run("explain", str(tmp_path / "odd"))
    assert odd.returncode == 2 and "no installed family serves model_type 'nobody_serves_this'" in odd.stderr
    assert "pip install ./tensorfold_qwen" in odd.stderr


def test_vllm_flag_names_set_ours_and_a_positional_model_serves(tiny, tmp_path):
    with serving([str(tiny), "--family", "example", "--max-model-len", "512", "--max-num-seqs", "2"],
                 tmp_path / "log") as url:
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        memory = httpx.get(f"{url}/memory", timeout=30).json()
    assert card["id"] == "tiny" and card["max_model_len"] == 512
    assert memory["now"]["slots"] == 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_is_a_clean_exit_0(tiny, tmp_path, sig):
    port = free_port()
    log = tmp_path / "log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "tensorfold", "serve", str(tiny), "--family", "example",
                                    "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, tail(log)
            time.sleep(0.2)
        process.send_signal(sig)
        assert process.wait(timeout=60) == 0, tail(log)
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in log.read_text() and "stopped" in log.read_text()


def test_seed_repeats_the_draws_of_unseeded_requests(tiny, tmp_path):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
    replies = []
    for run_number in range(2):
        with serving([str(tiny), "--family", "example", "--seed", "7"], tmp_path / f"log{run_number}") as url:
            replies.append([httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                            for _ in range(2)])
    assert replies[0] == replies[1]          # the same server run twice: the same sequence of draws
    assert replies[0][0] != replies[0][1]    # two requests in one run draw different seeds
