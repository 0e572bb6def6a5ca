"""The `tensorfold` command, run as a real process where it matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
from typer.testing import CliRunner

from tensorfold.cli import app
from tensorfold.testing.process import serving, tail

RUNNER = CliRunner()


def test_make_tiny_then_explain(tmp_path):
    result = RUNNER.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    result = RUNNER.invoke(app, ["explain", "--family", "example", "--model", str(tmp_path / "m"), "--json",
                                 "--context", "1024"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    assert plan["bytes_per_token"] == per_token and plan["fixed_bytes_per_stream"] == 0
    assert plan["stream_bytes_at_context"] == 1024 * per_token and plan["refusals"] == []
    assert plan["weights_bytes"] > 0
    assert plan["memory"]["parallel"] == 256 and plan["memory"]["pages"] == 256 * 4   # auto: what fits, up to 256
    assert plan["memory"]["page_bytes"] == 256 * per_token
    text = RUNNER.invoke(app, ["explain", "--family", "example", "--model", str(tmp_path / "m")]).output
    assert "per token" in text and "attention" in text and "no refusals" in text


def test_explain_shows_the_parallel_refusal_with_numbers(tmp_path):
    RUNNER.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    result = RUNNER.invoke(app, ["explain", "--family", "example", "--model", str(tmp_path / "m"), "--parallel", "4",
                                 "--kv-gib", "0.005", "--context", "4096"])
    assert "refused: [core] --parallel 4 needs 16.0 MiB of KV at --context 4096, the budget is 5.1 MiB: serve " \
           "--parallel 1 or lower --context" in result.output, result.output


def test_explain_shows_refusals(tmp_path):
    RUNNER.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    result = RUNNER.invoke(app, ["explain", "--family", "example", "--model", str(tmp_path / "m"),
                                 "--context", "999999"])
    assert result.exit_code == 0 and "refused: [example] --context 999999" in result.output


def test_families_lists_the_template_family():
    result = RUNNER.invoke(app, ["families"])
    assert result.exit_code == 0 and "example (tensorfold_example.plugin): model types qwen3" in result.output


def test_an_unknown_family_exits_with_a_clear_error():
    result = RUNNER.invoke(app, ["make-tiny", "--family", "nope", "/tmp/x"])
    assert result.exit_code == 2 and "no family named 'nope' is installed" in result.output


def test_serve_refuses_bad_flags_all_at_once(tmp_path):
    RUNNER.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    proc = subprocess.run([sys.executable, "-m", "tensorfold", "serve", "--family", "example", "--model",
                           str(tmp_path / "m"), "--context", "1", "--prefill-chunk", "0", "--device", "cuda:0",
                           "--min-chunk", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr
    for needle in ("--context 1 is too small", "--prefill-chunk 0", "--device cuda:0 asks for CUDA",
                   "--min-chunk 0 must be at least 1"):
        assert needle in proc.stderr


def test_serve_refuses_a_bad_switch_value(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tensorfold", "serve", "--family", "example"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TF_EXAMPLE_REQUEST_STARTS": "maybe", "XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 2 and "TF_EXAMPLE_REQUEST_STARTS='maybe'" in proc.stderr


def test_serve_without_a_model_serves_the_embedded_default(tmp_path):
    log = tmp_path / "log"
    with serving(["--family", "example"], log, env={"XDG_CACHE_HOME": str(tmp_path)}) as url:
        reply = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    text = tail(log)
    assert "wrote the embedded default of family example" in text, text
    assert (tmp_path / "tensorfold" / "embedded").is_dir()


def test_explain_works_from_config_json_alone(tmp_path):
    RUNNER.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    result = RUNNER.invoke(app, ["explain", "--family", "example", "--model", str(tmp_path / "cfg"), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["weights_bytes"] is None and plan["bytes_per_token"] > 0
    text = RUNNER.invoke(app, ["explain", "--family", "example", "--model", str(tmp_path / "cfg")]).output
    assert "no weight files" in text


def test_serve_refuses_a_negative_prompt_cache(tmp_path):
    RUNNER.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    result = RUNNER.invoke(app, ["serve", "--family", "example", "--model", str(tmp_path / "m"),
                                 "--prompt-cache-gib", "-1"])
    assert result.exit_code == 2 and "--prompt-cache-gib -1.0 must be 0 (off) or above" in result.output, result.output
