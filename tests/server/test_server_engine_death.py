"""No request stops the server, and an engine that cannot go on stops the process: the top_p reproducer against a
real `tensorfold serve` is an ordinary completion; a family whose device is lost (a test plugin found through its
entry point) makes /health 503 with the reason, later requests 503, and the process exit with status 3."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import pytest
from starlette.testclient import TestClient

from tensorfold.boot import Loaded, build_memory, memory_plan
from tensorfold.engine.api import DeviceLost
from tensorfold.engine.runner import Engine
from tensorfold.launch import ENGINE_DEAD_STATUS
from tensorfold.ports import free_port
from tensorfold.server import build_app
from tensorfold.testing.process import tail

TRIGGER = 499  # a step that feeds this token id loses the device
LOST = "the device is lost: DeviceLost: the test device is gone"
TOP_P_REPRODUCER = {"prompt": "hi", "max_tokens": 4, "temperature": 1, "top_p": 1e-46}
START_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 30.0

FAMILY_MODULE = f'''
"""The example family, except that its forward raises DeviceLost on a step that feeds token {TRIGGER}."""
from tensorfold.engine.api import DeviceLost
from tensorfold.hookspecs import hookimpl
from tensorfold_example import load as loader
from tensorfold_example.plugin import (family_identity, family_kv_layout, family_make_tiny, family_model_types,
                                       family_refusals, family_request_starts_switch, family_state_image)


class LosesDevice:
    def __init__(self, model):
        self.model = model
        self.vocab_size = model.vocab_size

    def forward(self, plan, kv):
        if any({TRIGGER} in share.tokens for share in plan.streams):
            raise DeviceLost("the test device is gone")
        return self.model.forward(plan, kv)


@hookimpl
def family_load(checkpoint, dtype, device):
    return LosesDevice(loader.load(checkpoint, dtype, device))
'''


class LosesDevice:
    """The real model, except that a step feeding TRIGGER raises DeviceLost."""

    def __init__(self, model) -> None:
        self.model = model
        self.vocab_size = model.vocab_size

    def forward(self, plan, kv):
        if any(TRIGGER in share.tokens for share in plan.streams):
            raise DeviceLost("the test device is gone")
        return self.model.forward(plan, kv)


def engine_over(loaded: Loaded, model) -> Engine:
    """Another real engine over `model`, on stream memory of its own that boot's plan sizes; not started."""
    settings, layout = loaded.settings, loaded.declarations.layout
    plan, refusals = memory_plan(settings, layout, loaded.checkpoint, loaded.device, loaded.dtype)
    assert plan is not None, refusals
    memory = build_memory(plan, layout, settings, loaded.device)
    return Engine(model, memory, settings.prefill_chunk, settings.context, settings.max_waiting)


def envelope(message: str, type: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def assert_dead(http: httpx.Client | TestClient) -> None:
    """/health, a new request and /memory of a server whose engine lost its device."""
    health = http.get("/health")
    assert (health.status_code, health.json()) == (503, {"status": "dead", "reason": LOST})
    refused = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert refused.status_code == 503
    assert refused.json() == envelope(f"the engine has stopped: {LOST}", "service_unavailable_error", "engine_dead")
    now = http.get("/memory").json()["now"]
    assert (now["failure"], now["running"], now["waiting"]) == (LOST, 0, 0)


def test_a_lost_device_turns_the_app_dead(loaded):
    engine = engine_over(loaded, LosesDevice(loaded.engine.model))
    engine.start()
    try:
        with TestClient(build_app(attrs.evolve(loaded.service, engine=engine))) as http:
            assert http.get("/health").json() == {"status": "ok"}
            lost = http.post("/v1/completions", json={"prompt": [TRIGGER, 42], "max_tokens": 2})
            assert (lost.status_code, lost.json()) == (500, envelope(f"the engine stopped: {LOST}", "server_error"))
            assert_dead(http)
    finally:
        engine.close()


def test_the_top_p_reproducer_is_an_ordinary_completion(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        got = http.post("/v1/completions", json={**TOP_P_REPRODUCER, "return_token_ids": True})
        assert got.status_code == 200, got.text
        greedy = http.post("/v1/completions", json={**TOP_P_REPRODUCER, "temperature": 0, "return_token_ids": True})
        assert got.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
        assert got.json()["choices"][0]["finish_reason"] == greedy.json()["choices"][0]["finish_reason"]
        assert http.get("/health").json() == {"status": "ok"}
        after = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3


def install_losing_family(root: Path) -> Path:
    """A family `faulty` on PYTHONPATH at `root`: its module and the dist-info that names it in group tensorfold."""
    root.mkdir()
    (root / "tensorfold_faulty_test.py").write_text(textwrap.dedent(FAMILY_MODULE))
    info = root / "tensorfold_faulty_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorfold-faulty-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tensorfold]\nfaulty = tensorfold_faulty_test\n")
    return root


def wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    """Poll /health until 200; fail with the server's log if it exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"tensorfold serve exited with {process.returncode}:\n{tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"tensorfold serve was not healthy within {START_TIMEOUT_S:.0f} s:\n{tail(log)}")


@contextlib.contextmanager
def serving_faulty(tmp_path: Path, model_dir: Path) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """`tensorfold serve --family faulty` on the tiny checkpoint; the process, its URL and its log."""
    path = install_losing_family(tmp_path / "plugin")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH")) if p)}
    port, log = free_port(), tmp_path / "server.log"
    with log.open("a") as out:
        process = subprocess.Popen([sys.executable, "-m", "tensorfold", "serve", "--family", "faulty", "--model",
                                    str(model_dir), "--context", "256", "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log)
        yield process, url, log
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_a_lost_device_makes_health_503_and_the_process_exit(tmp_path, tiny_checkpoint):
    with serving_faulty(tmp_path, tiny_checkpoint) as (process, url, log):
        with httpx.Client(base_url=url, timeout=30) as http:
            ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
            lost = http.post("/v1/completions", json={"prompt": [42, TRIGGER], "max_tokens": 2})
            assert (lost.status_code, lost.json()) == (500, envelope(f"the engine stopped: {LOST}", "server_error"))
            assert_dead(http)
        try:
            status = process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {EXIT_TIMEOUT_S:.0f} s of its engine's death:\n{tail(log)}")
    assert status == ENGINE_DEAD_STATUS, tail(log)
    exits = [line for line in log.read_text().splitlines() if "exiting with status" in line]
    assert len(exits) == 1 and exits[0].endswith(
        f"exiting with status {ENGINE_DEAD_STATUS} for a supervisor to restart the server: the engine stopped: {LOST}")
