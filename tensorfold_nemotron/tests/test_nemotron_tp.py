"""Nemotron-H at TP=2 over gloo in real processes, on the tiny hybrid checkpoint (M E * M -: Mamba2, MoE with a
shared expert, attention, MLP): greedy tokens equal TP=1's, concurrent == solo, the same bits run to run; each
rank's states are its pieces of TP=1's (and on a latent-MoE twin); the tensor-only decode is the forward's bits at
TP=2; the cuts give each rank its heads and groups; refusals name what does not divide.

Tolerance: every logits row rank 0 sampled from at TP=2 is within 1e-4 (absolute, float32) of TP=1's, and so is
every row of a prompt prefilled in pieces and decoded; the tokens are compared exactly. TP=2 against TP=2 is
bitwise (the reductions add the ranks' parts in rank order). Run `pytest -s` to see the measured differences.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from nemotron_oracle import prompt_tokens
from nemotron_tp import world_states
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.family import PluginError
from tensorfold.follow.rank import load_rank
from tensorfold.follow.sharded import ShardedCheckpoint
from tensorfold.plugins import load_families
from tensorfold.shard import Shard, Split, TensorParallel
from tensorfold.testing.tp_world import Job, greedy_gap, replied, same_bits, tp1_and_tp2
from tensorfold_nemotron import plugin
from tensorfold_nemotron.mamba import MambaWeights
from tensorfold_nemotron.mlp import MoeWeights
from tensorfold_nemotron.shapes import SHAPES

LOGIT_ATOL = 1e-4
STATE_ATOL = 1e-4
PROMPTS = (tuple(range(1, 20)), tuple(range(30, 41)), (5, 5, 5), tuple(range(100, 137)))
# the tiny checkpoint's Mamba2: inner width I = 4 heads of 16, 2 groups of state 16, conv kernel 4
INNER, P, G, N, K = 64, 16, 2, 16, 4
MIXER = "backbone.layers.0.mixer."


@pytest.fixture(scope="module")
def family():
    return load_families(["nemotron"])["nemotron"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, family):
    directory = tmp_path_factory.mktemp("tiny-nemotron")
    family.make_tiny(directory, seed=0)
    return directory


@pytest.fixture(scope="module")
def latent(tmp_path_factory):
    """The tiny schedule with a latent MoE (its experts read and write 32 wide) and a conv without bias."""
    directory = tmp_path_factory.mktemp("tiny-nemotron-latent")
    plugin.write_tiny(directory, seed=1, moe_latent_size=32, use_conv_bias=False)
    return directory


@pytest.fixture(scope="module")
def worlds(tiny, tmp_path_factory):
    """TP=1 once, TP=2 twice: rank 0's replies and logits rows."""
    return tp1_and_tp2(Job(family="nemotron", model=tiny, prompts=PROMPTS), tmp_path_factory.mktemp("worlds"))


# ---------------------------------------------------------------- TP=2 through the engine

def test_tp2_greedy_tokens_equal_tp1(worlds):
    one, (two, _) = worlds
    rows, worst = greedy_gap(one, two, 12)
    print(f"\n[nemotron] TP=2 vs TP=1: max |logit difference| over {rows} sampled rows {worst:.2e}")
    assert rows >= len(PROMPTS) * 12 and worst <= LOGIT_ATOL, worst


def test_tp2_concurrent_equals_solo(worlds):
    _, runs = worlds
    assert all(replied(run["together"]) == replied(run["alone"]) for run in runs)


def test_tp2_is_the_same_bits_run_to_run(worlds):
    _, (first, second) = worlds
    assert same_bits(first, second)



# ---------------------------------------------------------------- each rank's states

@pytest.mark.parametrize("variant", ["tiny", "latent"])
def test_each_rank_holds_its_pieces_of_every_state(variant, request, family, tmp_path):
    """A prompt prefilled in pieces (on and off the scan grid), then 4 tokens decoded: every row's logits within
    1e-4 of TP=1's, and each rank's conv tail, SSM state, keys and values are its cut of TP=1's (the conv tail
    piece by piece over [x | B | C]) within 1e-4. The latent variant: each rank's routed experts go through the
    replicated fc2 latent projection before the one reduction of the layer."""
    tiny = request.getfixturevalue(variant)
    prompt, decoded = prompt_tokens(seed=3, length=40), [7, 9, 11, 13]
    (one,) = world_states(1, tiny, prompt, [5, 21], decoded, tmp_path / "tp1")
    ranks = world_states(2, tiny, prompt, [5, 21], decoded, tmp_path / "tp2")
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])               # every rank holds the same bits
    logits = float((ranks[0]["logits"] - one["logits"]).abs().max())
    parallel = family.tensor_parallel(Checkpoint(tiny).config)
    conv = TensorParallel(divides={}, params=[Split("conv", "column", parts=(INNER, G * N, G * N)),
                                              Split("ssm", "column")])
    worst = 0.0
    for (index, name), whole in one["states"].items():
        for rank, found in enumerate(ranks):
            own = found["states"][(index, name)]
            # keys and values read back as [end, KV, D]: KV heads on dim 1; the fixed states head (or channel) first
            expected = whole.chunk(2, 1)[rank] if name in ("k", "v") else conv.part(name, whole, rank, 2)
            assert own.shape == expected.shape, (index, name, own.shape, expected.shape)
            worst = max(worst, float((own.float() - expected.float()).abs().max()))
    assert sorted({name for _, name in one["states"]}) == ["conv", "k", "ssm", "v"]
    assert [s.name for s in parallel.states] == ["conv", "ssm", "k", "v"]
    assert parallel.states[0].parts == (INNER, G * N, G * N)
    print(f"\n[nemotron TP=2] {variant}: every row of a 40-token prompt and 4 decoded: max |logits - TP=1| "
          f"{logits:.2e}; max |state - TP=1's cut| {worst:.2e}")
    assert logits <= LOGIT_ATOL and worst <= STATE_ATOL


