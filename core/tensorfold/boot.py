"""Startup: settings → family → checkpoint → refusals (all at once) → model, memory, engine."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from tensorfold.checkpoint import Checkpoint, CheckpointError
from tensorfold.embedded import embedded_checkpoint
from tensorfold.engine.api import Sampling
from tensorfold.engine.grammar import Grammars
from tensorfold.engine.graphs import DecodeRunner, batch_sizes, has_decode
from tensorfold.engine.runner import Engine
from tensorfold.engine.stats import EngineStats
from tensorfold.engine.warmup import warm_forward
from tensorfold.family import Declarations, Family, FamilyModel, PluginError
from tensorfold.follow.rank import load_rank, rank_checkpoint, rank_device, rank_layout
from tensorfold.follow.spawn import Ranks
from tensorfold.kv import PagedStore, WindowStore
from tensorfold.layout import Layout
from tensorfold.memory import StreamMemory
from tensorfold.memory_plan import (
    GIB,
    HOST_CACHE_SHARE,
    MEMINFO,
    MemoryPlan,
    default_budget,
    default_host_cache,
    plan_memory,
    size,
)
from tensorfold.plugins import INSTALL_HINT, installed_names, load_families
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.refusals import Refusal, Refused, raise_if_any
from tensorfold.service import Service
from tensorfold.settings import Settings
from tensorfold.shard import Shard
from tensorfold.startup_checks import DTYPES, all_refusals, layout_refusals, resolve_device
from tensorfold.tiers.device import DeviceTier
from tensorfold.tiers.disk import DISK_RESERVE_BYTES, IN_HAND_S, DiskTier
from tensorfold.tiers.host import HostTier
from tensorfold.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)
PREFILL_PROBE_ROWS = 2048   # the timed chunk the payoff rule's prefill rate comes from (at most)
BANDWIDTH_BYTES = 32 << 20  # the scratch file the store's read bandwidth is measured on


def pick_family(name: str | None, model: Path | None = None) -> Family:
    """The family `--family` names; without it the only one installed, or the one that serves the checkpoint's
    `model_type` (PluginError when none or several do)."""
    if name is not None:
        return load_families([name])[name]
    names = installed_names()
    if len(names) == 1:
        return load_families(names)[names[0]]
    if not names:
        raise PluginError(f"no family is installed: {INSTALL_HINT}")
    model_type = checkpoint_model_type(model)
    if model_type is None:
        raise PluginError(f"--family is needed: installed families are {', '.join(names)}")
    found = load_families(names)
    serving = [family.name for family in found.values() if model_type in family.model_types]
    if len(serving) == 1:
        return found[serving[0]]
    if not serving:
        served = "; ".join(f"{f.name}: {', '.join(f.model_types)}" for f in found.values())
        raise PluginError(f"no installed family serves model_type {model_type!r} (installed: {served}); "
                          f"give --family to try one anyway, or {INSTALL_HINT}")
    raise PluginError(f"--family is needed: model_type {model_type!r} is served by {', '.join(serving)}")


def checkpoint_model_type(model: Path | None) -> str | None:
    """The checkpoint's `model_type` (Checkpoint reads it), None when there is none to read."""
    if model is None:
        return None
    try:
        return Checkpoint(Path(model).expanduser(), require_weights=False).model_type
    except (CheckpointError, OSError, ValueError):
        return None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on the CPU and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[dtype]


def generation_defaults(generation: Mapping[str, Any], tokenizer: ChatTokenizer) -> Sampling:
    """Sampling defaults from generation_config.json, as vLLM applies them."""
    temperature = float(generation.get("temperature", 1.0)) if generation.get("do_sample", True) else 0.0
    return Sampling(temperature=temperature, top_p=float(generation.get("top_p", 1.0)),
                    top_k=int(generation.get("top_k", 0) or 0), min_p=float(generation.get("min_p", 0.0) or 0.0),
                    max_tokens=int(generation.get("max_new_tokens", 4096) or 4096), stop_token_ids=tokenizer.eos_ids,
                    repetition_penalty=float(generation.get("repetition_penalty", 1.0) or 1.0))


@attrs.frozen
class Loaded:
    """Everything startup built, for `serve` and for tests that drive the engine directly."""

    settings: Settings
    family: Family
    checkpoint: Checkpoint
    declarations: Declarations
    device: torch.device
    dtype: torch.dtype
    service: Service
    engine: Engine
    ranks: Ranks | None = None   # at --tensor-parallel-size above 1: the followers this process started


