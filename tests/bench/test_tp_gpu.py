"""bench/tp_gpu.py's CPU smoke: the tiny dense Qwen shape at TP=1 then TP=2 over gloo, in the script's own spawned
ranks. TP=2's greedy tokens equal TP=1's and every record the device run reads is there (no timing is checked).
float32, so the comparison does not hang on bf16 near-ties of HF's flat random logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tp_gpu import compare, scaling  # bench/ is on sys.path (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
STREAMS, PROMPTS, TOKENS = (1, 2), 3, 6


@pytest.mark.slow                      # two worlds of spawned ranks, each building HF's model
def test_tp2_greedy_tokens_equal_tp1_on_the_cpu(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "tp_gpu.py"), "--device", "cpu", "--shape", "qwen3_5-tiny",
               "--world", "1", "2", "--streams", *map(str, STREAMS), "--prefill", "64", "--prompts", str(PROMPTS),
               "--prompt-rows", "80", "--tokens", str(TOKENS), "--decode-prompt", "8", "--steps", "2",
               "--dtype", "float32", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by = {}
    for record in records:
        by.setdefault(record["bench"], []).append(record)
    assert [r["exit_codes"] for r in by["tp_run"]] == [[0], [0, 0]]
    assert [(r["world"], r["same_weights_on_ranks"], r["nccl_nvls_enable"]) for r in by["tp_world"]] == \
        [(1, True, "0"), (2, True, "0")]
    assert by["tp_greedy"] == [{"bench": "tp_greedy", "shape": "qwen3_5-tiny", "world": 2, "ranks_agree": True}]
    assert sorted((r["world"], r["streams"]) for r in by["tp_decode"]) == [(w, s) for w in (1, 2) for s in STREAMS]
    # 4 layers, a mixer and an MLP each; at one rank the mixer's output projection is fused with the norm (no reduce)
    assert all(r["reductions"] == (8 if r["world"] == 2 else 4) for r in by["tp_decode"])
    assert all("reduce_eager_ms" in r for r in by["tp_decode"] if r["world"] == 2)
    assert sorted(r["world"] for r in by["tp_prefill"]) == [1, 2]
    tokens = by["tp_tokens"]
    assert [r["prompt"] for r in tokens] == list(range(PROMPTS))
    assert all(r["equal"] and r["first_divergence"] is None and r["tokens"] == TOKENS for r in tokens), tokens
    assert by["tp_tokens_all"][0]["equal"] and by["tp_tokens_all"][0]["same_weights"]
    assert sorted((r["what"], r.get("streams", r.get("rows"))) for r in by["tp_scaling"]) == \
        [("decode", 1), ("decode", 2), ("prefill", 64)]
    assert (tmp_path / "tp.jsonl").read_text().count("\n") == len(records)


def test_compare_names_the_first_divergence_and_its_margins():
    one = {"greedy": {"ids": [[5, 6, 7]], "prompt_rows": [4], "top": [[[2.0, 1.0], [3.0, 2.5], [1.0, 0.0]]],
                      "top_ids": [[[5, 1], [6, 9], [7, 0]]]}}
    two = {"greedy": {"ids": [[5, 9, 7]], "prompt_rows": [4], "top": [[[2.25, 1.0], [3.0, 2.875], [1.0, 0.0]]],
                      "top_ids": [[[5, 1], [9, 6], [7, 0]]]}}
    (found,) = compare(one, two)
    assert found == {"prompt": 0, "prompt_rows": 4, "tokens": 3, "equal": False, "first_divergence": 1,
                     "top_logit_max_diff": 0.25, "tp1_margin": 0.5, "tp2_margin": 0.125, "tp1_top2_ids": [6, 9],
                     "tp2_top2_ids": [9, 6]}


def test_scaling_is_tp2_over_twice_tp1():
    one = {"graphs": True, "decode": {"1": 100.0, "8": 400.0}, "prefill": {"8192": 1000.0}}
    two = {"graphs": False, "decode": {"1": 150.0}, "prefill": {"8192": 2000.0}}
    assert scaling(one, two) == [
        {"what": "decode", "streams": 1, "graphs": [True, False], "tp1_tok_s": 100.0, "tp2_tok_s": 150.0,
         "efficiency": 0.75},
        {"what": "prefill", "rows": 8192, "tp1_tok_s": 1000.0, "tp2_tok_s": 2000.0, "efficiency": 1.0}]
