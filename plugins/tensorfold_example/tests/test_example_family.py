"""The example family against HF transformers (the oracle), through its real entry point, and against itself.

transformers is imported lazily, after each test has moved into its own tmp_path (conftest.py): HF probes optional
packages with importlib, so a folder named like one (`fla`, ...) in the working directory would fool it.
Run `pytest -s plugins/tensorfold_example` to see the measured differences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.kv import KvStore, WindowStore
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.settings import Settings
from tensorfold.testing.kit import every_row, greedy
from tensorfold.testing.tiny_tokenizer import write_tiny_tokenizer
from tensorfold_example import plugin
from tensorfold_example.load import load
from tensorfold_example.model import ExampleModel

TOLERANCE = 1e-4      # fp32 max-abs logits vs HF, at every position
PROMPT = 64
GREEDY = 32
VOCAB = 512

# Tiny configs that vary what a plain GQA family can get wrong.
CONFIGS = {
    "gqa2-hd16-untied": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False),
    "mqa-hd32-tied-bias": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                               tie_word_embeddings=True, rope_theta=1_000_000.0, attention_bias=True),
    "mha-hd8-4layers": dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                            tie_word_embeddings=False, rope_theta=500_000.0, attention_bias=False),
    "gqa4-h8-tied": dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         tie_word_embeddings=True, rope_theta=1000.0, attention_bias=True),
}


# ---------------------------------------------------------------- the oracle

def hf_checkpoint(directory: Path, seed: int, rope_theta: float, **fields: object) -> Path:
    """A tiny random Qwen3 written by transformers itself (config, safetensors, tokenizer).

    HF's own init (std 0.02) gives near-flat logits where greedy decoding is a coin toss; every weight is
    drawn again: matrices N(0, 1/fan_in), norm weights 1 + 0.1 N(0, 1), biases 0.1 N(0, 1).
    """
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    specials = write_tiny_tokenizer(directory, VOCAB)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=specials["<|endoftext|>"], eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"], **fields)
    model = transformers.Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() == 2:
                param.copy_(noise * param.shape[1] ** -0.5)
            elif name.endswith(".bias"):
                param.copy_(noise * 0.1)
            else:
                param.copy_(1.0 + noise * 0.1)
    model.save_pretrained(directory)
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32, attention: str = "eager"):
    """The checkpoint as transformers loads it, ready to decode greedily to a fixed length."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=attention)
    model.eval()
    model.generation_config.eos_token_id = None   # decode the full length; never stop early
    return model


def prompt_tokens(seed: int, length: int = PROMPT) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- driving our model

def ours(directory: Path, dtype: torch.dtype = torch.float32) -> ExampleModel:
    return load(Checkpoint(directory), dtype, torch.device("cpu"), progress=False)


def store(directory: Path, dtype: torch.dtype = torch.float32, slots: int = 2,
          capacity: int = PROMPT + GREEDY + 1) -> KvStore:
    """Memory as the engine would hold it, from the family's own Layout for this checkpoint."""
    layout = plugin.family_kv_layout(config=Checkpoint(directory).config, dtype=dtype)
    return WindowStore(layout, slots, capacity, poison=True)   # NaN in unwritten rows: a wrong read shows up


def compare_with_hf(directory: Path, label: str) -> float:
    """Our logits vs HF's at every prompt position (eager and sdpa attention), and 32 greedy tokens vs HF's
    generate; returns the largest max-abs difference."""
    tokens = prompt_tokens(seed=1)
    ids = torch.tensor([tokens])
    model = ours(directory)
    logits = every_row(model, store(directory), tokens, cuts=[])                     # [PROMPT, V]
    diffs, models = {}, {}
    for attention in ("eager", "sdpa"):
        models[attention] = hf_model(directory, attention=attention)
        with torch.no_grad():
            reference = models[attention](ids).logits[0].float()                      # [PROMPT, V]
        assert logits.shape == reference.shape
        diffs[attention] = float((logits - reference).abs().max())
    print(f"\n[example vs HF] {label}: max |logits - HF| over {PROMPT} positions: eager {diffs['eager']:.3e}, "
          f"sdpa {diffs['sdpa']:.3e} (largest logit {float(reference.abs().max()):.2f})")
    assert max(diffs.values()) <= TOLERANCE, f"{label}: logits differ from HF by {diffs}"

    with torch.no_grad():
        hf_tokens = models["eager"].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY,
                                              do_sample=False)[0, PROMPT:].tolist()
    assert len(hf_tokens) == GREEDY
    assert greedy(model, store(directory), tokens, GREEDY) == hf_tokens, f"{label}: greedy tokens differ from HF"
    return max(diffs.values())


