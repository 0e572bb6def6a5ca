"""The GPU benchmark: our engine's forward and HF transformers on the same random weights at real shapes, in one
process, against the machine's measured limits (copy bandwidth, bf16 GEMM peak).

Prints one JSON line per measurement (and appends them to --out/gpu.jsonl):
    hardware   copy GB/s, bf16 TFLOP/s
    decode     tok/s at each batch, ours and HF; batch 1 as a fraction of the HBM limit
    decode_<switch>_ab  (--pdl, --linear-norm, --fused-router, --input-gemv, --gate-in-attention ab:
                        SWITCHES) our decode at each batch with the switch on and off
    prefill    tok/s and MFU at each length, ours and HF
    memory     peak GPU bytes; KV/state bytes per token against the Layout's figure

    python bench/gpu.py --shape qwen3_5-9b --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tensorfold.engine.graphs import DecodeRunner, has_decode
from tensorfold.kernels import linear_norm, pdl
from tensorfold.kernels.moe import routing
from tensorfold.kv import PagedStore
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold_qwen import decode as qwen_decode

DEVICE = "cuda"

SHAPES = {
    # name: (family, HF config class, HF model class, overrides)
    "qwen3_5-9b": ("qwen", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5-moe-35b": ("qwen", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {}),
    "qwen3_5-tiny": ("qwen", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                     {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "head_dim": 32, "intermediate_size": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                      "linear_key_head_dim": 32, "linear_value_head_dim": 32, "vocab_size": 1024}),
    "qwen3_5-moe-tiny": ("qwen", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
                          "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                          "vocab_size": 1024, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "shared_expert_intermediate_size": 64}),
}
try:  # Nemotron-H's real shapes, as its family states them (tensorfold_nemotron/shapes.py), when it is installed
    from tensorfold_nemotron.shapes import SHAPES as NEMOTRON

    SHAPES |= {name: ("nemotron", "NemotronHConfig", "NemotronHForCausalLM",
                      {k: v for k, v in config.items() if k not in ("model_type", "architectures")})
               for name, config in NEMOTRON.items()}
    SHAPES["nemotron_h-tiny"] = ("nemotron", "NemotronHConfig", "NemotronHForCausalLM", {
        **SHAPES["nemotron_h-30b-a3b"][3], "hidden_size": 128, "hybrid_override_pattern": "MEM*E-",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "intermediate_size": 256, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 128,
        "vocab_size": 1024})
except ImportError:
    pass


class TensorsCheckpoint:
    """The loader's view of a checkpoint, over tensors already in memory (HF's state dict), so both engines
    share one set of weights without writing 18 GB to disk."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], consume: bool = False) -> None:
        self.config = config
        self._tensors = tensors
        self._consume = consume       # tensors() hands each tensor over, so the loader may free what it copies

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def tensors(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        if not self._consume:
            yield from self._tensors.items()
            return
        for name in list(self._tensors):
            yield name, self._tensors.pop(name)


def emit(out: Path | None, jsonl: str = "gpu.jsonl", **record: object) -> None:
    """Print one measurement as a JSON line, and append it to out/jsonl."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with open(out / jsonl, "a") as handle:
            handle.write(line + "\n")


def on_cuda() -> bool:
    """Whether DEVICE is a CUDA device ("cuda", or "cuda:N" for one rank of a tensor-parallel world)."""
    return torch.device(DEVICE).type == "cuda"


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 3) -> float:
    """Best wall time of `fn` over repeats, synchronised."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def hardware(out: Path | None) -> tuple[float, float]:
    """Measured device-to-device copy bandwidth (bytes read + written per second) and bf16 GEMM FLOP/s."""
    size = 2 * 2**30 if DEVICE == "cuda" else 2**26
    src = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeats=10)
    bandwidth = 2 * src.numel() / seconds
    n = 8192 if DEVICE == "cuda" else 1024
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    seconds = timed(lambda: a @ b, repeats=10)
    flops = 2 * n**3 / seconds
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    emit(out, bench="hardware", device=name, copy_gb_s=round(bandwidth / 1e9, 1),
         bf16_tflops=round(flops / 1e12, 1))
    return bandwidth, flops


