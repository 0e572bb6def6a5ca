"""The batched step's launch savings change no bit: its forward against the step it replaced, written out here as
the reference (every residual add its own op, each mixer gathering its prefill rows and scattering them back, the
conv outputs concatenated, the GDN gate's per-layer factors computed in the step, the gated norm reading a copy of
z, each attention layer building the step's page tables and key rows anew, a MoE layer's sum and the next norm
apart), compared bit for bit: logits, every fixed state and every key/value page.

On CUDA (gpu) with the real kernels; on the CPU with the Triton kernels these savings touch (rmsnorm, the causal
conv) run in triton's interpreter, the rest naive. The tiny model here has 8 value heads, so the gated norm's z (a
head view of the input projection) meets the in-place read's alignment and the test takes that path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tensorfold.kernels.causal_conv1d import causal_conv1d_prefill
from tensorfold.kernels.gated_delta import chunk_gated_delta
from tensorfold.kernels.rmsnorm import gated_rms_norm, rms_norm
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights
from tensorfold_qwen import batched, decode, plugin
from tensorfold_qwen import load as loader
from tensorfold_qwen.config import FULL, QwenConfig
from tensorfold_qwen.gdn import GdnWeights

CONV, RECURRENT, KEYS, VALUES = "conv", "recurrent", "k", "v"
STEPS = [  # per step: (slot, start, length) shares
    [(0, 0, 40), (1, 0, 7)],                               # prefill only: rows handed over as they are
    [(0, 40, 1), (1, 7, 64), (2, 0, 1)],
    [(0, 41, 1), (1, 71, 1), (2, 1, 30)],
    [(3, 0, 65)],                                          # one stream: one conv, no concatenation
    [(3, 65, 1), (0, 42, 1)],
    [(0, 43, 20), (3, 66, 1), (1, 72, 9), (2, 31, 33)],
]


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 500 + 3 for i in range(n))


# ---- the reference: the step as it was -------------------------------------------------------------------------

def unfused_forward(model, plan: StepPlan, kv) -> torch.Tensor:
    c, w = model.config, model.weights
    rows = batched.flatten(plan, model.device)
    fresh = [rows.slots[i] for i, start in enumerate(rows.starts) if start == 0]
    x = w.embed[rows.tokens]
    for index, layer in enumerate(w.layers):
        h = rms_norm(x, layer.input_norm, c.rms_norm_eps, zero_centred=True)
        if isinstance(layer.mixer, GdnWeights):
            for slot in fresh:
                kv.fixed(index, CONV, slot).zero_()
                kv.fixed(index, RECURRENT, slot).zero_()
            mixed = unfused_gdn(layer.mixer, c, h, rows, index, kv)
        else:
            mixed = unfused_attention(layer.mixer, c, h, rows, index, kv, model.inv_freq)
        x = x + model.shard.reduce(mixed)
        h = rms_norm(x, layer.post_norm, c.rms_norm_eps, zero_centred=True)
        x = x + model.shard.reduce(batched.ffn(layer.ffn, h, rows))
    last = x[rows.sampled_rows]
    return F.linear(rms_norm(last, w.norm, c.rms_norm_eps, zero_centred=True), w.lm_head).float()


def unfused_gdn(w, c, h, rows, index, kv):
    out = torch.empty_like(h)
    if rows.single:
        out[rows.single_rows] = decode.gdn(w, c, h[rows.single_rows], rows.single_slots, index, kv)
    if rows.longer:
        out[rows.longer_rows] = unfused_gdn_chunks(w, c, h[rows.longer_rows], rows, index, kv)
    return out


def unfused_gdn_chunks(w, c, h, rows, index, kv):
    T, C, Z, NV = h.shape[0], 2 * c.k_heads * c.k_dim + c.v_heads * c.v_dim, c.v_heads * c.v_dim, c.v_heads
    proj = F.linear(h, w.in_proj)
    bounds = rows.packed
    mixed = torch.cat([causal_conv1d_prefill(proj[a:b, :C], w.conv, kv.fixed(index, CONV, rows.slots[i]))
                       for i, a, b in zip(rows.longer, bounds[:-1], bounds[1:], strict=True)])
    q, k, v = mixed.split([c.k_heads * c.k_dim, c.k_heads * c.k_dim, Z], dim=-1)
    a, b = proj[:, C + Z + NV:], proj[:, C + Z: C + Z + NV]
    g = -w.A_log.float().exp() * F.softplus(a.float() + w.dt_bias.float())
    beta = torch.sigmoid(b).float()
    states = kv.fixed_states(index, RECURRENT)
    out, final = chunk_gated_delta(q.reshape(T, c.k_heads, c.k_dim), k.reshape(T, c.k_heads, c.k_dim),
                                   v.reshape(T, NV, c.v_dim), g, beta,
                                   states.index_select(0, rows.longer_slots), cu_seqlens=bounds,
                                   starts=[rows.starts[i] for i in rows.longer], scale=c.k_dim ** -0.5,
                                   qk_l2norm=True, backend="naive" if h.dtype == torch.float32 else None)
    states.index_copy_(0, rows.longer_slots, final)
    out = gated_rms_norm(out.to(h.dtype), proj[:, C: C + Z].reshape(T, NV, c.v_dim), w.norm, c.rms_norm_eps)
    return F.linear(out.reshape(T, Z), w.out_proj)


def unfused_attention(w, c, h, rows, index, kv, inv_freq):
    out = torch.empty_like(h)
    tables = kv.tables(list(rows.slots))
    page_rows = kv.row_pages(index, KEYS).shape[1]
    if rows.single:
        r = rows.single_rows
        picked = tables[rows.single_index]
        positions = rows.positions[r]
        live = torch.ones_like(positions, dtype=torch.bool)
        out[r] = decode.attention(w, c, h[r], positions, picked, batched.row_ids(picked, positions, live, page_rows),
                                  (positions + 1).int(), index, kv, inv_freq)
    if rows.longer:
        r = rows.longer_rows
        positions, longer = rows.positions[r], tables[rows.longer_index]
        dest = batched.row_ids(longer[rows.longer_of_row], positions, torch.ones_like(positions, dtype=torch.bool),
                               page_rows)
        out[r] = batched.attention_chunks(w, c, h[r], positions, longer, rows, index, kv, inv_freq, dest)
    return out


# ---- the comparison --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels(request):
    """Where the Triton kernels run: the GPU, or triton's interpreter on the CPU (the rmsnorm and conv packages
    routed to their Triton forms; the kernels must not have been imported for the compiler before)."""
    if request.param == "cuda":
        yield torch.device("cuda")
        return
    if torch.cuda.is_available():                           # importing triton interpreted would hold for the run
        pytest.skip("with CUDA the compiled kernels are compared (the cuda case)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")                  # before triton is first imported, if it is here
        tl = pytest.importorskip("triton.language")
        from triton.runtime.interpreter import InterpretedFunction

        import tensorfold.kernels.causal_conv1d as conv_package
        import tensorfold.kernels.rmsnorm as norm_package
        from tensorfold.kernels import triton_rounding
        from tensorfold.kernels.causal_conv1d import triton_conv
        from tensorfold.kernels.rmsnorm import triton_rmsnorm
        jitted = (tl.sum, triton_rounding.round_to, triton_conv._prefill_kernel, triton_rmsnorm._rms_norm_kernel,
                  triton_rmsnorm._gated_rms_norm_kernel)
        if not all(isinstance(kernel, InterpretedFunction) for kernel in jitted):
            pytest.skip("triton was imported for the compiler before this test (run it in its own process)")
        for package in (conv_package, norm_package):
            mp.setattr(package, "use_triton", lambda tensor: True)
        yield torch.device("cpu")


def write_checkpoint(directory, moe: str) -> None:
    """The tiny checkpoint with 8 value heads: z's token stride (C + Z + 2·NV = 336) a multiple of 16. "folded": the
    shared expert as wide as the experts (35B-A3B's), so on the GPU it is folded into the grouped experts and a
    step of prefill chunks alone ends each MoE layer in the next norm (mlp.moe_then_norm)."""
    changes = {**plugin.TINY_CONFIG, **(plugin.TINY_MOE_CHANGES if moe != "dense" else {}),
               "linear_num_value_heads": 8}
    if moe == "folded":
        changes["shared_expert_intermediate_size"] = plugin.TINY_MOE_CHANGES["moe_intermediate_size"]
    config = write_tiny_config(directory, changes)
    write_tiny_weights(directory, loader.expected_shapes(QwenConfig.from_dict(config)), plugin.draw, seed=3)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as integers (NaN-poisoned pages compare as what they hold)."""
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.triton
@pytest.mark.parametrize("kernels", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])],
    indirect=True)