def memory_plan(settings: Settings, layout: Layout, checkpoint: Checkpoint, device: torch.device,
                dtype: torch.dtype) -> tuple[MemoryPlan | None, list[str]]:
    """The stream memory plan for these settings, of one rank (its Layout, its checkpoint's slices): --kv-gib,
    or what the device leaves after weights (on the CPU every rank shares the RAM, so each plans for its share)."""
    world = settings.tensor_parallel
    if settings.kv_gib is not None:
        budget = int(settings.kv_gib * GIB)
    else:
        weights = checkpoint.weight_bytes(dtype) if checkpoint.shards() else 0
        if device.type == "cuda":
            budget = default_budget("cuda", weights, torch.cuda.mem_get_info(device)[0])
        else:
            budget = default_budget(device.type, weights * world) // world
    page_rows = settings.page_rows if settings.switch("TF_KV_PAGES") else settings.context
    return plan_memory(layout, settings.context, page_rows, budget, settings.parallel, settings.step_rows)


def build_memory(plan: MemoryPlan, layout: Layout, settings: Settings, device: torch.device) -> StreamMemory:
    """The store, slots and pool the plan describes (pages, or one window per stream with TF_KV_PAGES=0)."""
    poison = settings.switch("TF_KV_POISON")
    slots = SlotPool(plan.parallel)
    if not settings.switch("TF_KV_PAGES"):
        return StreamMemory(WindowStore(layout, plan.parallel, settings.context, device, poison), slots, None)
    store = PagedStore(layout, plan.parallel, plan.pages, plan.page_rows, device, poison)
    return StreamMemory(store, slots, PagePool(plan.pages, plan.page_rows))


def host_cache_bytes(settings: Settings, meminfo: Path = MEMINFO) -> int:
    """The host tier's budget, one rank's: --host-cache-gib, else a share of available RAM (read here, once) split
    between the ranks (every rank keeps its part of each state in the same host's memory)."""
    if settings.host_cache_gib is not None:
        return int(settings.host_cache_gib * GIB)
    return default_host_cache(meminfo) // max(1, settings.tensor_parallel)


def build_tiers(settings: Settings, memory: StreamMemory, host_bytes: int) -> tuple[DeviceTier | None,
                                                                                    HostTier | None]:
    """The device tier (--prompt-cache-gib) and the host tier below it (`host_bytes`); 0 turns either off."""
    device = DeviceTier(memory, int(settings.prompt_cache_gib * GIB)) if settings.prompt_cache_gib > 0 else None
    host = HostTier(memory, host_bytes) if host_bytes > 0 else None
    return device, host


def tiers_line(settings: Settings, host_bytes: int, pinned: bool) -> str:
    """The tiers' budgets for the startup log."""
    device = "device tier off" if settings.prompt_cache_gib <= 0 else \
        f"{size(settings.prompt_cache_gib * GIB)} on the device"
    if host_bytes <= 0:
        return f"{device}, host tier off"
    ranks = f" / {settings.tensor_parallel} ranks" if settings.tensor_parallel > 1 else ""
    share = f" ({HOST_CACHE_SHARE:.0%} of available RAM{ranks})" if settings.host_cache_gib is None else ""
    return f"{device}, {size(host_bytes)} of {'pinned ' if pinned else ''}host memory{share}"


def checkpoint_of(settings: Settings, family: Family, require_weights: bool = True) -> Checkpoint:
    """The checkpoint `--model` names, or the family's embedded default."""
    directory = settings.model if settings.model is not None else embedded_checkpoint(family, settings.cache_dir)
    return Checkpoint(Path(directory), require_weights=require_weights)


def decode_runner(model: FamilyModel, memory: StreamMemory, parallel: int, settings: Settings) -> FamilyModel:
    """On the GPU, a model with a tensor-only `decode` runs its decode steps on padded static buffers, replayed
    from CUDA graphs unless TF_CUDA_GRAPHS is off (engine/graphs.py); elsewhere the family's forward alone."""
    if memory.kv.device.type != "cuda" or not has_decode(model):
        return model
    runner = DecodeRunner(model, memory.kv, batch_sizes(parallel), settings.context,
                          graphs=settings.switch("TF_CUDA_GRAPHS"))
    runner.capture()
    return runner