def hf_model(shape: str, dtype: torch.dtype):
    """HF's model of `shape` with random weights (HF's own init) on DEVICE, and its config."""
    import transformers

    _, config_class, model_class, overrides = SHAPES[shape]
    config = getattr(transformers, config_class)(**overrides)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)                      # built in the target dtype: a 35B model has no room twice
    try:
        with torch.device(DEVICE):
            hf = getattr(transformers, model_class)(config).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)
    return hf, config


def load_ours(shape: str, config, tensors: dict[str, torch.Tensor], dtype: torch.dtype, consume: bool = False):
    """Our model of `shape` from tensors in HF's names, and its Layout (consume: TensorsCheckpoint's)."""
    family = load_families([SHAPES[shape][0]])[SHAPES[shape][0]]
    config_dict = config.to_dict()
    ours = family.load(TensorsCheckpoint(config_dict, tensors, consume), dtype, torch.device(DEVICE))
    return ours, family.declare(config_dict, dtype).layout


def build(shape: str, dtype: torch.dtype):
    """HF's model with random weights on the GPU, and ours loaded from the same tensors."""
    hf, config = hf_model(shape, dtype)
    ours, layout = load_ours(shape, config, dict(hf.state_dict()), dtype)
    params = sum(p.numel() for p in hf.parameters())
    return hf, ours, layout, params, config


def ours_in_place_of(hf, config, shape: str, dtype: torch.dtype):
    """Ours loaded from HF's tensors with HF's model dropped first: a loader that copies the experts (the fused MoE
    layout) frees each original as it goes, so a 35B model is held about once, not twice."""
    import gc

    state = dict(hf.state_dict())
    hf.to("meta")                                        # the model's own references go; `state` holds the tensors
    gc.collect()
    ours, layout = load_ours(shape, config, state, dtype, consume=True)
    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()
    return ours, layout


def our_store(layout, streams: int, rows: int, page_rows: int = 256) -> PagedStore:
    per = -(-rows // page_rows)
    store = PagedStore(layout, streams, streams * per, page_rows, DEVICE)
    for slot in range(streams):
        store.bind(slot, list(range(slot * per, (slot + 1) * per)))
    return store


# A/B switches: a flag each (on, off or ab), the module constant it sets, its values on and off, what it changes.
SWITCHES = {
    "pdl": (pdl, "ENABLED", True, False, "programmatic dependent launch for our kernels (kernels/pdl.py)"),
    "linear_norm": (linear_norm, "ENABLED", True, False, "the decode step's few-row projections as a Triton GEMV, the "
                    "output projection fused with the residual add and the norm (kernels/linear_norm)"),
    "fused_router": (routing, "FUSED_ROUTER", True, False, "a decode step's MoE router as our GEMV and routing "
                     "launches, not a library GEMV (kernels/moe/triton_router)"),
    "input_gemv": (qwen_decode, "INPUT_GEMV", True, False, "Qwen's decode input projections (in_proj, qkv) as the "
                   "one-launch GEMV of kernels/linear_norm, not a library GEMV"),
    "gate_in_attention": (qwen_decode, "GATE_IN_ATTENTION", True, False, "Qwen's decode attention output gated in "
                          "paged decode's combine launch, not a sigmoid_mul launch apart"),
}


def switch_ab(args: argparse.Namespace, name: str, decode_s, batch: int) -> None:
    """The decode timed with the switch off, on, off, on (graphs captured anew each time, the switch left as it
    was); each side's best as one decode_<name>_ab line."""
    module, attribute, on_value, off_value, _ = SWITCHES[name]
    shipped = getattr(module, attribute)
    times: dict[bool, list[float]] = {True: [], False: []}
    for on in (False, True, False, True):
        setattr(module, attribute, on_value if on else off_value)
        times[on].append(decode_s())
    setattr(module, attribute, shipped)
    best = {side: min(times[on]) for side, on in (("on", True), ("off", False))}
    emit(args.out, bench=f"decode_{name}_ab", shape=args.shape, batch=batch,
         **{f"{side}_tok_s": round(batch / s, 1) for side, s in best.items()},
         **{f"{side}_step_ms": round(s * 1e3, 3) for side, s in best.items()})


def our_decode(ours, layout, batch: int, prompt: int, steps: int, chunk: int, graphs: bool) -> float:
    """Seconds per decode step for `batch` streams after a `prompt`-row prefill each, through the engine's decode
    runner (CUDA graph replay, or the same decode eagerly)."""
    context = prompt + 2 * steps + 2
    store = our_store(layout, batch, context)
    tokens = torch.randint(0, ours.vocab_size, (batch, prompt)).tolist()
    for slot in range(batch):
        for a in range(0, prompt, chunk):
            ours.forward(StepPlan((StreamStep(slot, a, tokens[slot][a: a + chunk]),)), store)
    if has_decode(ours):
        runner = DecodeRunner(ours, store, (batch,), context, graphs=graphs)
        runner.capture()
    else:  # a family without a tensor-only decode: its forward, eagerly, as the engine would run it
        runner = ours
    position = [prompt]

    def step() -> None:  # each stream feeds its own tokens, so a MoE routes them as it routes a real batch's
        at = position[0]
        plan = StepPlan(tuple(StreamStep(s, at, (tokens[s][at % prompt],)) for s in range(batch)))
        runner.forward(plan, store)
        position[0] += 1

    step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def bytes_per_step(hf, config, batch: int = 1) -> int:
    """Weight bytes one decode step of `batch` streams reads: every parameter but the embedding table (one row a
    stream is read) and, in a MoE, the experts no row chooses: with each row's k of N chosen at random (random
    weights route so), an expert is left out with probability (1 - k/N)^batch."""
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    embed = hf.get_input_embeddings().weight
    if embed.data_ptr() != hf.get_output_embeddings().weight.data_ptr():
        total -= embed.numel() * embed.element_size()
    experts = getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0)
    if experts:
        expert_bytes = sum(p.numel() * p.element_size() for name, p in hf.named_parameters() if ".experts." in name)
        total -= round(expert_bytes * (1 - config.num_experts_per_tok / experts) ** batch)
    return total


