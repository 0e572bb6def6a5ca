"""Startup: refusals from the core and the family are collected and reported together, before any load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tensorfold.boot import boot, generation_defaults, resolve_dtype
from tensorfold.checkpoint import Checkpoint
from tensorfold.embedded import embedded_checkpoint
from tensorfold.kv import WindowStore
from tensorfold.refusals import Refused
from tensorfold.settings import Settings, read_settings
from tensorfold.tokenizer import ChatTokenizer


def test_every_refusal_is_reported_at_once(example, tiny_dir):
    settings = Settings(family="example", model=tiny_dir, context=100000, prefill_chunk=0, dtype="float64",
                        min_chunk=0)
    with pytest.raises(Refused) as caught:
        boot(settings, example)
    text = str(caught.value)
    assert "--prefill-chunk 0" in text and "--dtype 'float64'" in text and "--min-chunk 0 must be at least 1" in text
    assert "[example]" in text and "--context 100000" in text
    assert len(caught.value.refusals) == 4


def test_a_checkpoint_of_another_model_type_is_refused_by_name(example, tiny_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "llama"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(Refused, match=r"--family example serves qwen3, but the checkpoint .* is model_type 'llama'"):
        boot(Settings(family="example", model=other), example)


def test_boot_builds_a_service(example, tiny_dir):
    settings = read_settings({}, [("TF_EXAMPLE_REQUEST_STARTS", True)], family="example", model=tiny_dir, context=64,
                             served_names=("tiny",), min_chunk=100)
    loaded = boot(settings, example)
    assert loaded.service.model_name == "tiny" and loaded.service.context == 64
    assert loaded.service.request_starts and loaded.engine.scheduler.min_chunk == 100
    assert loaded.dtype == torch.float32 and loaded.engine.kv.page_rows == 256
    assert loaded.engine.memory.slots.count == 256 and loaded.engine.kv.pages == 256   # auto: what fits, up to 256


def test_the_prompt_cache_is_on_by_default_off_at_zero_and_refused_below(example, tiny_dir):
    from tensorfold.settings import DEFAULT_PROMPT_CACHE_GIB
    from tensorfold.tiers import DeviceTier

    switches = {"TF_KV_PAGES": True, "TF_KV_POISON": False, "TF_EXAMPLE_REQUEST_STARTS": True}
    loaded = boot(Settings(family="example", model=tiny_dir, context=64, switches=switches), example)
    tier = loaded.engine.tier
    assert isinstance(tier, DeviceTier) and tier.budget == int(DEFAULT_PROMPT_CACHE_GIB * 2**30)
    assert loaded.engine.scheduler.tier is tier and "prompt_cache_states" in loaded.engine.snapshot()
    off = boot(Settings(family="example", model=tiny_dir, context=64, prompt_cache_gib=0, switches=switches), example)
    assert off.engine.tier is None and off.engine.scheduler.tier is None
    with pytest.raises(Refused, match=r"--prompt-cache-gib -1.0 must be 0 \(off\) or above"):
        boot(Settings(family="example", model=tiny_dir, context=64, prompt_cache_gib=-1.0, switches=switches),
             example)


def test_pages_off_gives_one_window_per_stream(example, tiny_dir):
    switches = {"TF_KV_PAGES": False, "TF_KV_POISON": True, "TF_EXAMPLE_REQUEST_STARTS": False}
    loaded = boot(Settings(family="example", model=tiny_dir, context=64, parallel=3, switches=switches), example)
    assert not loaded.service.request_starts
    assert isinstance(loaded.engine.kv, WindowStore) and loaded.engine.kv.capacity == 64
    assert loaded.engine.kv.poison and loaded.engine.memory.pool is None


def test_a_parallel_that_does_not_fit_is_refused_with_the_numbers(example, tiny_dir):
    settings = Settings(family="example", model=tiny_dir, context=4096, parallel=8, kv_gib=0.01)
    with pytest.raises(Refused, match=r"--parallel 8 needs 32.0 MiB of KV at --context 4096, the budget is 10.2 MiB: "
                                      r"serve --parallel 2 or lower --context"):
        boot(settings, example)


def test_auto_dtype_is_float32_on_cpu_and_bfloat16_on_cuda():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_generation_config_gives_the_sampling_defaults(tiny_dir):
    tokenizer = ChatTokenizer(tiny_dir)
    defaults = generation_defaults({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2}, tokenizer)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.9, 20)
    assert generation_defaults({"do_sample": False}, tokenizer).temperature == 0.0


def test_the_embedded_default_is_made_once(example, tmp_path):
    first = embedded_checkpoint(example, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = embedded_checkpoint(example, tmp_path)
    assert first == second and (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert Checkpoint(first).model_type == "qwen3"
    assert [p.name for p in first.parent.iterdir()] == [first.name]