def test_the_tensor_only_decode_at_tp2_is_the_forward(tiny, tmp_path):
    """The decode step (fused norms, the gated SSD step, the grouped gated norm and the paged attention on the
    rank's shapes, one reduction a layer) in a batch of one gives the forward's logits and states bit for bit at
    TP=2, as it does at TP=1 (test_nemotron_decode.py)."""
    prompt, decoded = prompt_tokens(seed=4, length=24), [3, 5, 8]
    forward = world_states(2, tiny, prompt, [], decoded, tmp_path / "forward")
    tensor_only = world_states(2, tiny, prompt, [], decoded, tmp_path / "decode", tensor_only=True)
    for a, b in zip(forward, tensor_only, strict=True):
        assert torch.equal(a["logits"], b["logits"])
        assert a["states"].keys() == b["states"].keys()
        assert all(torch.equal(a["states"][key], b["states"][key]) for key in a["states"])


# ---------------------------------------------------------------- the cuts

def sliced(directory: Path, family, rank: int, name: str) -> torch.Tensor:
    checkpoint = Checkpoint(directory)
    return ShardedCheckpoint(checkpoint, family.tensor_parallel(checkpoint.config), Shard(rank, 2)).tensor(name)


def test_each_rank_gets_its_heads_and_groups_of_the_fused_in_proj(tiny, family):
    """in_proj rows are [z (I) | x (I) | B (G·N) | C (G·N) | dt (MH)]: rank r holds heads 2r, 2r+1 of z, x and dt
    and group r of B and C; the conv over [x | B | C] and its bias the same way; A_log, D, dt_bias by head; the
    gated norm by group; out_proj by input column."""
    whole = Checkpoint(tiny)
    for rank in range(2):
        heads, group = (2 * rank, 2 * rank + 1), rank
        z = [h * P + p for h in heads for p in range(P)]
        x = [INNER + row for row in z]
        b = [2 * INNER + group * N + n for n in range(N)]
        c = [2 * INNER + G * N + group * N + n for n in range(N)]
        dt = [2 * INNER + 2 * G * N + h for h in heads]
        assert torch.equal(sliced(tiny, family, rank, MIXER + "in_proj.weight"),
                           whole.tensor(MIXER + "in_proj.weight")[z + x + b + c + dt])
        channels = [row - INNER for row in x + b + c]                              # conv channels [x | B | C]
        for name in ("conv1d.weight", "conv1d.bias"):
            assert torch.equal(sliced(tiny, family, rank, MIXER + name), whole.tensor(MIXER + name)[channels])
        for name in ("A_log", "D", "dt_bias"):
            assert torch.equal(sliced(tiny, family, rank, MIXER + name), whole.tensor(MIXER + name)[list(heads)])
        assert torch.equal(sliced(tiny, family, rank, MIXER + "norm.weight"),
                           whole.tensor(MIXER + "norm.weight")[z])                # group r's channels = heads' z
        assert torch.equal(sliced(tiny, family, rank, MIXER + "out_proj.weight"),
                           whole.tensor(MIXER + "out_proj.weight")[:, z])


def test_attention_mlp_and_moe_cuts(tiny, family):
    whole = Checkpoint(tiny)
    cases = {  # name -> dim: rank r holds the r-th half along it
        "backbone.layers.2.mixer.q_proj.weight": 0, "backbone.layers.2.mixer.k_proj.weight": 0,
        "backbone.layers.2.mixer.v_proj.weight": 0, "backbone.layers.2.mixer.o_proj.weight": 1,
        "backbone.layers.4.mixer.up_proj.weight": 0, "backbone.layers.4.mixer.down_proj.weight": 1,
        "backbone.layers.1.mixer.experts.5.up_proj.weight": 0, "backbone.layers.1.mixer.experts.5.down_proj.weight": 1,
        "backbone.layers.1.mixer.shared_experts.up_proj.weight": 0,
        "backbone.layers.1.mixer.shared_experts.down_proj.weight": 1}
    for name, dim in cases.items():
        for rank in range(2):
            assert torch.equal(sliced(tiny, family, rank, name), whole.tensor(name).chunk(2, dim)[rank]), name
    for name in ("backbone.layers.1.mixer.gate.weight", "backbone.layers.1.mixer.gate.e_score_correction_bias",
                 "backbone.embeddings.weight", "backbone.layers.3.norm.weight", "backbone.norm_f.weight",
                 "lm_head.weight"):
        assert torch.equal(sliced(tiny, family, 1, name), whole.tensor(name)), name


