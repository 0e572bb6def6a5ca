"""How many device ops one GDN layer of the batched step (the GPU path) issues, one MoE feed-forward, one decode
attention layer and a whole MoE decode step on the Triton path, counted on the CPU.

The count is a proxy for the GPU's kernel launches, not a measure of them: aten ops that compute (views and bare
allocations are not counted), each one launch on CUDA, plus one per call of a kernel entry point from
tensorfold.kernels (one Triton launch on CUDA; the chunked delta rule is several there, fla's), whose insides are
not counted (on the CPU they are the naive forms). It pins the step's glue: a change that adds a launch to a layer
moves a count here. The MoE's count goes one level down: its kernel entry points run their Triton launchers, each
Triton kernel counted as one launch and run as a stub, so the glue inside the entry points (the experts' alignment)
is counted too. The whole step's count stubs every Triton kernel of core's and Qwen's (testing.launches.triton_kernels).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest
import torch

from tensorfold.kernels.paged_write import row_ids
from tensorfold.plan import DecodeBatch, StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold.testing.launches import KernelStub, Launches, counting_triton, triton_kernels
from tensorfold_qwen import attention_inputs as fused_inputs
from tensorfold_qwen import batched, decode, load, mlp, plugin
from tensorfold_qwen.fused import can_fold, fuse_moe
from tensorfold_qwen.gdn import GdnWeights

# the kernel entry points each module calls: one launch each on CUDA (their insides are not counted)
KERNELS: dict[ModuleType, tuple[str, ...]] = {
    batched: ("rms_norm", "gated_rms_norm", "causal_conv1d_prefill", "chunk_gated_delta", "paged_prefill_varlen",
              "row_ids", "write_rows"),
    decode: ("rms_norm", "gated_rms_norm", "causal_conv1d_update", "recurrent_gated_delta_step_gated",
             "paged_decode", "decode_rows", "write_rows", "apply_rope", "silu_mul", "sigmoid_mul"),
    mlp: ("routed_experts",),
}


def opaque(mode: Launches, name: str, kernel: Callable) -> Callable:
    """`kernel` counted as one launch, its own ops not counted."""

    def counted(*args, **kwargs):
        mode.ops[f"kernel:{name}"] += 1
        with mode.uncounted():
            return kernel(*args, **kwargs)

    return counted


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Launches]:
    mode = Launches()
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, opaque(mode, name, getattr(module, name)))
    with torch.no_grad(), mode:
        yield mode


@pytest.fixture(scope="module")
def subject(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen-launches")
    plugin.write_tiny(directory, seed=2)
    return kit.load(load_families(["qwen"])["qwen"], directory, dtype=torch.bfloat16)


def gdn_layer_ops(subject, monkeypatch, shares: list[tuple[int, int, int]]) -> Counter[str]:
    """The ops of layer 0 (GDN) of the batched step over `shares` (slot, start, rows), streams at start 0 new."""
    model, store = subject.model, subject.store(4, 160, page_rows=16)
    assert isinstance(model.weights.layers[0].mixer, GdnWeights)
    plan = StepPlan(tuple(StreamStep(slot, start, tuple(range(3, 3 + length))) for slot, start, length in shares))
    rows = batched.flatten(plan, model.device)
    fresh = [rows.slots[i] for i, start in enumerate(rows.starts) if start == 0]
    x = model.weights.embed[rows.tokens]
    h = batched.rms_norm(x, model.weights.layers[0].input_norm, model.config.rms_norm_eps, zero_centred=True)
    with counting(monkeypatch) as mode:
        batched.layer_step(model, 0, h, x, rows, store, fresh)
    return mode.ops


# what every bf16 GDN layer over prefill rows issues: in_proj, out_proj and the dense MLP's three GEMMs; the gate
# (a + dt_bias, softplus, · decay; sigmoid(b), to float32); the states gathered by slot and scattered back. q and k
# go to the chunked op as the conv wrote them (it normalises them and reads them by value head itself): no op here
PREFILL = Counter({"mm": 5, "_to_copy": 1, "mul": 1, "add": 1, "softplus": 1, "sigmoid": 1, "index_select": 1,
                   "index_copy_": 1})


def test_a_gdn_layer_over_one_prefilling_stream(subject, monkeypatch):
    """One new stream's chunk: the layer's rows go to the mixer as they are; its norms carry the residual adds."""
    ops = gdn_layer_ops(subject, monkeypatch, [(0, 0, 40)])
    assert ops == PREFILL + Counter({
        "zero_": 2,                                         # the new stream's conv tail and state
        "kernel:causal_conv1d_prefill": 1, "kernel:chunk_gated_delta": 1, "kernel:gated_rms_norm": 1,
        "kernel:rms_norm": 2,                               # post-mixer norm + add; next layer's input norm + add
        "kernel:silu_mul": 1,
    })


def test_a_gdn_layer_over_prefill_chunks_and_a_decode_row(subject, monkeypatch):
    """Two chunks (one new stream) and one decode row: the chunks' rows gathered and scattered, one conv each into
    one buffer; the decode row through the decode step's kernels."""
    ops = gdn_layer_ops(subject, monkeypatch, [(0, 0, 40), (2, 9, 1), (1, 20, 7)])
    assert ops == PREFILL + Counter({
        "zero_": 2,
        "index": 2, "index_put_": 2,                        # the decode row's and the chunks' rows, in and out
        "mm": 2,                                            # the decode row's in_proj and out_proj
        "kernel:causal_conv1d_update": 1, "kernel:recurrent_gated_delta_step_gated": 1,
        "kernel:gated_rms_norm": 2,                         # the decode row's, the chunks'
        "kernel:causal_conv1d_prefill": 2, "kernel:chunk_gated_delta": 1,
        "kernel:rms_norm": 2, "kernel:silu_mul": 1,
    })