def boot(settings: Settings, family: Family) -> Loaded:
    """Check everything, refuse with every reason at once, then load and start the engine; at TP above 1, start
    the followers first (follow/spawn.py) and stop them again when anything after fails."""
    checkpoint = checkpoint_of(settings, family)
    raise_if_any(all_refusals(settings, family, checkpoint))
    world = settings.tensor_parallel
    device = rank_device(resolve_device(settings.device), 0)
    dtype = resolve_dtype(settings.dtype, device)
    declarations = family.declare(checkpoint.config, dtype)
    layout = declarations.layout if world == 1 else rank_layout(family, checkpoint, dtype, world)
    plan, refusals = memory_plan(settings, layout, rank_checkpoint(family, checkpoint, Shard(0, world)), device,
                                 dtype)
    raise_if_any([Refusal("core", m) for m in refusals + layout_refusals(settings, layout)])
    if not settings.learn and settings.learn_flags_given():
        log.warning("%s given without --learn-conversations: nothing is kept on disk",
                    ", ".join(settings.learn_flags_given()))
    if world == 1:
        return assemble(settings, family, checkpoint, declarations, layout, plan, device, dtype, None)
    ranks = Ranks(world, family.name, checkpoint.directory, dtype, device, settings.tp_timeout_s)
    try:
        return assemble(settings, family, checkpoint, declarations, layout, plan, device, dtype, ranks)
    except BaseException:
        ranks.close(failure="startup failed")
        raise


def assemble(settings: Settings, family: Family, checkpoint: Checkpoint, declarations: Declarations,
             layout: Layout, plan: MemoryPlan, device: torch.device, dtype: torch.dtype,
             ranks: Ranks | None) -> Loaded:
    """Load this rank's model (with `ranks`: joined with the followers, then waited for), build memory, tiers,
    engine and service."""
    if ranks is None:
        model = family.load(checkpoint, dtype, device)
    else:
        model, _ = load_rank(family, checkpoint, dtype, device, ranks.join().shard)
        ranks.wait_ready()
    tokenizer = ChatTokenizer(checkpoint.directory, checkpoint.generation, settings.chat_template)
    memory = build_memory(plan, layout, settings, device)
    if ranks is None:
        disk = build_disk(settings, checkpoint, declarations, model, memory, dtype, device) if settings.learn else None
        model = decode_runner(model, memory, plan.parallel, settings)
    else:
        model = ranks.lead(model, memory.kv)    # the disk tier's startup forwards run on every rank through it
        disk = build_disk(settings, checkpoint, declarations, model, memory, dtype, device, ranks.world) \
            if settings.learn else None
        if disk is not None:
            disk.lead(model)
            ranks.stop_grace_s += disk.flush_s + IN_HAND_S
        if device.type == "cuda":
            log.info("decode steps run eager at --tensor-parallel-size %d: no CUDA graphs, no launch ahead (the "
                     "Leader offers no tensor-only decode)", ranks.world)
    if device.type == "cuda":
        warm_forward(model, memory, settings.context)
    host_bytes = host_cache_bytes(settings)
    tier, host = build_tiers(settings, memory, host_bytes)
    stats = EngineStats()
    engine = Engine(model, memory, settings.prefill_chunk, settings.context, settings.max_waiting,
                    min_chunk=settings.min_chunk, tier=tier, host=host, disk=disk, stats=stats,
                    overlap=isinstance(model, DecodeRunner) and settings.switch("TF_OVERLAP"), seed=settings.seed,
                    step_rows=settings.step_rows)
    names = settings.served_names or (checkpoint.directory.name,)
    service = Service(engine=engine, tokenizer=tokenizer, model_name=names[0], model_names=names, family=family.name,
                      context=settings.context, defaults=generation_defaults(checkpoint.generation, tokenizer),
                      request_starts=settings.switch(family.request_starts_switch),
                      isolate_by_key=settings.isolate_cache_by_key, stats=stats,
                      plan={**plan.describe(), "pages_on": settings.switch("TF_KV_PAGES"),
                            "poison": settings.switch("TF_KV_POISON"),
                            "prompt_cache_gib": settings.prompt_cache_gib, "host_cache_bytes": host_bytes,
                            "host_cache_pinned": host is not None and host.pin, **learn_plan(settings, disk),
                            "tensor_parallel": settings.tensor_parallel,
                            **({"ranks": ranks.describe()} if ranks is not None else {})},
                      chat_format=family.chat_format(checkpoint.config),
                      grammars=Grammars(tokenizer.tokenizer, model.vocab_size, tokenizer.eos_ids)
                      if tokenizer.eos_ids else None)
    log.info("family %s, %s on %s, %s; %d streams of %d tokens, KV %.1f MiB (%s)%s", family.name,
             checkpoint.directory, device, str(dtype).removeprefix("torch."), plan.parallel, settings.context,
             memory.kv.nbytes / 2**20, f"{plan.pages} pages of {plan.page_rows} rows"
             if settings.switch("TF_KV_PAGES") else "one window per stream",
             f"; rank 0 of {ranks.world}, every number one rank's" if ranks is not None else "")
    log.info("kept prompt states: %s", tiers_line(settings, host_bytes, host is not None and host.pin))
    if disk is not None:
        log.info("kept prompt states on disk: %s", disk_line(disk))
    if ranks is not None:
        ranks.watch(engine.die)
    return Loaded(settings=settings, family=family, checkpoint=checkpoint, declarations=declarations,
                  device=device, dtype=dtype, service=service, engine=engine, ranks=ranks)


