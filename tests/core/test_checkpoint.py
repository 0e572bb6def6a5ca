"""Checkpoint directories: single file and shards, and clear errors for what is missing or damaged."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tensorfold.checkpoint import Checkpoint, CheckpointError


def write(directory, tensors, config=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or {"model_type": "qwen3"}))
    save_file(tensors, str(directory / "model.safetensors"))


def test_single_file_is_read_lazily(tmp_path):
    write(tmp_path, {"a": torch.ones(2), "b": torch.zeros(3)})
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.names() == ["a", "b"] and checkpoint.model_type == "qwen3"
    assert torch.equal(checkpoint.tensor("b"), torch.zeros(3))
    assert dict(checkpoint.tensors(progress=False)).keys() == {"a", "b"}
    assert checkpoint.generation == {}


def test_shards_follow_the_index(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    checkpoint = Checkpoint(tmp_path)
    assert len(checkpoint.shards()) == 2 and checkpoint.tensor("b").shape == (3,)


def test_missing_and_damaged_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nowhere")
    write(tmp_path / "ok", {"a": torch.ones(1)})
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "ok", broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        Checkpoint(broken)
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        Checkpoint(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        Checkpoint(broken)
    with pytest.raises(CheckpointError, match="no tensor 'zz'"):
        Checkpoint(tmp_path / "ok").tensor("zz")


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "gone.safetensors"}}')
    with pytest.raises(CheckpointError, match="names shard gone.safetensors, which is missing"):
        Checkpoint(tmp_path)