# ---- a MoE layer's feed-forward on the Triton path ----------------------------------------------------------

def route_stand_in(logits, gate, weights, chosen, N, *args, K, SHARED, **meta) -> None:
    """The routing kernel's pairs from its torch twin: the grouping after it indexes by them."""
    from tensorfold.kernels.moe import routing

    pairs = routing.naive(logits[:, :N], K, gate if SHARED else None)
    weights.copy_(pairs[0])
    chosen.copy_(pairs[1])


def parts_stand_in(x, weight, parts, M, N, *args, **meta) -> None:
    """The GEMV's partial sums: the whole product in the first split, zeros in the rest."""
    parts.zero_()
    parts[0].copy_(torch.nn.functional.linear(x[:M], weight).float())


def route_parts_stand_in(parts, weights, chosen, N, *args, K, SHARED, **meta) -> None:
    """The router's pairs from its summed partial sums by the routing kernel's torch twin."""
    from tensorfold.kernels.moe import routing

    logits = parts.sum(0).to(weights.dtype)
    pairs = routing.naive(logits[:, :N], K, logits[:, N:N + 1] if SHARED else None)
    weights.copy_(pairs[0])
    chosen.copy_(pairs[1])


@contextmanager
def counting_moe(monkeypatch: pytest.MonkeyPatch) -> Iterator[Launches]:
    """The Triton path forced on CPU tensors, every Triton kernel a stub, aten ops counted."""
    import tensorfold.kernels.moe as moe_package
    import tensorfold.kernels.silu_gate as gate_package
    from tensorfold.kernels.linear_norm import triton_linear_norm
    from tensorfold.kernels.moe import routing, triton_moe, triton_router, triton_routing
    from tensorfold.kernels.silu_gate import triton_gate

    kernels = {triton_moe: ("_gate_up_kernel", "_down_kernel", "_sum_kernel"), triton_routing: ("_route_kernel",),
               triton_linear_norm: ("_parts_kernel",), triton_router: ("_route_parts_kernel",),
               triton_gate: ("_silu_mul_kernel", "_sigmoid_mul_kernel")}
    effects = {"_route_kernel": route_stand_in, "_parts_kernel": parts_stand_in,
               "_route_parts_kernel": route_parts_stand_in}
    with counting_triton(monkeypatch, kernels, (mlp, moe_package, routing, gate_package), effects) as mode:
        yield mode


