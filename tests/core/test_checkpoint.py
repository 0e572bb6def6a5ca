"""Checkpoint directories: single file and shards, and clear errors for what is missing or damaged; the name and
shape checks families run before building a model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tensorfold.checkpoint import LISTED, Checkpoint, CheckpointError, check_tensor_names, expected_tensors


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


SHAPES = {"model.embed.weight": (4, 2), "model.norm.weight": (2,)}
NESTED = "model.inner."


def plain(name):
    return "model." + name[len(NESTED):] if name.startswith(NESTED) else name


def check(names, explain_missing=None):
    return check_tensor_names(names, SHAPES, plain, lambda key: key.startswith("vision."), model="toy",
                              explain_missing=explain_missing)


def test_names_in_either_spelling_pass_and_ignored_ones_are_counted():
    assert check(["model.embed.weight", "model.inner.norm.weight"]) == 0
    assert check(["model.embed.weight", "model.norm.weight", "vision.a", "vision.b"]) == 2


def test_every_missing_unexpected_and_doubled_name_is_in_one_error():
    names = ["model.embed.weight", "model.inner.embed.weight", "model.extra.weight"]
    with pytest.raises(ValueError) as caught:
        check(names)
    assert str(caught.value) == (
        "the checkpoint does not match its config.json: missing tensors: model.norm.weight; unexpected tensors "
        "(not part of a toy with this config): model.extra.weight; tensors given twice: model.embed.weight and "
        "model.inner.embed.weight")


def test_a_family_may_explain_what_is_missing():
    with pytest.raises(ValueError, match=r"missing tensors: model\.norm\.weight; norms come first$"):
        check(["model.embed.weight"], lambda missing: "norms come first" if "model.norm.weight" in missing else None)
    with pytest.raises(ValueError, match=r"missing tensors: model\.norm\.weight$"):
        check(["model.embed.weight"], lambda missing: None)


def test_long_lists_are_cut_with_a_count():
    shapes = {f"model.layers.{i}.w": (1,) for i in range(LISTED + 5)}
    with pytest.raises(ValueError, match=rf"missing tensors: (model\.layers\.\d+\.w, ){{{LISTED - 1}}}"
                                         rf"model\.layers\.\d+\.w, \.\.\. and 5 more$"):
        check_tensor_names([], shapes, plain, lambda key: False, model="toy")


def test_expected_tensors_come_once_in_the_plain_spelling(tmp_path):
    write(tmp_path, {"model.inner.embed.weight": torch.ones(4, 2), "model.norm.weight": torch.zeros(2),
                     "vision.a": torch.ones(3)})
    found = dict(expected_tensors(Checkpoint(tmp_path), SHAPES, plain, progress=False))
    assert found.keys() == SHAPES.keys() and torch.equal(found["model.embed.weight"], torch.ones(4, 2))


def test_a_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    write(tmp_path, {"model.embed.weight": torch.ones(4, 3), "model.norm.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"tensor model\.embed\.weight has shape \(4, 3\), the config needs \(4, 2\)"):
        list(expected_tensors(Checkpoint(tmp_path), SHAPES, plain, progress=False))
