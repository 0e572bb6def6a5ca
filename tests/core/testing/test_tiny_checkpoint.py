"""A tiny checkpoint's files: the tokenizer's special ids in config.json and generation_config.json, field
changes, and weights that one seed always draws the same."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights
from tensorfold.testing.tiny_tokenizer import SPECIALS

CONFIG = {"model_type": "toy", "vocab_size": 512, "hidden_size": 8, "sliding_window": 16}
SHAPES = {"b.weight": (3,), "a.weight": (4, 2)}


def draw(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator)


def test_the_config_names_the_tokenizers_special_tokens(tmp_path):
    written = write_tiny_config(tmp_path, CONFIG, hidden_size=16, sliding_window=None, eos_token_id=None)
    assert written == json.loads((tmp_path / "config.json").read_text())
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    ids = {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    assert set(ids) == set(SPECIALS)
    assert written == {"model_type": "toy", "vocab_size": 512, "hidden_size": 16,
                       "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"]}
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"eos_token_id": ids["<|im_end|>"]}
    assert write_tiny_config(tmp_path / "plain", CONFIG)["eos_token_id"] == ids["<|im_end|>"]


def test_weights_are_drawn_in_name_order_from_one_seed(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        (tmp_path / name).mkdir()
        write_tiny_weights(tmp_path / name, SHAPES, draw, seed)
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a != (tmp_path / "c" / "model.safetensors").read_bytes()
    generator = torch.Generator().manual_seed(7)
    first, second = torch.randn((4, 2), generator=generator), torch.randn((3,), generator=generator)
    weights = load_file(tmp_path / "a" / "model.safetensors")
    assert torch.equal(weights["a.weight"], first) and torch.equal(weights["b.weight"], second)


def test_the_files_make_a_checkpoint(tmp_path):
    write_tiny_config(tmp_path, CONFIG)
    write_tiny_weights(tmp_path, SHAPES, draw, 0)
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.model_type == "toy" and checkpoint.names() == ["a.weight", "b.weight"]
    assert checkpoint.generation["eos_token_id"] == checkpoint.config["eos_token_id"]
