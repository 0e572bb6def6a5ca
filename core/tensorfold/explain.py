"""Plans made without serving: `tensorfold explain` and `tensorfold families`."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from tensorfold.boot import checkpoint_of, host_cache_bytes, memory_plan, resolve_dtype
from tensorfold.checkpoint import Checkpoint
from tensorfold.family import Family, PluginError
from tensorfold.follow.rank import rank_checkpoint, rank_device, rank_layout
from tensorfold.memory_plan import page_bytes
from tensorfold.plugins import load_families
from tensorfold.refusals import Refusal
from tensorfold.settings import Settings
from tensorfold.shard import Shard
from tensorfold.startup_checks import all_refusals, resolve_device

MIB = 2**20


def serving_plan(settings: Settings, family: Family) -> dict[str, Any]:
    """What `serve` would hold: weights, bytes per token by layer kind, fixed bytes per stream, refusals; at
    --tensor-parallel-size N, each of them one rank's (its Layout, its slices of the weights)."""
    checkpoint = checkpoint_of(settings, family, require_weights=False)
    refusals = all_refusals(settings, family, checkpoint)
    world = settings.tensor_parallel
    device = rank_device(resolve_device(settings.device), 0)
    dtype = resolve_dtype(settings.dtype, device) if settings.dtype in ("auto", "float32", "bfloat16",
                                                                          "float16") else torch.float32
    layout, reader = family.declare(checkpoint.config, dtype).layout, checkpoint
    if world > 1 and not family.tp_refusals(checkpoint.config, world):
        try:
            layout = rank_layout(family, checkpoint, dtype, world)
            reader = rank_checkpoint(family, checkpoint, Shard(0, world))
        except PluginError as err:
            refusals.append(Refusal(family.name, str(err)))
    per_rank = reader is not checkpoint
    page_rows = settings.page_rows if settings.switch("TF_KV_PAGES") else settings.context
    memory, memory_refusals = memory_plan(settings, layout, reader, device, dtype)
    refusals += [Refusal("core", m) for m in memory_refusals]
    return {
        "family": family.name, "checkpoint": str(checkpoint.directory), "model_type": checkpoint.model_type,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "context": settings.context,
        "tensor_parallel": world, "per_rank": per_rank,
        "weights_bytes": reader.weight_bytes(dtype) if checkpoint.shards() else None,
        "bytes_per_token": layout.bytes_per_token, "fixed_bytes_per_stream": layout.fixed_bytes,
        "page_rows": page_rows, "page_bytes": page_bytes(layout, page_rows),
        "by_kind": layout.by_kind(), "stream_bytes_at_context": layout.stream_bytes(settings.context),
        "memory": memory.describe() if memory is not None else None,
        "host_cache_bytes": max(0, host_cache_bytes(settings)),
        "refusals": [f"[{r.source}] {r.message}" for r in refusals],
    }


def _weights_line(size: int | None) -> str:
    if size is None:
        return "weights            (no weight files: the plan is made from config.json alone)"
    return f"weights            {size / MIB:10.2f} MiB"


def plan_text(plan: dict[str, Any]) -> str:
    """The plan for a person to read; at TP above 1, a rank's numbers (every rank holds the same)."""
    lines = [f"family {plan['family']} · {plan['model_type']} · {plan['checkpoint']}",
             f"device {plan['device']} · dtype {plan['dtype']} · context {plan['context']} tokens"]
    if plan["per_rank"]:
        lines.append(f"tensor parallel    {plan['tensor_parallel']} ranks · every number below is one rank's")
    lines += [_weights_line(plan["weights_bytes"]),
              f"per token          {plan['bytes_per_token']:10.0f} B",
              f"per page           {plan['page_bytes']:10d} B ({plan['page_rows']} rows)",
              f"fixed per stream   {plan['fixed_bytes_per_stream'] / MIB:10.2f} MiB",
              f"one stream at full context {plan['stream_bytes_at_context'] / MIB:10.2f} MiB"]
    if plan["memory"] is not None:
        m = plan["memory"]
        lines.append(f"KV budget          {m['budget_bytes'] / MIB:10.2f} MiB → {m['parallel']} streams, "
                     f"{m['pages']} pages of {m['page_rows']} rows ({m['page_bytes'] / MIB:.2f} MiB each), "
                     f"{m['kv_bytes'] / MIB:.2f} MiB held")
    host = plan["host_cache_bytes"]
    lines.append(f"host tier          {host / MIB:10.2f} MiB of kept prompt states" if host else
                 "host tier          off")
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