def test_a_rank_model_and_layout(tiny, family):
    checkpoint = Checkpoint(tiny)
    model, layout = load_rank(family, checkpoint, torch.bfloat16, torch.device("cpu"), Shard(1, 2))
    c = model.config
    assert (c.heads, c.kv_heads, c.mamba_heads, c.n_groups) == (2, 1, 2, 1)
    assert (c.intermediate_size, c.moe_intermediate_size, c.shared_intermediate_size, c.experts) == (64, 16, 32, 8)
    mamba, moe = model.weights.layers[0].mixer, model.weights.layers[1].mixer
    assert isinstance(mamba, MambaWeights) and isinstance(moe, MoeWeights)
    assert mamba.in_proj.shape == (2 * 32 + 2 * 16 + 2, 64) and mamba.conv.shape == (32 + 2 * 16, K)
    assert moe.up.shape == (8, 16, 64) and moe.down.shape == (8, 64, 16)
    assert moe.router.dtype == torch.float32 and moe.router.shape == (8, 64) and moe.up.dtype == torch.bfloat16
    fixed = {s.name: s.shape for s in layout.layers[0].fixed}
    assert fixed == {"conv": (32 + 2 * 16, K - 1), "ssm": (2, P, N)}
    assert [s.shape for s in layout.layers[2].rows] == [(1, 16), (1, 16)]
    whole = family.declare(checkpoint.config, torch.bfloat16).layout
    assert layout.fixed_bytes * 2 == whole.fixed_bytes and layout.bytes_per_token * 2 == whole.bytes_per_token


def test_the_stacked_expert_form_gives_each_rank_the_same_experts(tiny, family, tmp_path):
    """HF's in-memory form (experts stacked [NE, FE, W] and [NE, W, FE], `model.*` names) is read whole and cut to
    the rank's columns: the same weights as the per-expert form's column and row cuts."""
    weights = load_file(tiny / "model.safetensors")
    held = {name.replace("backbone.", "model.", 1): t for name, t in weights.items() if ".experts." not in name}
    for part in ("up_proj", "down_proj"):
        held[f"model.layers.1.mixer.experts.{part}"] = torch.stack(
            [weights[f"backbone.layers.1.mixer.experts.{e}.{part}.weight"] for e in range(8)])
    for path in tiny.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(held, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for rank in range(2):
        published, _ = load_rank(family, Checkpoint(tiny), torch.float32, torch.device("cpu"), Shard(rank, 2))
        stacked, _ = load_rank(family, Checkpoint(tmp_path), torch.float32, torch.device("cpu"), Shard(rank, 2))
        a, b = published.weights.layers[1].mixer, stacked.weights.layers[1].mixer
        assert torch.equal(a.up, b.up) and torch.equal(a.down, b.down) and a.up.shape == (8, 16, 64)


# ---------------------------------------------------------------- refusals

def test_refusals_name_what_does_not_divide(tiny, family):
    config = Checkpoint(tiny).config
    assert family.tp_refusals(config, 2) == []
    assert [line.split(": ", 1)[1] for line in family.tp_refusals(config, 4)] == [
        "--tensor-parallel-size 4 does not divide the Mamba2 B/C groups (n_groups), 2",
        "--tensor-parallel-size 4 does not divide the KV heads (num_key_value_heads), 2"]
    assert len(family.tp_refusals(config, 3)) == 7          # every count: heads, groups, KV heads, every column
    assert family.tp_refusals(config, 4)[0].startswith("family 'nemotron' (plugin tensorfold_nemotron.plugin)")
    # Nemotron-3-Nano-30B-A3B's 2 KV heads stop it above TP=2; Nemotron-H-8B divides at 8
    assert [line.split(": ", 1)[1] for line in family.tp_refusals(SHAPES["nemotron_h-30b-a3b"], 4)] == [
        "--tensor-parallel-size 4 does not divide the KV heads (num_key_value_heads), 2"]
    assert family.tp_refusals(SHAPES["nemotron_h-30b-a3b"], 2) == []
    assert family.tp_refusals(SHAPES["nemotron_h-8b"], 8) == []
    experts = {**plugin.TINY_CONFIG, "moe_intermediate_size": 30, "moe_shared_expert_intermediate_size": 62}
    assert [line.split(": ", 1)[1] for line in family.tp_refusals(experts, 4)][-2:] == [
        "--tensor-parallel-size 4 does not divide the expert columns (moe_intermediate_size), 30",
        "--tensor-parallel-size 4 does not divide the shared expert columns "
        "(moe_shared_expert_intermediate_size), 62"]
    with pytest.raises(PluginError, match="family_load raised ValueError: .* does not divide num_key_value_heads 2"):
        family.load(Checkpoint(tiny), torch.float32, torch.device("cpu"), Shard(0, 4))
