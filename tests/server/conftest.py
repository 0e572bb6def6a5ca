"""Fixtures: a tiny `example` checkpoint served in-process by the real engine, and one real `tensorfold serve`
process (with an openai client on it) for the e2e tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import openai
import pytest

from tensorfold.boot import Loaded, boot
from tensorfold.family import Family
from tensorfold.plugins import load_families
from tensorfold.ports import free_port
from tensorfold.settings import read_settings
from tensorfold.tokenizer import ChatTokenizer

START_TIMEOUT_S = 120.0
LOG_TAIL = 8000
IN_PROCESS_CONTEXT = 64
_logs: list[Path] = []


@pytest.fixture(scope="session")
def example_family() -> Family:
    """The template family, as the plugin loader finds it."""
    return load_families(["example"])["example"]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, example_family: Family) -> Path:
    """A tiny `example` checkpoint (random weights, seed 0; the tiny tokenizer), served under the name `tiny`."""
    directory = tmp_path_factory.mktemp("checkpoint") / "tiny"
    directory.mkdir()
    example_family.make_tiny(directory, seed=0)
    return directory


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint: Path) -> ChatTokenizer:
    """The tiny checkpoint's tokenizer (512 ids, ChatML template, <|im_end|> as the end token)."""
    return ChatTokenizer(tiny_checkpoint)


@pytest.fixture(scope="session")
def loaded(example_family: Family, tiny_checkpoint: Path) -> Iterator[Loaded]:
    """The tiny checkpoint booted as `serve` boots it (real model, stream memory, engine, service), engine running."""
    settings = read_settings({}, [("TF_EXAMPLE_REQUEST_STARTS", True)], family="example",
                             model=tiny_checkpoint, context=IN_PROCESS_CONTEXT)
    booted = boot(settings, example_family)
    booted.engine.start()
    yield booted
    booted.engine.close()


@attrs.frozen
class Server:
    """A running `tensorfold serve`: where to reach it and where it logs."""

    base_url: str
    model_dir: Path
    log: Path
    process: subprocess.Popen

    @property
    def api(self) -> str:
        """The OpenAI base URL."""
        return self.base_url + "/v1"


def tensorfold(*args: str, log: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run the CLI to completion, output appended to `log`."""
    with log.open("a") as out:
        return subprocess.run([sys.executable, "-m", "tensorfold", *args], stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False)


def wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    """Poll /health until 200; fail with the server's log if it exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"tensorfold serve exited with {process.returncode}:\n{tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"tensorfold serve was not healthy within {START_TIMEOUT_S:.0f} s:\n{tail(log)}")


def tail(log: Path) -> str:
    """The end of a log file."""
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    return text[-LOG_TAIL:]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real server on a tiny `example` checkpoint, shared by every e2e test."""
    root = tmp_path_factory.mktemp("e2e")
    model_dir, log = root / "tiny-example", root / "server.log"
    _logs.append(log)
    made = tensorfold("make-tiny", "--family", "example", str(model_dir), log=log, timeout=120)
    if made.returncode != 0:
        pytest.fail(f"tensorfold make-tiny failed with {made.returncode}:\n{tail(log)}")
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("a") as out:
        process = subprocess.Popen([sys.executable, "-m", "tensorfold", "serve", "--family", "example",
                                    "--model", str(model_dir), "--port", str(port), "--parallel", "8"],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, log)
        yield Server(base_url, model_dir, log, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    """The real openai client on the e2e server."""
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="session")
def model(client: openai.OpenAI) -> str:
    """The name the e2e server serves its model under."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def context(client: openai.OpenAI) -> int:
    """The e2e server's context window, as /v1/models reports it."""
    return client.models.list().data[0].model_extra["max_model_len"]


def pytest_terminal_summary(terminalreporter, exitstatus: int) -> None:
    """When something failed, show the end of the server's log."""
    if exitstatus != 0:
        for log in _logs:
            terminalreporter.write_sep("-", f"tensorfold serve log ({log})")
            terminalreporter.write_line(tail(log))
