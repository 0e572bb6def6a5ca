"""How many device ops one GDN layer of the batched step (the GPU path) issues, counted on the CPU.

The count is a proxy for the GPU's kernel launches, not a measure of them: aten ops that compute (views and bare
allocations are not counted), each one launch on CUDA, plus one per call of a kernel entry point from
tensorfold.kernels (one Triton launch on CUDA; the chunked delta rule is several there, fla's), whose insides are
not counted (on the CPU they are the naive forms). It pins the step's glue: a change that adds a launch to a layer
moves a count here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_qwen import batched, decode, mlp, plugin
from tensorfold_qwen.gdn import GdnWeights

# the kernel entry points each module calls: one launch each on CUDA (their insides are not counted)
KERNELS: dict[ModuleType, tuple[str, ...]] = {
    batched: ("rms_norm", "gated_rms_norm", "causal_conv1d_prefill", "chunk_gated_delta", "paged_prefill_varlen",
              "row_ids", "write_rows"),
    decode: ("rms_norm", "gated_rms_norm", "causal_conv1d_update", "recurrent_gated_delta_step_gated",
             "paged_decode", "row_ids", "write_rows", "apply_rope", "silu_mul", "sigmoid_mul"),
    mlp: ("routed_experts",),
}
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "_unsafe_view"}   # allocations and metadata only


class Launches(TorchDispatchMode):
    """Counts the aten ops that compute, by name, and kernel entry calls as "kernel:<name>"."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and not func.is_view and name not in FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def opaque(self, name: str, kernel: Callable) -> Callable:
        """`kernel` counted as one launch, its own ops not counted."""

        def counted(*args, **kwargs):
            self.ops[f"kernel:{name}"] += 1
            self.inside += 1
            try:
                return kernel(*args, **kwargs)
            finally:
                self.inside -= 1

        return counted


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Launches]:
    mode = Launches()
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, mode.opaque(name, getattr(module, name)))
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


# what every bf16 GDN layer over prefill rows issues: in_proj, out_proj and the dense MLP's three GEMMs; q and k
# repeated to the value heads (a copy each), to float32, normalised (x·x, sum, + eps, rsqrt, ·), q scaled, both
# back to bf16; the gate (a + dt_bias, softplus, · decay; sigmoid(b), to float32); the states gathered by slot
# and scattered back
PREFILL = Counter({"mm": 5, "clone": 2, "_to_copy": 5, "mul": 6, "sum": 2, "add": 3, "rsqrt": 2, "softplus": 1,
                   "sigmoid": 1, "index_select": 1, "index_copy_": 1})


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