def step_bytes(weights_read: int, layout, batch: int, context: int) -> int:
    """Bytes a decode step of `batch` streams at `context` rows must move at least: the weights it reads
    (bytes_per_step), each stream's fixed state read and written, and its kv rows read."""
    return weights_read + batch * (layout.fixed_bytes * 2 + layout.bytes_per_token * context)


def hf_decode(hf, batch: int, prompt: int, steps: int) -> float:
    ids = torch.randint(0, hf.config.vocab_size, (batch, prompt), device=DEVICE)
    out = hf(ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "past_key_values", None) or out.cache
    token = out.logits[:, -1:].argmax(-1)
    token = hf(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        token = hf(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    sync()
    return (time.perf_counter() - start) / steps


def our_prefill(ours, layout, rows: int, chunk: int) -> float:
    tokens = torch.randint(0, ours.vocab_size, (rows,)).tolist()

    def run() -> None:
        store = our_store(layout, 1, rows + 1)
        for a in range(0, rows, chunk):
            ours.forward(StepPlan((StreamStep(0, a, tokens[a: a + chunk], sample=a + chunk >= rows),)), store)

    return timed(run, repeats=2)


def hf_prefill(hf, rows: int) -> float:
    ids = torch.randint(0, hf.config.vocab_size, (1, rows), device=DEVICE)
    return timed(lambda: hf(ids, use_cache=True, logits_to_keep=1), repeats=2)


def prefill_flops(active_params: int, config, rows: int) -> float:
    """Model FLOPs of a `rows`-token prefill from position 0: 2 per active weight per token (embedding table out,
    unchosen experts out) plus causal attention, 2·H·D·rows² per attention layer (QKᵀ and PV, half the square
    each); the GDN recurrence is left out, so MFU errs low."""
    attention_layers = sum(1 for kind in config.layer_types if kind == "full_attention")
    heads, head_dim = config.num_attention_heads, config.head_dim
    return 2 * active_params * rows + attention_layers * 2 * heads * head_dim * rows * rows


def main() -> None:
    parser = argparse.ArgumentParser(description="GPU benchmark: ours vs HF at real shapes")
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prefill", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--chunk", type=int, nargs="+", default=[2048],
                        help="prefill chunk rows: our prefill at each (decode prompts at the first)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager (graphs off) decode measurement")
    parser.add_argument("--device", default="cuda")
    for name, (*_, what) in SWITCHES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", default="shipped", choices=("shipped", "on", "off", "ab"),
                            help=f"{what}; shipped: as the tree sets it; ab: each decode batch also timed off, on, "
                                 f"off, on in this process (a decode_{name}_ab line)")
    args = parser.parse_args()
    for name, (module, attribute, on_value, off_value, _) in SWITCHES.items():
        if getattr(args, name) in ("on", "off"):
            setattr(module, attribute, on_value if getattr(args, name) == "on" else off_value)
    global DEVICE
    DEVICE = args.device
    torch.manual_seed(0)
    bandwidth, peak = hardware(args.out)
    hf, config = hf_model(args.shape, torch.bfloat16)
    params = sum(p.numel() for p in hf.parameters())
    weights = params * 2
    read = bytes_per_step(hf, config)
    reads = {batch: bytes_per_step(hf, config, batch) for batch in args.batches}   # before ours takes hf's tensors
    hf_decode_s: dict[int, float] = {}
    hf_prefill_s: dict[int, float] = {}
    with torch.inference_mode():                       # HF first: ours then takes its tensors (ours_in_place_of)
        if not args.no_hf:
            hf_decode_s = {batch: hf_decode(hf, batch, args.prompt, args.steps) for batch in args.batches}
            hf_prefill_s = {rows: hf_prefill(hf, rows) for rows in args.prefill}
    ours, layout = ours_in_place_of(hf, config, args.shape, torch.bfloat16)
    del hf
    emit(args.out, bench="model", shape=args.shape, params=params, weights_bytes=weights,
         decode_weight_bytes_read=read, layout_bytes_per_token=layout.bytes_per_token,
         layout_fixed_bytes=layout.fixed_bytes)
    with torch.inference_mode():
        for batch in args.batches:
            ours_s = our_decode(ours, layout, batch, args.prompt, args.steps, args.chunk[0], graphs=True)
            eager_s = None if args.no_eager else our_decode(ours, layout, batch, args.prompt, args.steps,
                                                            args.chunk[0], graphs=False)
            hf_s = hf_decode_s.get(batch)
            record = {"bench": "decode", "shape": args.shape, "batch": batch, "ours_tok_s": round(batch / ours_s, 1),
                      "ours_eager_tok_s": None if eager_s is None else round(batch / eager_s, 1),
                      "hf_tok_s": None if hf_s is None else round(batch / hf_s, 1)}
            if hf_s is not None:
                record["speedup"] = round(hf_s / ours_s, 2)
            moved = step_bytes(reads[batch], layout, batch, args.prompt)
            record |= {"hbm_limit_fraction": round(moved / bandwidth / ours_s, 3), "step_ms": round(ours_s * 1e3, 3),
                       "limit_ms": round(moved / bandwidth * 1e3, 3)}
            emit(args.out, **record)
            for name in SWITCHES:
                if getattr(args, name) == "ab":
                    switch_ab(args, name, functools.partial(
                        our_decode, ours, layout, batch, args.prompt, args.steps, args.chunk[0], graphs=True), batch)
        for rows in args.prefill:
            hf_s = hf_prefill_s.get(rows)
            flops = prefill_flops(read // 2, config, rows)
            for chunk in args.chunk:
                ours_s = our_prefill(ours, layout, rows, chunk)
                record = {"bench": "prefill", "shape": args.shape, "rows": rows, "chunk": chunk,
                          "ours_tok_s": round(rows / ours_s, 1), "ours_mfu": round(flops / ours_s / peak, 3)}
                if hf_s is not None:
                    record |= {"hf_tok_s": round(rows / hf_s, 1), "hf_mfu": round(flops / hf_s / peak, 3),
                               "speedup": round(hf_s / ours_s, 2)}
                emit(args.out, **record)
    store = our_store(layout, 1, 4096)
    measured = store.page_bytes / store.page_rows
    peak_bytes = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else None
    emit(args.out, bench="memory", shape=args.shape, peak_gpu_bytes=peak_bytes,
         kv_bytes_per_token_measured=measured, kv_bytes_per_token_layout=layout.bytes_per_token,
         fixed_bytes_per_stream=store.fixed_nbytes)


if __name__ == "__main__":
    main()
