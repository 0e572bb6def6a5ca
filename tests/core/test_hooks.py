"""Every hook spec: what a good answer does, and how a bad one is refused with the plugin named.

The meta-tests at the bottom fail when a hook spec lacks a test here or an entry in docs/hooks.md.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from tensorfold import hookspecs
from tensorfold.checkpoint import Checkpoint
from tensorfold.family import FamilyModel, PluginError
from tensorfold.hookspecs import hookimpl
from tensorfold.image import ImageFormat
from tensorfold.plugins import REQUIRED_HOOKS, register_families
from tensorfold.settings import Settings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


def variant(**overrides):
    """The template family with some hooks answered differently, as a plugin object."""
    import tensorfold_example.plugin as base

    namespace = {}
    for name in REQUIRED_HOOKS + hookspecs.OPTIONAL:
        if name in overrides:
            namespace[name] = staticmethod(hookimpl(overrides[name]))
        else:
            namespace[name] = staticmethod(getattr(base, name))
    return type("Variant", (), namespace)()


def bound(**overrides):
    """The variant registered as family `broken`."""
    return register_families({"broken": variant(**overrides)})["broken"]


def test_hook_family_model_types(example):
    assert example.model_types == ("qwen3",)
    with pytest.raises(PluginError, match=r"family 'broken' \(plugin .*test_hooks\).*family_model_types"):
        bound(family_model_types=lambda: [])


def test_hook_family_load(example, tiny_dir):
    model = example.load(Checkpoint(tiny_dir), torch.float32, torch.device("cpu"))
    assert isinstance(model, FamilyModel) and model.vocab_size == 512
    family = bound(family_load=lambda checkpoint, dtype, device, shard: object())
    with pytest.raises(PluginError, match=r"'broken'.*family_load returned object"):
        family.load(Checkpoint(tiny_dir), torch.float32, torch.device("cpu"))


def test_hook_family_tensor_parallel(example, tiny_dir):
    from tensorfold.shard import TensorParallel

    config = Checkpoint(tiny_dir).config                 # 4 heads, 2 KV heads, 128 MLP columns
    assert isinstance(example.tensor_parallel(config), TensorParallel)
    assert example.tp_refusals(config, 1) == example.tp_refusals(config, 2) == []
    found = example.tp_refusals(config, 3)
    assert len(found) == 3 and all(line.startswith("family 'example' (plugin tensorfold_example.plugin): "
                                                   "--tensor-parallel-size 3 does not divide the ") for line in found)
    assert any("KV heads (num_key_value_heads), 2" in line for line in found)
    family = bound(family_tensor_parallel=lambda config: {"heads": 4})
    with pytest.raises(PluginError, match=r"'broken'.*family_tensor_parallel must return a TensorParallel"):
        family.tensor_parallel(config)
    silent = bound(family_tensor_parallel=lambda config: None)
    [line] = silent.tp_refusals(config, 2)
    assert line.startswith("family 'broken' (plugin ") and line.endswith(
        "declares no family_tensor_parallel: it serves at --tensor-parallel-size 1 only")


def test_hook_family_make_tiny(example, tmp_path):
    example.make_tiny(tmp_path / "a", seed=3)
    example.make_tiny(tmp_path / "b", seed=3)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    family = bound(family_make_tiny=lambda directory, seed: None)
    with pytest.raises(PluginError, match=r"'broken'.*wrote no config.json"):
        family.make_tiny(tmp_path / "c")


def test_hook_family_kv_layout(example, tiny_dir):
    config = Checkpoint(tiny_dir).config
    layout = example.declare(config, torch.bfloat16).layout
    heads, dim = config["num_key_value_heads"], config["head_dim"]
    assert layout.bytes_per_token == config["num_hidden_layers"] * 2 * heads * dim * 2
    family = bound(family_kv_layout=lambda config, dtype: {"layers": []})
    with pytest.raises(PluginError, match=r"'broken'.*family_kv_layout must return a Layout, got dict"):
        family.declare(config, torch.float32)


def test_hook_family_state_image(example, tiny_dir):
    config = Checkpoint(tiny_dir).config
    found = example.declare(config, torch.float32)
    assert found.image.rows and not found.image.own
    family = bound(family_state_image=lambda config, layout: ImageFormat("lossy", 1, own=[], rows=[(0, "k")]))
    with pytest.raises(PluginError, match=r"'broken'.*leaves out.*\(0, 'v'\)"):
        family.declare(config, torch.float32)


def test_hook_family_identity(example, tiny_dir):
    config = Checkpoint(tiny_dir).config
    facts = example.declare(config, torch.float32).identity
    assert facts and all(isinstance(v, str) for v in facts.values())
    assert example.declare(config, torch.bfloat16).identity != facts
    family = bound(family_identity=lambda config, dtype: {"layers": 4})
    with pytest.raises(PluginError, match=r"'broken'.*family_identity must return a mapping of str to str"):
        family.declare(config, torch.float32)


def test_hook_family_request_starts_switch(example):
    assert example.request_starts_switch == "TF_EXAMPLE_REQUEST_STARTS"
    with pytest.raises(PluginError, match=r"'broken'.*family_request_starts_switch.*'lowercase'"):
        bound(family_request_starts_switch=lambda: "lowercase")


def test_hook_family_refusals(example, tiny_dir):
    config = Checkpoint(tiny_dir).config
    assert example.refusals(config, Settings(context=256)) == []
    too_long = example.refusals(config, Settings(context=config["max_position_embeddings"] + 1))
    assert too_long and "--context" in too_long[0]
    family = bound(family_refusals=lambda config, settings: "no")
    with pytest.raises(PluginError, match=r"'broken'.*family_refusals must return a sequence"):
        family.refusals(config, Settings())


def test_hook_family_chat_format(example, tiny_dir):
    from tensorfold.chat.api import ChatFormat
    from tensorfold.chat.tools import tool_parser

    config = Checkpoint(tiny_dir).config
    found = example.chat_format(config)
    assert (found.tool_parser.name, found.think_start, found.think_end) == ("hermes", None, None)
    hermes = tool_parser("hermes")
    for answer, said in [
            ({"tool_parser": "hermes"}, r"must return a ChatFormat, got dict"),
            (ChatFormat(tool_parser="hermes"), r"tool_parser str lacks name, parse\(text, tools\) or stream"),
            (ChatFormat(hermes, think_start="<think>"), r"think_start and think_end must both be set"),
            (ChatFormat(hermes, "<think>", " "), r"think markers must be non-blank strings"),
            (ChatFormat(hermes, "<t>", "<t>"), r"think_start and think_end must differ")]:
        family = bound(family_chat_format=lambda config, answer=answer: answer)
        with pytest.raises(PluginError, match=r"family 'broken' \(plugin .*test_hooks\): family_chat_format.*" + said):
            family.chat_format(config)


def test_a_family_without_chat_format_gets_hermes_without_markers(tiny_dir):
    from tensorfold.family import DEFAULT_CHAT_FORMAT

    plugin = variant()
    delattr(type(plugin), "family_chat_format")
    family = register_families({"plain": plugin})["plain"]
    assert family.chat_format(Checkpoint(tiny_dir).config) is DEFAULT_CHAT_FORMAT
    assert DEFAULT_CHAT_FORMAT.tool_parser.name == "hermes" and DEFAULT_CHAT_FORMAT.think_start is None
    assert bound(family_chat_format=lambda config: None).chat_format({}) is DEFAULT_CHAT_FORMAT


def test_a_hook_that_raises_is_reported_with_the_plugin(tiny_dir):
    def explode(config, dtype):
        raise KeyError("hidden_size")

    family = bound(family_kv_layout=explode)
    with pytest.raises(PluginError, match=r"'broken'.*family_kv_layout raised KeyError"):
        family.declare(Checkpoint(tiny_dir).config, torch.float32)


def test_a_missing_hook_is_refused_naming_the_plugin():
    plugin = variant()
    delattr(type(plugin), "family_identity")
    with pytest.raises(PluginError, match=r"'broken'.*does not implement family_identity"):
        register_families({"broken": plugin})


def test_an_unknown_hook_is_refused():
    plugin = variant(family_model_types=lambda: ["x"])
    type(plugin).family_colour = staticmethod(hookimpl(lambda: "red"))
    with pytest.raises(PluginError, match="family_colour"):
        register_families({"broken": plugin})


def test_two_families_cannot_claim_one_model_type():
    with pytest.raises(PluginError, match=r"model type 'qwen3' is claimed by family 'one' and by family 'two'"):
        register_families({"one": variant(), "two": variant()})


def test_hooks_are_bound_to_their_own_plugin(tiny_dir):
    families = register_families({"one": variant(), "two": variant(family_model_types=lambda: ["other"],
                                                                  family_identity=lambda: {"who": "two"})})
    config = Checkpoint(tiny_dir).config
    assert families["two"].declare(config, torch.float32).identity == {"who": "two"}
    assert families["one"].declare(config, torch.float32).identity != {"who": "two"}


def test_unknown_family_name_lists_installed():
    from tensorfold.plugins import load_families

    with pytest.raises(PluginError, match=r"no family named 'nope' is installed \(installed: .*example"):
        load_families(["nope"])


SPECS = sorted(name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("family_"))


@pytest.mark.parametrize("hook", SPECS)
def test_every_hook_has_a_test(hook):
    assert f"test_hook_{hook}" in globals(), f"hook spec {hook} has no test_hook_{hook} in {__file__}"


@pytest.mark.parametrize("hook", SPECS)
def test_every_hook_is_documented(hook):
    args = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
    heading = f"{hook}({args})"
    assert re.search(rf"^#+ `?{re.escape(heading)}`?", DOCS.read_text(), re.MULTILINE), (
        f"docs/hooks.md lacks a heading for {heading}")


def test_required_hooks_are_the_specs():
    assert sorted(REQUIRED_HOOKS + hookspecs.OPTIONAL) == SPECS
    assert not set(REQUIRED_HOOKS) & set(hookspecs.OPTIONAL)


def test_families_json_lists_every_declaration(tmp_path):
    from typer.testing import CliRunner

    from tensorfold.cli import app

    result = CliRunner().invoke(app, ["families", "--json"])
    assert result.exit_code == 0, result.output
    entry = next(e for e in json.loads(result.output) if e["name"] == "example")
    assert entry["model_types"] == ["qwen3"] and entry["request_starts_switch"] == "TF_EXAMPLE_REQUEST_STARTS"
    assert entry["layout"]["bytes_per_token"] > 0 and entry["image"]["name"] and entry["identity"]
    assert entry["chat_format"] == {"tool_parser": "hermes", "think_start": None, "think_end": None}
