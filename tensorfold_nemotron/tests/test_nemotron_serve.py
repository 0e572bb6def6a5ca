"""Nemotron-H through real `tensorfold serve --family nemotron` processes on the embedded tiny checkpoint (no
--model; NaN-poisoned pages): chat and completions answer the real openai client; an image part is refused by name
with a 400; the reuse gate (tools/reuse_gate.py, every scenario) passes against a cache-on server with small device
and host tiers and a cache-off replay; with --learn-conversations a state written at SIGTERM is read by a new server
process, whose next turn's token ids equal a fresh server's and resume at the first turn's history end
(tensorfold.testing.family_served runs each); and `tensorfold explain` prices Nemotron-3-Nano-30B-A3B from its
config.json alone."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tensorfold.cli import app
from tensorfold.testing import family_served
from tensorfold.testing.family_served import ServedFamily
from tensorfold.testing.served import check_chat_and_completions
from tensorfold_nemotron.shapes import NANO_30B_A3B

pytest.importorskip("openai")
pytestmark = pytest.mark.slow

# about 0.8 and 1.7 MiB (a float32 stream is 256 B a row and 11 KiB fixed, the nine-turn history near 500 KiB): the
# eviction scenario pushes states device -> host -> out with a few fillers
GATE_CACHED = ["--prompt-cache-gib", "0.0008", "--host-cache-gib", "0.0016"]
NEMOTRON = ServedFamily("nemotron", cached=GATE_CACHED)

cache, base, tokenizer = family_served.fixtures(NEMOTRON)


def test_chat_and_completions_on_the_embedded_nemotron(base):
    assert check_chat_and_completions(base, "Hello, Nemotron").startswith("nemotron-")


def test_an_image_is_refused_by_name(base):
    family_served.check_image_refused(base)


def test_the_reuse_gate_passes(base, cache, tmp_path):
    family_served.check_reuse_gate(NEMOTRON, cache, tmp_path)


def test_a_state_written_at_sigterm_is_read_by_a_new_server_process(base, cache, tokenizer, tmp_path):
    family_served.check_learned_restart(NEMOTRON, cache, tokenizer, tmp_path)


# -- the memory plan --------------------------------------------------------------------------------------------


def test_explain_prices_nemotron_3_nano_from_config_json(tmp_path):
    """6 attention layers · (k, v) · 2 kv heads · 128 · 2 B = 6,144 B per token; 23 Mamba2 layers · (64·64·128 · 4 B
    SSM state + 6144 channels · 3 · 2 B conv tail) = 49,082,368 B ≈ 46.8 MiB per stream (docs/families/nemotron.md)."""
    (tmp_path / "config.json").write_text(json.dumps(NANO_30B_A3B))
    args = ["explain", "--family", "nemotron", "--model", str(tmp_path), "--dtype", "bfloat16", "--device", "cpu",
            "--kv-gib", "64", "--context", "32768"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["bytes_per_token"] == 6144 and plan["fixed_bytes_per_stream"] == 49_082_368
    assert plan["by_kind"]["moe"] == {"layers": 23, "bytes_per_token": 0.0, "fixed_bytes": 0}
    assert plan["weights_bytes"] is None and plan["refusals"] == []
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0 and "per token                6144 B" in text.output, text.output
    assert "fixed per stream        46.81 MiB" in text.output, text.output
