"""How far each bf16 GLM-5.3-Flash — ours and HF transformers' — lands from the float32 model, at the real widths.

A bf16 model differs from another bf16 implementation by more than either differs from float32 rounding alone
when their rounding points differ (where casts sit, which kernels run), so the check that says something is each
against float32: HF fp32 vs ours fp32 (equal up to float32 rounding), and ours bf16 and HF bf16 each against
HF fp32. Same random weights (the family's N(0, 1/fan_in) rule) for all four. One JSON line per pair:
max and median per-row max |Δlogit|, argmax agreement.

    python bench/glm_check.py --out $OUT                          (from bench/)
    python bench/glm_check.py --device cpu --layers 4 --experts 8 --vocab 4096   (a CPU run)
"""

from __future__ import annotations

import argparse
import gc

import glm_gpu  # bench/glm_gpu.py
import gpu
import torch
from gpu import TensorsCheckpoint, emit, our_store

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families


def compare(a: torch.Tensor, b: torch.Tensor, scale: float) -> dict[str, float]:
    rows = (a - b).abs().amax(-1)
    return {"max_abs_diff": round(rows.max().item(), 6), "median_row_max_diff": round(rows.median().item(), 6),
            "relative_to_logit_std": round(rows.median().item() / scale, 5),
            "argmax_agree": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4)}


def ours_logits(hf, config: dict, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    family = load_families(["glm"])["glm"]
    state = {name: tensor for name, tensor in hf.state_dict().items() if ".visual." not in name}
    ours = family.load(TensorsCheckpoint(config, state), dtype, torch.device(gpu.DEVICE))
    store = our_store(family.declare(config, dtype).layout, 1, len(tokens) + 1)
    logits = ours.forward_all(StepPlan((StreamStep(0, 0, tuple(tokens)),)), store).float().cpu()
    del ours, store
    return logits


def main() -> None:
    import transformers
    parser = argparse.ArgumentParser(description="GLM bf16 vs fp32: ours and HF's, on the same weights")
    parser.add_argument("--vocab", type=int, default=None, help="default: the real vocabulary")
    parser.add_argument("--rows", type=int, default=256)
    args = glm_gpu.parse_args(parser)
    extra = {} if args.vocab is None else {"vocab_size": args.vocab}
    text = transformers.Glm5NextTextConfig(num_hidden_layers=args.layers, n_routed_experts=args.experts,
                                           pad_token_id=0, **extra)
    config = transformers.Glm5NextConfig(text_config=text.to_dict(), vision_config=glm_gpu.TINY_VISION)
    with torch.device(gpu.DEVICE):
        hf = transformers.Glm5NextForConditionalGeneration(config).float().eval()
    glm_gpu.redraw(hf)
    tokens = torch.randint(3, text.vocab_size, (args.rows,)).tolist()
    ids = torch.tensor([tokens], device=gpu.DEVICE)
    shape = f"glm5_next-{args.layers}l-{args.experts}e"
    with torch.inference_mode():
        hf32 = hf(ids).logits[0].float().cpu()
        ours32 = ours_logits(hf, config.to_dict(), torch.float32, tokens)
        scale = hf32.std().item()
        record = dict(jsonl="glm-check.jsonl", bench="glm_check", shape=shape, rows=args.rows,
                      logit_std=round(scale, 4))
        emit(args.out, pair="ours_fp32_vs_hf_fp32", **record, **compare(ours32, hf32, scale))
        hf.to(torch.bfloat16)
        gc.collect()
        hf16 = hf(ids).logits[0].float().cpu()
        ours16 = ours_logits(hf, config.to_dict(), torch.bfloat16, tokens)
    for name, a, b in (("ours_bf16_vs_hf_fp32", ours16, hf32), ("hf_bf16_vs_hf_fp32", hf16, hf32),
                       ("ours_bf16_vs_hf_bf16", ours16, hf16)):
        emit(args.out, pair=name, **record, **compare(a, b, scale))


if __name__ == "__main__":
    main()
