"""Plans made without serving: `tensorfold explain` and `tensorfold families`."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from tensorfold.boot import all_refusals, checkpoint_of, resolve_device, resolve_dtype
from tensorfold.checkpoint import Checkpoint
from tensorfold.family import Family
from tensorfold.plugins import load_families
from tensorfold.settings import Settings

MIB = 2**20


def weight_bytes(checkpoint: Checkpoint, dtype: torch.dtype) -> int:
    """Bytes of the checkpoint's floating-point weights once cast to `dtype` (others as stored)."""
    from safetensors import safe_open

    total = 0
    for shard in checkpoint.shards():
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                count = 1
                for n in piece.get_shape():
                    count *= n
                stored = piece.get_dtype()
                size = dtype.itemsize if stored in ("F32", "F16", "BF16") else _itemsize(stored)
                total += count * size
    return total


def _itemsize(stored: str) -> int:
    return {"F64": 8, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}.get(stored, 1)


def serving_plan(settings: Settings, family: Family) -> dict[str, Any]:
    """What `serve` would hold: weights, bytes per token by layer kind, fixed bytes per stream, refusals."""
    checkpoint = checkpoint_of(settings, family, require_weights=False)
    refusals = all_refusals(settings, family, checkpoint)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device) if settings.dtype in ("auto", "float32", "bfloat16",
                                                                          "float16") else torch.float32
    layout = family.declare(checkpoint.config, dtype).layout
    return {
        "family": family.name, "checkpoint": str(checkpoint.directory), "model_type": checkpoint.model_type,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "context": settings.context,
        "weights_bytes": weight_bytes(checkpoint, dtype) if checkpoint.shards() else None,
        "bytes_per_token": layout.bytes_per_token, "fixed_bytes_per_stream": layout.fixed_bytes,
        "by_kind": layout.by_kind(), "stream_bytes_at_context": layout.stream_bytes(settings.context),
        "refusals": [f"[{r.source}] {r.message}" for r in refusals],
    }


def _weights_line(size: int | None) -> str:
    if size is None:
        return "weights            (no weight files: the plan is made from config.json alone)"
    return f"weights            {size / MIB:10.2f} MiB"


def plan_text(plan: dict[str, Any]) -> str:
    """The plan for a person to read."""
    lines = [f"family {plan['family']} · {plan['model_type']} · {plan['checkpoint']}",
             f"device {plan['device']} · dtype {plan['dtype']} · context {plan['context']} tokens",
             _weights_line(plan["weights_bytes"]),
             f"per token          {plan['bytes_per_token']:10.0f} B",
             f"fixed per stream   {plan['fixed_bytes_per_stream'] / MIB:10.2f} MiB",
             f"one stream at full context {plan['stream_bytes_at_context'] / MIB:10.2f} MiB"]
    for kind, entry in plan["by_kind"].items():
        lines.append(f"  {kind:<16} {entry['layers']:3d} layers · {entry['bytes_per_token']:8.0f} B/token · "
                     f"{entry['fixed_bytes'] / MIB:8.2f} MiB fixed")
    lines += [f"refused: {r}" for r in plan["refusals"]] or ["no refusals"]
    return "\n".join(lines)


def describe_families() -> list[dict[str, Any]]:
    """Every installed family with its declarations, made on the family's own tiny checkpoint."""
    out = []
    for family in load_families().values():
        with tempfile.TemporaryDirectory() as tmp:
            family.make_tiny(Path(tmp), seed=0)
            out.append(family.describe(Checkpoint(tmp).config, torch.bfloat16))
    return out
