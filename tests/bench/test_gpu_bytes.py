"""bench/gpu.py's bytes a decode step must move: a MoE's experts at batch 1 (k of N read) and at a batch (the
experts some row chooses, in expectation), each stream's fixed state read and written, its kv rows read."""

from __future__ import annotations

import gpu
import torch
from gpu import bytes_per_step, hf_model, step_bytes


def test_a_moe_step_reads_the_experts_its_rows_choose(monkeypatch):
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    hf, config = hf_model("qwen3_5-moe-tiny", torch.float32)
    experts = sum(p.numel() * 4 for name, p in hf.named_parameters() if ".experts." in name)
    embed = hf.get_input_embeddings().weight.numel() * 4
    rest = sum(p.numel() * 4 for p in hf.parameters()) - experts - embed
    N, k = config.num_experts, config.num_experts_per_tok
    assert bytes_per_step(hf, config) == rest + experts * k // N
    assert bytes_per_step(hf, config, 4) == rest + round(experts * (1 - (1 - k / N) ** 4))
    assert bytes_per_step(hf, config, 1000) == rest + experts


def test_a_step_moves_each_streams_state_twice_and_its_rows_once():
    class Layout:
        fixed_bytes, bytes_per_token = 1000, 10

    assert step_bytes(5000, Layout, 3, 128) == 5000 + 3 * (2 * 1000 + 10 * 128)