# ---------------------------------------------------------------- against HF

@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_matches_hf(tmp_path: Path, label: str) -> None:
    fields = dict(CONFIGS[label])
    directory = hf_checkpoint(tmp_path / label, seed=sorted(CONFIGS).index(label), **fields)
    compare_with_hf(directory, label)


def test_own_tiny_checkpoint_loads_in_hf_and_matches(tmp_path: Path) -> None:
    directory = tmp_path / "tiny"
    plugin.family_make_tiny(directory=directory, seed=0)
    compare_with_hf(directory, "make_tiny seed 0")


# ---------------------------------------------------------------- against itself

def test_make_tiny_is_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        plugin.family_make_tiny(directory=tmp_path / name, seed=3)
    for file in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    plugin.family_make_tiny(directory=tmp_path / "c", seed=4)
    assert (tmp_path / "a/model.safetensors").read_bytes() != (tmp_path / "c/model.safetensors").read_bytes()


def test_chunked_prefill_matches_one_shot(tmp_path: Path) -> None:
    plugin.family_make_tiny(directory=tmp_path, seed=0)
    model = ours(tmp_path)
    tokens = prompt_tokens(seed=2)
    one_shot = every_row(model, store(tmp_path), tokens, cuts=[])
    worst = 0.0
    for cuts in ([1], [1, 8, 24, 27], [13, 14, 15, 50], list(range(1, PROMPT))):
        chunked = every_row(model, store(tmp_path), tokens, cuts=cuts)
        worst = max(worst, float((chunked - one_shot).abs().max()))
    print(f"\n[example] chunked vs one-shot prefill: max diff {worst:.3e}")
    assert worst <= TOLERANCE


def test_streams_do_not_touch_each_other(tmp_path: Path) -> None:
    """Two streams in one plan give bit-identical logits to each run alone; forward returns sampled rows in order."""
    plugin.family_make_tiny(directory=tmp_path, seed=0)
    model = ours(tmp_path)
    a, b = prompt_tokens(seed=5, length=40), prompt_tokens(seed=6, length=23)
    alone_a = model.forward(StepPlan([StreamStep(0, 0, a)]), store(tmp_path))
    alone_b = model.forward(StepPlan([StreamStep(1, 0, b)]), store(tmp_path))
    kv = store(tmp_path)
    both = model.forward(StepPlan([StreamStep(1, 0, b), StreamStep(0, 0, a)]), kv)
    assert both.shape == (2, VOCAB) and both.dtype == torch.float32
    assert torch.equal(both[0], alone_b[0]) and torch.equal(both[1], alone_a[0])
    quiet = model.forward(StepPlan([StreamStep(0, 40, [7], sample=False), StreamStep(1, 23, [9])]), kv)
    assert quiet.shape == (1, VOCAB)
    none = model.forward(StepPlan([StreamStep(0, 41, [8], sample=False)]), kv)
    assert none.shape == (0, VOCAB)


def test_bf16_runs_finite_and_tracks_hf(tmp_path: Path) -> None:
    plugin.family_make_tiny(directory=tmp_path, seed=0)
    tokens = prompt_tokens(seed=7)
    half = ours(tmp_path, torch.bfloat16)
    kv = store(tmp_path, torch.bfloat16)
    assert kv.layout.layers[0].rows[0].dtype == "bfloat16"
    logits = every_row(half, kv, tokens, cuts=[20, 41])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert all(0 <= t < VOCAB for t in greedy(half, store(tmp_path, torch.bfloat16), tokens, 8))

    one_shot = every_row(half, store(tmp_path, torch.bfloat16), tokens, cuts=[])
    with torch.no_grad():
        hf_half = hf_model(tmp_path, torch.bfloat16)(torch.tensor([tokens])).logits[0].float()
        hf_full = hf_model(tmp_path)(torch.tensor([tokens])).logits[0].float()
    vs_hf = float((one_shot - hf_half).abs().max())
    vs_fp32 = float((one_shot - hf_full).abs().max())
    print(f"\n[example] bf16: vs HF bf16 (eager) {vs_hf:.3e}; vs HF fp32 {vs_fp32:.3e}; "
          f"chunked vs one-shot {float((logits - one_shot).abs().max()):.3e}")
    assert vs_hf <= 0.1 and vs_fp32 <= 0.5


