"""The GLM-5.3-Flash GPU benchmark: our engine's forward and HF transformers (glm5_next, 5.24 or later) on the same
random weights, in one process, against the machine's measured limits.

The shape is GLM-5.3-Flash's widths (hidden 4096; KDA 64 heads x 128; MLA 64 heads, q_lora 1536, kv_lora 512,
qk/v head 256; DSA 32 index heads x 128, kpool 16, top-2048; experts of 2048, top-8 + 1 shared; mHC 4 streams)
with fewer layers and experts so that both models fit one GPU: `--layers` (default 8: L L L I L L L I, the first
three dense) and `--experts` (default 64 of 288). Prints one JSON line per measurement (bench/gpu.py's format):
    model      parameters, weight bytes a batch-1 decode step reads, Layout bytes
    check      our bf16 logits against HF's on one prompt (max |Δ|, argmax agreement)
    decode     tok/s at each --batches (the engine's decode runner when GLM has its tensor-only decode, else its
               forward; `path` says which), HF at batch 1; ours at batch 1 against the HBM limit
    prefill    tok/s and MFU at each length, ours and HF

    python bench/glm_gpu.py --out $OUT                       (from bench/)
    python bench/glm_gpu.py --device cpu --small --prefill 256 --prompt 64 --steps 2     (a smoke run)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gpu  # bench/gpu.py: this script runs from bench/ on sys.path
import torch
from gpu import TensorsCheckpoint, emit, hardware, our_prefill, our_store, sync, timed

from tensorfold.engine.graphs import has_decode
from tensorfold.kernels import pdl
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold_glm.plugin import draw

TINY_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
               "projection_intermediate_size": 64}


SMALL = {"hidden_size": 256, "vocab_size": 1024, "linear_num_heads": 4, "linear_head_dim": 32,
         "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
         "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 4,
         "index_head_dim": 32, "index_topk": 64, "moe_intermediate_size": 64, "intermediate_size": 256}


def hf_glm(layers: int, experts: int, dtype: torch.dtype, small: bool = False):
    """HF's Glm5NextForConditionalGeneration with random weights (redrawn) on the device, its config and text
    config."""
    import transformers

    text = transformers.Glm5NextTextConfig(num_hidden_layers=layers, n_routed_experts=experts, pad_token_id=0,
                                           **(SMALL if small else {}))
    config = transformers.Glm5NextConfig(text_config=text.to_dict(), vision_config=TINY_VISION)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(gpu.DEVICE):
            hf = transformers.Glm5NextForConditionalGeneration(config).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)
    redraw(hf)
    return hf, config, text


def build(layers: int, experts: int, dtype: torch.dtype, small: bool = False):
    """HF's Glm5NextForConditionalGeneration with random weights on the device, and ours on the same tensors."""
    hf, config, text = hf_glm(layers, experts, dtype, small)
    family = load_families(["glm"])["glm"]
    config_dict = config.to_dict()
    state = {name: tensor for name, tensor in hf.state_dict().items() if ".visual." not in name}
    ours = family.load(TensorsCheckpoint(config_dict, state), dtype, torch.device(gpu.DEVICE))
    layout = family.declare(config_dict, dtype).layout
    return hf, ours, layout, text


@torch.no_grad()
def redraw(hf) -> None:
    """Every text tensor drawn again with the family's test rule (N(0, 1/fan_in) matrices, ...), on the device:
    HF's own init leaves the logits nearly flat, so a logits check on it says little."""
    generator = torch.Generator(device=gpu.DEVICE).manual_seed(0)
    with torch.device(gpu.DEVICE):
        for name, tensor in sorted(hf.state_dict().items()):
            if ".visual." not in name and tensor.is_floating_point():
                tensor.copy_(draw(name, tensor.shape, generator))


def active_params(hf, text) -> tuple[int, int]:
    """(all text parameters, those a token uses: without the embedding table and the experts it does not choose)."""
    named = [(name, p) for name, p in hf.named_parameters() if ".visual." not in name]
    total = sum(p.numel() for _, p in named)
    embed = hf.get_input_embeddings().weight.numel()
    routed = sum(p.numel() for name, p in named if ".experts." in name)
    unused = routed * (text.n_routed_experts - text.num_experts_per_tok) // text.n_routed_experts
    return total, total - embed - unused


def attention_flops(text, rows: int) -> float:
    """QKᵀ and PV of every MLA layer over the keys each query selects: min(position + 1, index_topk) each (the
    selected pools' tokens plus the tail, whole pools counted), 2·H·(DQK + DV) per key."""
    per_key = 2 * text.num_attention_heads * (text.qk_nope_head_dim + text.v_head_dim)
    keys = sum(min(p + 1, text.index_topk) for p in range(rows))
    mla = sum(1 for kind in text.layer_types if kind != "linear_attention")
    return mla * per_key * keys


def our_decode(ours, layout, batch: int, prompt: int, steps: int, chunk: int) -> float:
    """Seconds per decode step of `batch` streams after a `prompt`-row prefill each, as the engine runs it: the
    decode runner (CUDA graphs on the GPU) when the model has a tensor-only decode, else its forward (gpu.py)."""
    return gpu.our_decode(ours, layout, batch, prompt, steps, chunk, graphs=gpu.DEVICE == "cuda")


