"""What startup refuses before it loads anything: the core's flag checks, the disk tier's directory, tensor
parallelism's limits and the family's own refusals, collected so they are reported together (boot.py raises them)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.family import Family
from tensorfold.layout import Layout
from tensorfold.refusals import Refusal
from tensorfold.settings import Settings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def core_refusals(settings: Settings, family: Family, checkpoint: Checkpoint) -> list[Refusal]:
    """The core's own reasons to refuse these settings."""
    found = []
    if settings.context < 2:
        found.append(f"--context {settings.context} is too small: it must be at least 2")
    if settings.prefill_chunk < 1:
        found.append(f"--prefill-chunk {settings.prefill_chunk} must be at least 1")
    if settings.step_rows < 1:
        found.append(f"--max-step-rows {settings.step_rows} must be at least 1")
    if settings.min_chunk < 1:
        found.append(f"--min-chunk {settings.min_chunk} must be at least 1")
    if settings.max_waiting < 1:
        found.append(f"--max-waiting {settings.max_waiting} must be at least 1")
    if settings.page_rows < 1:
        found.append(f"--page-rows {settings.page_rows} must be at least 1")
    if settings.parallel is not None and settings.parallel < 1:
        found.append(f"--parallel {settings.parallel} must be at least 1 (or auto)")
    if settings.prompt_cache_gib < 0:
        found.append(f"--prompt-cache-gib {settings.prompt_cache_gib} must be 0 (off) or above")
    if settings.host_cache_gib is not None and settings.host_cache_gib < 0:
        found.append(f"--host-cache-gib {settings.host_cache_gib} must be 0 (off) or above")
    if settings.kv_gib is not None and settings.kv_gib <= 0:
        found.append(f"--kv-gib {settings.kv_gib} must be above 0")
    found += server_refusals(settings)
    found += learn_refusals(settings)
    found += tp_refusals(settings)
    if settings.dtype not in ("auto", *DTYPES):
        found.append(f"--dtype {settings.dtype!r} is not one of auto, {', '.join(DTYPES)}")
    try:
        device = resolve_device(settings.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            found.append(f"--device {settings.device} asks for CUDA, but torch sees no CUDA device")
        elif device.type not in ("cpu", "cuda"):
            found.append(f"--device {settings.device!r} is not auto, cpu, cuda or cuda:N")
    except RuntimeError as err:
        found.append(f"--device {settings.device!r} is not a device torch knows: {err}")
    if checkpoint.model_type not in family.model_types:
        found.append(f"--family {family.name} serves {', '.join(family.model_types)}, but the checkpoint at "
                     f"{checkpoint.directory} is model_type {checkpoint.model_type!r}")
    return [Refusal("core", message) for message in found]


def tp_refusals(settings: Settings) -> list[str]:
    """Tensor parallelism's flags' values (every kept-state tier works at any size: tiers/mirror.py,
    tiers/disk_mirror.py); on CUDA each rank needs a device of its own."""
    world = settings.tensor_parallel
    found = []
    if world < 1:
        found.append(f"--tensor-parallel-size {world} must be at least 1")
    if settings.tp_timeout_s <= 0:
        found.append(f"--tp-timeout {settings.tp_timeout_s:g} must be above 0 seconds")
    if world > 1:
        found += _tp_device_refusals(settings.device, world)
    return found


def _tp_device_refusals(given: str, world: int) -> list[str]:
    """On CUDA, ranks 0..N-1 run on N devices counted from the one given (`cuda` is cuda:0)."""
    try:
        device = resolve_device(given)
    except RuntimeError:
        return []                       # core_refusals names the device
    if device.type != "cuda" or not torch.cuda.is_available():
        return []
    first, count = device.index or 0, torch.cuda.device_count()
    if first + world > count:
        return [f"--tensor-parallel-size {world} on --device {given} needs cuda:{first} to cuda:{first + world - 1} "
                f"(one device per rank); torch sees {count} CUDA device{'s' if count != 1 else ''}"]
    return []


def server_refusals(settings: Settings) -> list[str]:
    """The HTTP front door's limits and access settings."""
    found = []
    if settings.max_request_bytes is not None and settings.max_request_bytes < 1024:
        found.append(f"--max-request-bytes {settings.max_request_bytes} must be at least 1024")
    if settings.header_timeout_s <= 0:
        found.append(f"--header-timeout {settings.header_timeout_s:g} must be above 0 seconds")
    if settings.body_timeout_s <= 0:
        found.append(f"--body-timeout {settings.body_timeout_s:g} must be above 0 seconds")
    if settings.max_connections < 1:
        found.append(f"--max-connections {settings.max_connections} must be at least 1")
    if settings.isolate_cache_by_key and not settings.api_keys:
        found.append("--isolate-cache-by-key needs API keys (--api-key, --api-key-file or TF_API_KEY): without "
                     "them every request has the same key")
    return found


def learn_refusals(settings: Settings) -> list[str]:
    """The --learn-* flags' values (checked whether or not the disk tier is on), and with it on, its directory."""
    found = []
    if settings.learn_block_rows < 1:
        found.append(f"--learn-block-rows {settings.learn_block_rows} must be at least 1")
    if settings.learn_gib <= 0:
        found.append(f"--learn-gib {settings.learn_gib} must be above 0")
    if settings.learn_daily_gib is not None and settings.learn_daily_gib <= 0:
        found.append(f"--learn-daily-gib {settings.learn_daily_gib} must be above 0 (leave it out for no daily "
                     "limit)")
    if settings.learn_min_free_gib < 0:
        found.append(f"--learn-min-free-gib {settings.learn_min_free_gib} must be 0 or above")
    if settings.learn:
        found += _root_refusals(settings.learn_root)
    return found


def _root_refusals(root: Path) -> list[str]:
    """--learn-dir as the file system holds it: a directory of its own (made mode 0700 when missing; not the working
    directory, `/` or a file), ours and closed to group and others (set to 0700 when it is ours: rows/guard.py),
    readable and writable (a read-only file system is served, writing nothing), and its lock free. A disk too full
    (or read-only) to make it is no refusal: the server starts without the disk tier (build_disk says why)."""
    from tensorfold.rows.api import StoreRefused
    from tensorfold.rows.guard import guard_root, no_room, path_problem, read_only

    problem = path_problem(root)
    if problem is not None:
        return [f"--learn-dir: {problem}"]
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        return [] if no_room(err) else [f"--learn-dir {root} cannot be created: {err.strerror or err}"]
    if not os.access(root, os.R_OK | os.X_OK) or not (os.access(root, os.W_OK) or read_only(root)):
        return [f"--learn-dir {root} is not writable by this user"]
    try:
        guard_root(root, create=False)
    except StoreRefused as err:
        return [f"--learn-dir: {err}"]
    except OSError as err:
        return [f"--learn-dir {root}: {err.strerror or err}"]
    return _lock_refusal(root)


def _lock_refusal(root: Path) -> list[str]:
    """Whether another server holds the rows store's lock now, or the lock is a link or not a regular file (it is
    taken for good when the store opens; a disk too full or read-only to make it is no refusal: the store then
    writes nothing)."""
    from tensorfold.rows.api import StoreRefused
    from tensorfold.rows.guard import no_room
    from tensorfold.rows.root import release_lock, take_lock

    try:
        release_lock(take_lock(root))
    except StoreRefused as err:
        return [f"--learn-dir: {err}"]
    except OSError as err:
        if no_room(err):
            return []
        return [f"--learn-dir {root}: its lock cannot be taken: {err.strerror or err}"]
    return []


def layout_refusals(settings: Settings, layout: Layout) -> list[str]:
    """What the family's Layout refuses of these settings: --learn-block-rows must hold whole pooled entries."""
    everies = sorted({s.every for layer in layout.layers for s in layer.rows})
    if settings.learn and settings.learn_block_rows >= 1 and any(settings.learn_block_rows % e for e in everies):
        return [f"--learn-block-rows {settings.learn_block_rows} must be a multiple of every row state's entry "
                f"size ({', '.join(map(str, everies))} rows)"]
    return []


def all_refusals(settings: Settings, family: Family, checkpoint: Checkpoint) -> list[Refusal]:
    """The core's refusals, then the family's (asked only of a checkpoint of a model type it serves)."""
    found = core_refusals(settings, family, checkpoint)
    if checkpoint.model_type in family.model_types:
        found += [Refusal(family.name, m) for m in family.refusals(checkpoint.config, settings)]
        found += [Refusal(family.name, m) for m in family.tp_refusals(checkpoint.config, settings.tensor_parallel)]
    return found