@pytest.mark.parametrize("moe", ["dense", "moe", "folded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_batched_step_is_the_unfused_step_bit_for_bit(kernels, moe, dtype, tmp_path, monkeypatch):
    from tensorfold.kernels.rmsnorm import triton_rmsnorm

    write_checkpoint(tmp_path, moe)
    subject = kit.load(load_families(["qwen"])["qwen"], tmp_path, dtype=dtype, device=kernels.type)
    ours, reference = (subject.store(4, 160, page_rows=16) for _ in range(2))
    taken, in_place = [], triton_rmsnorm._by_head

    def recorded(z: torch.Tensor) -> bool:
        taken.append(in_place(z))
        return taken[-1]

    for shares in STEPS:
        plan = StepPlan(tuple(StreamStep(slot, start, tokens(start + length, slot)[start:])
                              for slot, start, length in shares))
        with monkeypatch.context() as mp:
            mp.setattr(triton_rmsnorm, "_by_head", recorded)
            got = batched.batched_forward(subject.model, plan, ours)
        with monkeypatch.context() as mp:
            mp.setattr(triton_rmsnorm, "_by_head", lambda z: False)             # the old launcher: z copied
            expected = unfused_forward(subject.model, plan, reference)
        assert torch.equal(bits(got), bits(expected)), shares
    assert any(taken)                                                           # z was read in place
    for layer, kind in enumerate(subject.model.config.layer_types):
        if kind == FULL:
            pairs = [(ours.row_pages(layer, name), reference.row_pages(layer, name)) for name in (KEYS, VALUES)]
        else:
            pairs = [(ours.fixed_states(layer, name), reference.fixed_states(layer, name))
                     for name in (CONV, RECURRENT)]
        for mine, theirs in pairs:
            assert torch.equal(bits(mine), bits(theirs)), layer