def moe_layer(shared_f: int, top_k: int) -> mlp.MoeWeights:
    """A bf16 MoE layer (E 64, 16 experts of F 32) in the fused layout the loader builds on a Triton device."""
    g = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()

    w = mlp.MoeWeights(router=draw(16, 64), gate_up=draw(16, 64, 64), down=draw(16, 64, 32),
                       shared=mlp.MlpWeights(draw(shared_f, 64), draw(shared_f, 64), draw(64, shared_f)),
                       shared_gate=draw(1, 64), top_k=top_k)
    return fuse_moe(w, fold=can_fold(w.shared, w.down))


def moe_ffn_ops(monkeypatch, shared_f: int, top_k: int, T: int, kind: str) -> Counter[str]:
    """The ops of one MoE feed-forward (moe_routed) over T rows, after a first call (a decode step's graph is
    captured after warm-up calls; the one-block-per-pair row map is made once per shape and kept)."""
    w = moe_layer(shared_f, top_k)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with monkeypatch.context() as mp, counting_moe(mp):
        mlp.moe_routed(w, x, kind)
    with monkeypatch.context() as mp, counting_moe(mp) as mode:
        mlp.moe_routed(w, x, kind)
    return mode.ops


# the grouped experts' three kernels
EXPERTS = Counter({"triton:_gate_up_kernel": 1, "triton:_down_kernel": 1, "triton:_sum_kernel": 1})
# one GEMM over x (router and shared gate), the routing kernel, the experts
FOLDED = EXPERTS + Counter({"mm": 1, "triton:_route_kernel": 1})


@pytest.mark.parametrize("T", [1, 8])
def test_a_decode_moe_ffn_is_five_launches_of_ours(monkeypatch, T):
    """The shared expert folded in (shared F == F): the router's GEMV and routing (no library GEMM) and the
    experts' three, up to 8 streams at k = 8 (72 pairs with the shared expert's, one block each: the alignment issues
    no op)."""
    assert moe_ffn_ops(monkeypatch, shared_f=32, top_k=8, T=T, kind="decode") == EXPERTS + Counter(
        {"triton:_parts_kernel": 1, "triton:_route_parts_kernel": 1})


def test_a_decode_moe_ffn_with_the_shared_expert_apart(monkeypatch):
    """shared F != F: its gate and up come from the one GEMM; silu·up, its down GEMM, the gate and the sum."""
    assert moe_ffn_ops(monkeypatch, shared_f=48, top_k=8, T=1, kind="decode") == FOLDED + Counter({
        "triton:_silu_mul_kernel": 1, "mm": 1, "triton:_sigmoid_mul_kernel": 1, "add": 1})


def test_a_prefill_moe_ffn_groups_its_pairs_on_the_device(monkeypatch):
    """Prefill rows are grouped by expert with device ops (sort, searchsorted, scatter: docs/kernels.md), the rest
    as in decode; the per-row sort and range check are gone (the routing kernel's pairs come ordered)."""
    ops = moe_ffn_ops(monkeypatch, shared_f=32, top_k=4, T=40, kind="prefill")
    assert ops == FOLDED + Counter({
        "sort": 1, "searchsorted": 2, "arange": 3, "index": 2, "sub": 4, "add": 2, "mul": 2, "floor_divide": 1,
        "cumsum": 1, "clamp": 1, "lt": 1, "where": 1, "scalar_tensor": 1, "full": 1, "scatter_": 1, "_to_copy": 2})


