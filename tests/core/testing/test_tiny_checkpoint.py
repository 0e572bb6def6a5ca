"""A tiny checkpoint's files: the tokenizer's special ids in config.json and generation_config.json, field
changes, and weights that one seed always draws the same."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.testing.tiny_checkpoint import draw_weight, write_tiny_config, write_tiny_weights
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


# -- the default weight rule --------------------------------------------------------------------------------------

def drawn(name: str, shape: tuple[int, ...], seed: int = 5) -> tuple[torch.Tensor, torch.Generator]:
    """`draw_weight`'s tensor, and a generator in the state it started from, to redraw by hand."""
    return draw_weight(name, shape, torch.Generator().manual_seed(seed)), torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name, shape, scale, shift", [
    ("backbone.layers.0.mixer.conv1d.weight", (48, 1, 4), 4 ** -0.5, 0.0),      # depthwise: fan_in K, not a norm
    ("model.layers.0.self_attn.q_conv1d.weight", (16, 1, 3), 3 ** -0.5, 0.0),
    ("encoder.conv.weight", (8, 2, 3), 6 ** -0.5, 0.0),                          # fan_in in/groups · K
    ("model.layers.0.mlp.experts.down_proj", (4, 8, 16), 16 ** -0.5, 0.0),      # stacked: the last dim
    ("model.layers.0.mixer.in_proj.weight", (10, 32), 32 ** -0.5, 0.0),
    ("backbone.layers.0.mixer.conv1d.bias", (48,), 0.1, 0.0),
    ("backbone.layers.0.mixer.norm.weight", (32,), 0.1, 1.0),
    ("backbone.layers.0.mixer.D", (4,), 0.1, 1.0),
    ("backbone.layers.0.mixer.dt_bias", (4,), 0.5, -2.0),
])
def test_each_kind_of_weight_gets_its_own_draw(name, shape, scale, shift):
    weight, again = drawn(name, shape)
    assert weight.dtype == torch.float32 and torch.equal(weight, shift + torch.randn(shape, generator=again) * scale)


def test_an_ssm_keeps_most_of_its_state_from_token_to_token():
    """A = exp(A_log) in [0.1, 1], and dt = softplus(x + dt_bias) with dt_bias at its mean -2: e^(-A·dt) keeps 73%
    to 99.5% of the state for an input x within ±1, so a resumed state carries what a test can see, and it changes."""
    a_log, again = drawn("backbone.layers.0.mixer.A_log", (4096,))
    assert torch.equal(a_log, (0.1 + 0.9 * torch.rand((4096,), generator=again)).log())
    a = a_log.exp()
    assert 0.1 <= float(a.min()) and float(a.max()) <= 1.0
    for x in (-1.0, 0.0, 1.0):
        keep = torch.exp(-a * torch.nn.functional.softplus(torch.tensor(x - 2.0)))
        assert 0.73 < float(keep.min()) and float(keep.max()) < 0.996


def test_write_tiny_weights_draws_by_the_default_rule(tmp_path):
    shapes = {"m.A_log": (4,), "m.conv1d.weight": (6, 1, 4), "m.norm.weight": (6,)}
    write_tiny_weights(tmp_path, shapes, seed=3)
    weights = load_file(tmp_path / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    assert all(torch.equal(weights[name], draw_weight(name, shapes[name], generator)) for name in sorted(shapes))