def hf_decode(hf, vocab: int, batch: int, prompt: int, steps: int) -> float:
    """Seconds per decode step of `batch` streams of HF with its cache, after a `prompt`-row prefill each."""
    ids = torch.randint(0, vocab, (batch, prompt), device=gpu.DEVICE)
    out = hf(ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "past_key_values", None) or out.cache
    token = out.logits[:, -1:].argmax(-1)
    token = hf(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    sync()

    def run() -> None:
        nonlocal token
        for _ in range(steps):
            token = hf(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

    return timed(run, repeats=1) / steps


def hf_prefill(hf, vocab: int, rows: int) -> float:
    ids = torch.randint(0, vocab, (1, rows), device=gpu.DEVICE)
    return timed(lambda: hf(ids, use_cache=True, logits_to_keep=1), repeats=2)


def check(hf, ours, layout, rows: int) -> dict[str, object]:
    """Both models' bf16 logits for one prompt's last `rows` positions."""
    tokens = torch.randint(3, ours.vocab_size, (rows,)).tolist()
    store = our_store(layout, 1, rows + 1)
    mine = ours.forward_all(StepPlan((StreamStep(0, 0, tokens),)), store)
    theirs = hf(torch.tensor([tokens], device=gpu.DEVICE)).logits[0].float()
    return {"rows": rows, "max_abs_diff": round((mine - theirs).abs().max().item(), 4),
            "logit_std": round(theirs.std().item(), 4),
            "argmax_agree": round((mine.argmax(-1) == theirs.argmax(-1)).float().mean().item(), 4),
            "median_row_max_diff": round((mine - theirs).abs().amax(-1).median().item(), 6),
            "rows_off": int(((mine - theirs).abs().amax(-1) > 1e-2 * theirs.std()).sum())}


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add the options every GLM bench takes (depth, experts, --out, --device), parse, then set the device and the
    seed, so the benches build the same model from the same flags."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--pdl", default="on", choices=("on", "off"),
                        help="programmatic dependent launch for our kernels (kernels/pdl.py)")
    args = parser.parse_args()
    pdl.ENABLED = args.pdl == "on"
    gpu.DEVICE = args.device
    torch.manual_seed(0)
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description="GPU benchmark: our GLM-5.3-Flash vs HF at the real widths")
    parser.add_argument("--prefill", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[1], help="decode streams (ours and HF at each)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--chunk", type=int, nargs="+", default=[2048],
                        help="prefill chunk rows: our prefill at each (decode prompts at the first)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny widths: a CPU smoke run of this script")
    args = parse_args(parser)
    bandwidth, peak = hardware(args.out)
    hf, ours, layout, text = build(args.layers, args.experts, torch.bfloat16, args.small)
    shape = f"glm5_next-{args.layers}l-{args.experts}e"
    total, active = active_params(hf, text)
    read = 2 * (active + hf.get_input_embeddings().weight.numel() // text.vocab_size)
    emit(args.out, jsonl="glm.jsonl", bench="model", shape=shape, schedule=ours.config.schedule,
         mlp=ours.config.mlp_schedule, params=total, active_params=active, decode_weight_bytes_read=read,
         layout_bytes_per_token=layout.bytes_per_token, layout_fixed_bytes=layout.fixed_bytes)
    with torch.inference_mode():
        if not args.no_hf:
            emit(args.out, jsonl="glm.jsonl", bench="check", shape=shape, **check(hf, ours, layout, 256))
        path = "decode runner" if has_decode(ours) else "forward"
        for batch in args.batches:
            ours_s = our_decode(ours, layout, batch, args.prompt, args.steps, args.chunk[0])
            record = {"bench": "decode", "shape": shape, "batch": batch, "prompt": args.prompt, "path": path,
                      "ours_tok_s": round(batch / ours_s, 1), "step_ms": round(ours_s * 1e3, 3)}
            if batch == 1:
                moved = read + 2 * layout.fixed_bytes + layout.bytes_per_token * args.prompt
                record["hbm_limit_fraction"] = round(moved / bandwidth / ours_s, 3)
            hf_s = None if args.no_hf else hf_decode(hf, text.vocab_size, batch, args.prompt, args.steps)
            if hf_s is not None:
                record |= {"hf_tok_s": round(batch / hf_s, 1), "speedup": round(hf_s / ours_s, 2)}
            emit(args.out, jsonl="glm.jsonl", **record)
        for rows in args.prefill:
            hf_s = None if args.no_hf else hf_prefill(hf, text.vocab_size, rows)
            flops = 2 * active * rows + attention_flops(text, rows)
            for chunk in args.chunk:
                ours_s = our_prefill(ours, layout, rows, chunk)
                record = {"bench": "prefill", "shape": shape, "rows": rows, "chunk": chunk,
                          "ours_tok_s": round(rows / ours_s, 1), "ours_mfu": round(flops / ours_s / peak, 3)}
                if hf_s is not None:
                    record |= {"hf_tok_s": round(rows / hf_s, 1), "hf_mfu": round(flops / hf_s / peak, 3),
                               "speedup": round(hf_s / ours_s, 2)}
                emit(args.out, jsonl="glm.jsonl", **record)
    peak_bytes = torch.cuda.max_memory_allocated() if gpu.DEVICE == "cuda" else None
    emit(args.out, jsonl="glm.jsonl", bench="memory", shape=shape, peak_gpu_bytes=peak_bytes)


if __name__ == "__main__":
    main()
