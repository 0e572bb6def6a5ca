"""`tensorfold explain --tp N`: one rank's memory, from the family's per-rank Layout and the rank's slices of the
weights, and TP's refusals listed with the plan's."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from tensorfold.checkpoint import Checkpoint
from tensorfold.cli import app
from tensorfold.follow.sharded import ShardedCheckpoint
from tensorfold.memory_plan import GIB, page_bytes
from tensorfold.shard import Shard

RUNNER = CliRunner()
FLAGS = ("--family", "example", "--context", "256", "--page-rows", "16", "--kv-gib", "0.01")
OFF = ("--prompt-cache-gib", "0", "--host-cache-gib", "0")


def explain(tiny_dir, *flags: str) -> dict:
    result = RUNNER.invoke(app, ["explain", str(tiny_dir), *FLAGS, *flags, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_explain_tp2_prints_one_ranks_memory(example, tiny_dir):
    checkpoint = Checkpoint(tiny_dir)
    parallel = example.tensor_parallel(checkpoint.config)
    rank = parallel.layout(example.declare(checkpoint.config, torch.float32).layout, 2)
    one, two = explain(tiny_dir, *OFF), explain(tiny_dir, *OFF, "--tp", "2")
    assert (two["tensor_parallel"], two["per_rank"], two["refusals"]) == (2, True, [])
    assert (one["tensor_parallel"], one["per_rank"]) == (1, False)
    # 4 layers · (k, v) · 1 of the 2 KV heads · head_dim 16 · 4 bytes
    assert two["bytes_per_token"] == rank.bytes_per_token == 4 * 2 * 1 * 16 * 4 == one["bytes_per_token"] // 2
    assert two["page_bytes"] == page_bytes(rank, 16) == 16 * 512
    assert two["stream_bytes_at_context"] == 256 * 512 and two["fixed_bytes_per_stream"] == 0
    sliced = sum(t.numel() * t.element_size()
                 for _, t in ShardedCheckpoint(checkpoint, parallel, Shard(1, 2)).tensors(progress=False))
    assert two["weights_bytes"] == sliced
    replicated = 2 * 512 * 64 * 4 + (2 * 4 + 1) * 64 * 4 + 2 * 4 * 16 * 4  # embed, lm_head, norms, q/k norms
    assert two["weights_bytes"] == replicated + (one["weights_bytes"] - replicated) // 2
    budget = int(0.01 * GIB)
    assert two["memory"] == {"budget_bytes": budget, "context": 256, "page_rows": 16, "page_bytes": 8192,
                             "fixed_bytes_per_stream": 0, "window_pages": 16, "stream_bytes": 16 * 8192,
                             "parallel": budget // (16 * 8192), "pages": budget // (16 * 8192) * 16,
                             "kv_bytes": budget // (16 * 8192) * 16 * 8192}
    text = RUNNER.invoke(app, ["explain", str(tiny_dir), *FLAGS, *OFF, "--tp", "2"]).output
    assert "tensor parallel    2 ranks · every number below is one rank's" in text
    assert f"weights            {sliced / 2**20:10.2f} MiB" in text
    assert "per token                 512 B" in text and "per page                 8192 B (16 rows)" in text
    assert "  attention          4 layers ·      512 B/token" in text and "no refusals" in text


def test_explain_tp_lists_what_tp_refuses(tiny_dir):
    kept = explain(tiny_dir, "--tp", "2")          # the device and host tiers on: they work at any size
    assert kept["refusals"] == []
    assert kept["per_rank"] and kept["bytes_per_token"] == 512
    odd = explain(tiny_dir, *OFF, "--tp", "3")
    assert not odd["per_rank"] and odd["bytes_per_token"] == 1024   # refused: the whole model's numbers
    assert "[example] family 'example' (plugin tensorfold_example.plugin): --tensor-parallel-size 3 does not " \
           "divide the KV heads (num_key_value_heads), 2" in odd["refusals"]