def test_a_prefill_moe_ffn_ending_in_the_next_norm_is_one_launch_fewer(monkeypatch):
    """A step of prefill chunks alone ends a folded MoE layer in the next layer's norm (batched.layer_step): the
    experts' sum, the residual add and the norm in one launch, where the ffn and the norm apart take two."""
    import tensorfold.kernels.rmsnorm as norm_package
    from tensorfold.kernels.moe import triton_sum_norm
    from tensorfold.kernels.rmsnorm import rms_norm, triton_rmsnorm

    w = moe_layer(shared_f=32, top_k=4)
    x, residual = (torch.randn(40, 64, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (1, 2))
    norm = torch.zeros(64, dtype=torch.bfloat16)
    sum_norm = {triton_sum_norm: ("_sum_norm_kernel",), triton_rmsnorm: ("_rms_norm_kernel",)}

    def ops(joined: bool) -> Counter[str]:
        with monkeypatch.context() as mp, counting_moe(mp) as mode:
            for module, names in sum_norm.items():
                for name in names:
                    mp.setattr(module, name, KernelStub(mode, name))
            mp.setattr(norm_package, "use_triton", lambda tensor: True)
            if joined:
                assert mlp.moe_then_norm(w, x, residual, norm, 1e-6, kind="prefill") is not None
            else:
                rms_norm(mlp.moe_routed(w, x, "prefill"), norm, 1e-6, zero_centred=True, residual=residual)
        return mode.ops

    apart, joined = ops(joined=False), ops(joined=True)
    assert apart["triton:_sum_kernel"] == 1 and apart["triton:_rms_norm_kernel"] == 1
    assert joined == apart - Counter({"triton:_sum_kernel": 1, "triton:_rms_norm_kernel": 1}) + Counter(
        {"triton:_sum_norm_kernel": 1})


# ---- a decode step's gated attention on the Triton path ---------------------------------------------------------

@pytest.mark.parametrize("gate_in_attention", [True, False], ids=["gated-in-combine", "sigmoid_mul-apart"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_a_decode_attention_layer_reads_its_gate_in_place(subject, monkeypatch, wide, gate_in_attention):
    """The gate halves stay in the projection's columns (the paged decode's combine, or sigmoid_mul, reads them
    strided): one GEMM (linear_norm's one-launch GEMV where the projection is wide enough), the fused inputs launch,
    the paged decode with the gate (or the gate apart), no copy of the gate."""
    model, store = subject.model, subject.store(2, 64, page_rows=16)
    index = decode._first_attention(model.weights)
    h = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    positions = torch.tensor([5, 9])
    tables = store.tables([0, 1])
    dest = row_ids(tables, positions, torch.tensor([True, True]), 16)
    lengths = (positions + 1).to(torch.int32)
    monkeypatch.setattr(decode, "use_triton", lambda tensor: True)
    monkeypatch.setattr(decode, "one_launch", lambda x, weight: wide)       # switched on, and wide enough
    monkeypatch.setattr(decode, "INPUT_GEMV", wide)
    monkeypatch.setattr(decode, "GATE_IN_ATTENTION", gate_in_attention)
    with counting(monkeypatch) as mode:
        monkeypatch.setattr(decode, "linear", opaque(mode, "linear", decode.linear))
        monkeypatch.setattr(fused_inputs, "attention_inputs",
                            opaque(mode, "attention_inputs", fused_inputs.attention_inputs))
        out = decode.attention_heads(model.weights.layers[index].mixer, model.config, h, positions, tables, dest,
                                     lengths, index, store, model.inv_freq)
    c = model.config
    assert out.shape == (2, c.heads * c.head_dim)
    projection = {"kernel:linear": 1} if wide else {"mm": 1}
    gating = {} if gate_in_attention else {"kernel:sigmoid_mul": 1}
    assert mode.ops == Counter({**projection, "kernel:attention_inputs": 1, "kernel:paged_decode": 1, **gating})


# ---- a whole decode step of a MoE model on the Triton path -----------------------------------------------------

@pytest.fixture(scope="module")
def moe_subject(tmp_path_factory):
    """The tiny MoE model (shared expert as wide as the experts, as 35B-A3B's), loaded in the Triton path's layout."""
    directory = tmp_path_factory.mktemp("qwen-moe-launches")
    plugin.write_tiny(directory, seed=2, folded=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(load, "use_triton", lambda tensor: True)
        return kit.load(load_families(["qwen"])["qwen"], directory, dtype=torch.bfloat16)


def decode_step_ops(subject, monkeypatch, B: int) -> Counter[str]:
    """The ops of one decode step of B streams (after a first step: what a CUDA graph captures), every Triton
    kernel of core's kernels and Qwen's a stub (the routing launches write their twin's pairs)."""
    import tensorfold.kernels
    import tensorfold.kernels.gated_delta as gated_delta

    kernels = triton_kernels(tensorfold.kernels, fused_inputs)
    users = tuple(m for name, m in list(sys.modules.items())
                  if name.startswith(("tensorfold.kernels", "tensorfold_qwen")) and "use_triton" in vars(m))
    monkeypatch.setattr(gated_delta, "pick_step", lambda device, fla_available: "triton")
    effects = {"_route_kernel": route_stand_in, "_route_parts_kernel": route_parts_stand_in,
               "_parts_kernel": lambda x, weight, parts, *args, **meta: parts.zero_()}
    store = subject.store(B, 64, page_rows=16)
    batch = DecodeBatch(tokens=torch.arange(3, 3 + B), positions=torch.arange(5, 5 + B), slots=torch.arange(B),
                        tables=store.tables(list(range(B))))
    for _ in range(2):       # the first step makes what later steps keep (the experts' row map)
        with monkeypatch.context() as mp, counting_triton(mp, kernels, users, effects) as mode:
            decode.decode(subject.model, batch, store)
    return mode.ops


@pytest.mark.parametrize("B", [1, 8])
def test_a_moe_decode_step_is_eleven_launches_a_layer(moe_subject, monkeypatch, B):
    """Every layer: the mixer's input GEMM and its three launches (GDN: conv, delta step, gated norm; attention:
    inputs, the decode's splits and combine), the output projection with the residual add and the norm (two), the
    router (two) and the experts (three, their sum carrying the next norm); around them the step's rows and key
    counts (one launch), the embedding, the first norm, the head and its float32 cast. The tiny shape's GDN input
    rows (200 columns) do not vectorise by head, so above one row its gate heads are copied to rows for the gated
    norm (gated_rms_norm); the real shapes' (multiples of 16 columns) are read in place."""
    layers = moe_subject.model.weights.layers
    L = len(layers)
    gdn = sum(isinstance(layer.mixer, GdnWeights) for layer in layers)
    assert layers[0].mixer.in_proj.shape[0] % 16
    ops = decode_step_ops(moe_subject, monkeypatch, B)
    assert ops == Counter({
        "clone": gdn if B > 1 else 0,
        "triton:_rows_kernel": 1, "index": 1, "triton:_rms_norm_kernel": 1, "mm": L + 1, "_to_copy": 1,
        "triton:_update_kernel": gdn, "triton:_step_kernel": gdn, "triton:_gated_rms_norm_kernel": gdn,
        "triton:_inputs_kernel": L - gdn, "triton:_split_kernel": L - gdn, "triton:_combine_kernel": L - gdn,
        "triton:_parts_kernel": 2 * L, "triton:_parts_norm_kernel": L, "triton:_route_parts_kernel": L,
        "triton:_gate_up_kernel": L, "triton:_down_kernel": L, "triton:_sum_norm_kernel": L})
    assert ops.total() == 11 * L + 5 + (gdn if B > 1 else 0)