def build_disk(settings: Settings, checkpoint: Checkpoint, declarations: Declarations, model: FamilyModel,
               memory: StreamMemory, dtype: torch.dtype, device: torch.device, world: int = 1) -> DiskTier | None:
    """The disk tier: the probe and the identity, the rows store (refused by name when locked or of another
    format; writing nothing, said once, when the disk is full or read-only; None, said once, when such a disk
    cannot even make --learn-dir), and the payoff rule's inputs measured once: the store's read bandwidth and the
    model's prefill rate. At TP above 1 `model` is the Leader (the probe and the timed chunk run on every rank),
    the store is rank 0's part, and --learn-gib and --learn-daily-gib are split between the ranks' stores."""
    from functools import partial

    from tensorfold.image import row_offset
    from tensorfold.rows.api import StoreRefused
    from tensorfold.rows.guard import no_room
    from tensorfold.rows.identity import identity_facts, prefill_rate, probe_hash, probe_rows, room
    from tensorfold.rows.store import RowsStore

    try:
        settings.learn_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        if not no_room(err):
            raise
        log.warning("kept prompt states on disk: none: --learn-dir %s cannot be made: %s; serving goes on",
                    settings.learn_root, err)
        return None

    chunk = probe_rows(memory, settings.min_chunk, settings.prefill_chunk, settings.context)
    layout = memory.kv.layout
    facts = identity_facts(checkpoint, declarations, dtype, device, probe_hash(model, memory, declarations, chunk),
                           layout, world)
    try:
        store = RowsStore(settings.learn_root, facts, row_offset=partial(row_offset, layout, declarations.image),
                          block_rows=settings.learn_block_rows, cap_bytes=int(settings.learn_gib * GIB) // world,
                          daily_bytes=None if settings.learn_daily_gib is None
                          else int(settings.learn_daily_gib * GIB) // world,
                          min_free_bytes=int(settings.learn_min_free_gib * GIB))
    except StoreRefused as err:
        raise Refused([Refusal("core", f"--learn-dir: {err}")]) from err
    try:
        rows = max(1, min(settings.prefill_chunk, settings.context - 1, PREFILL_PROBE_ROWS, room(memory)))
        return DiskTier(memory, store, declarations.image, read_bytes_per_s=store.read_bandwidth(BANDWIDTH_BYTES),
                        prefill_rows_per_s=prefill_rate(model, memory, rows),
                        verify=settings.switch("TF_IMPRINT_VERIFY"),
                        reserve=min(memory.kv.layout.stream_bytes(settings.context), DISK_RESERVE_BYTES))
    except BaseException:
        store.close()
        raise


def learn_plan(settings: Settings, disk: DiskTier | None) -> dict[str, object]:
    """The disk tier in /memory's plan (nothing when it is off): where, its identity, caps and payoff inputs."""
    if disk is None:
        return {}
    return {"learn": True, "learn_dir": str(settings.learn_root), "learn_identity": disk.store.identity,
            "learn_block_rows": settings.learn_block_rows, "learn_bytes": disk.store.cap_bytes,
            "learn_daily_bytes": disk.store.daily_bytes, "learn_min_free_bytes": disk.store.min_free_bytes,
            "learn_read_bytes_per_s": round(disk.read_bytes_per_s),
            "learn_prefill_rows_per_s": round(disk.prefill_rows_per_s),
            "learn_verify": disk.verify, "learn_writes": disk.store.writes_off is None,
            "learn_writes_off": disk.store.writes_off}


def disk_line(disk: DiskTier) -> str:
    """The disk tier for the startup log."""
    stats = disk.store.stats()
    return (f"{disk.store.directory} ({stats.states} states, {size(stats.bytes)} of {size(stats.budget)}); "
            f"reads {size(disk.read_bytes_per_s)}/s, prefill {disk.prefill_rows_per_s:,.0f} rows/s"
            f"{'; TF_IMPRINT_VERIFY on' if disk.verify else ''}"
            f"{'; writes nothing (the warning above says why)' if disk.store.writes_off else ''}")