# ---------------------------------------------------------------- loading

def test_nested_prefix_and_tied_head_are_accepted(tmp_path: Path) -> None:
    plugin.family_make_tiny(directory=tmp_path / "plain", seed=0)
    nested = tmp_path / "nested"
    plugin.family_make_tiny(directory=nested, seed=0)
    weights = load_file(nested / "model.safetensors")
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in weights.items()}
    save_file(renamed, str(nested / "model.safetensors"), metadata={"format": "pt"})
    tokens = prompt_tokens(seed=8, length=16)
    plain_model, nested_model = ours(tmp_path / "plain"), ours(nested)
    assert torch.equal(every_row(plain_model, store(tmp_path / "plain"), tokens, []),
                       every_row(nested_model, store(nested), tokens, []))

    config = json.loads((nested / "config.json").read_text())      # tied: lm_head.weight is present but ignored
    (nested / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tied = ours(nested)
    assert tied.weights.lm_head is tied.weights.embed


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    plugin.family_make_tiny(directory=tmp_path, seed=0)
    path = tmp_path / "model.safetensors"
    weights = load_file(path)

    del weights["model.layers.2.self_attn.k_norm.weight"]
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.self_attn\.k_norm\.weight"):
        ours(tmp_path)

    weights["model.layers.2.self_attn.k_norm.weight"] = torch.ones(16)
    weights["model.layers.0.self_attn.sinks"] = torch.zeros(4)
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.0\.self_attn\.sinks"):
        ours(tmp_path)

    del weights["model.layers.0.self_attn.sinks"]
    weights["model.norm.weight"] = torch.ones(63)
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(63,\)"):
        ours(tmp_path)


# ---------------------------------------------------------------- through the entry point

def test_loads_through_entry_point(tmp_path: Path) -> None:
    from tensorfold.plugins import installed_names, load_families

    assert "example" in installed_names(), "pip install -e plugins/tensorfold_example first"
    family = load_families(["example"])["example"]
    assert family.model_types == ("qwen3",) and family.request_starts_switch == "TF_EXAMPLE_REQUEST_STARTS"
    family.make_tiny(tmp_path, seed=0)
    checkpoint = Checkpoint(tmp_path)
    found = family.declare(checkpoint.config, torch.float32)
    assert len(found.layout.layers) == 4
    assert found.layout.bytes_per_token == 4 * 2 * (2 * 16 * 4)         # layers * (k, v) * kv_heads*head_dim*fp32
    assert found.image.name == "example-gqa" and len(found.image.rows) == 8 and not found.image.own
    assert found.identity["dtype"] == "float32" and found.identity["format"] == "example-gqa/1"
    model = family.load(checkpoint, torch.float32, torch.device("cpu"))
    assert model.vocab_size == VOCAB
    assert family.refusals(checkpoint.config, Settings(context=4096)) == []


def test_refusals_name_the_flag_or_field(tmp_path: Path) -> None:
    plugin.family_make_tiny(directory=tmp_path, seed=0)
    config = json.loads((tmp_path / "config.json").read_text())

    def refusals(context: int = 4096, **changes: object) -> list[str]:
        return list(plugin.family_refusals(config={**config, **changes}, settings=Settings(context=context)))

    assert refusals() == []
    assert refusals(attention_bias=True) == []                      # supported: q/k/v/o biases
    (too_long,) = refusals(context=8192)
    assert "--context 8192" in too_long and "max_position_embeddings 4096" in too_long
    (sliding,) = refusals(use_sliding_window=True, sliding_window=128)
    assert "use_sliding_window" in sliding
    (rope,) = refusals(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    assert "rope_type" in rope
    (act,) = refusals(hidden_act="gelu")
    assert "hidden_act" in act
    (broken,) = refusals(num_attention_heads=None)
    assert "num_attention_heads" in broken
