"""An HF-format checkpoint directory: config, generation defaults and lazily read safetensors weights; the checks
every family runs on its names and shapes before a model is built from them."""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
FLOATS = ("F32", "F16", "BF16")
STORED_SIZES = {"F64": 8, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
SINGLE = "model.safetensors"
LISTED = 20                 # names an error lists before it counts the rest


class CheckpointError(Exception):
    """A checkpoint directory is missing a file or holds a damaged one; the message names it."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is missing") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err


class Checkpoint:
    """Reads a checkpoint directory; tensors are read from their shard only when asked for."""

    def __init__(self, directory: Path | str, require_weights: bool = True) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        self.config = _read_json(self.directory / "config.json")
        generation = self.directory / "generation_config.json"
        self.generation = _read_json(generation) if generation.exists() else {}
        self._shard_of = self._index() if require_weights or self._has_weights() else {}

    def _has_weights(self) -> bool:
        return (self.directory / INDEX).exists() or (self.directory / SINGLE).exists()

    @property
    def model_type(self) -> str:
        """The config's model_type (the key that finds the family)."""
        model_type = self.config.get("model_type")
        if not isinstance(model_type, str):
            raise CheckpointError(f"{self.directory / 'config.json'} has no model_type")
        return model_type

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return sorted(self._shard_of)

    def shards(self) -> list[Path]:
        """The safetensors files, in name order."""
        return sorted({self.directory / shard for shard in self._shard_of.values()})

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard now."""
        shard = self._shard_of.get(name)
        if shard is None:
            raise CheckpointError(f"{self.directory} has no tensor {name!r}")
        with safe_open(self.directory / shard, framework="pt") as handle:
            return handle.get_tensor(name)

    def tensors(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, shard by shard, with a progress line on stderr."""
        total = len(self._shard_of)
        done = 0
        progress = progress and sys.stderr.isatty()
        log.info("loading %d tensors from %d shard(s) in %s", total, len(self.shards()), self.directory)
        for shard in self.shards():
            with safe_open(shard, framework="pt") as handle:
                for name in handle.keys():
                    done += 1
                    if progress:
                        _progress(done, total, shard.name)
                    yield name, handle.get_tensor(name)
        if progress and total:
            sys.stderr.write("\n")

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the weights once floating-point tensors are cast to `dtype` (others as stored)."""
        total = 0
        for shard in self.shards():
            with safe_open(shard, framework="pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    count = self.elements(name, tuple(piece.get_shape()))
                    stored = piece.get_dtype()
                    total += count * (dtype.itemsize if stored in FLOATS else STORED_SIZES.get(stored, 1))
        return total

    def elements(self, name: str, shape: tuple[int, ...]) -> int:
        """How many of a tensor's elements this reader yields (a rank's reader yields its slice)."""
        return math.prod(shape)

    def _index(self) -> dict[str, str]:
        index = self.directory / INDEX
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no weight_map")
            for shard in set(weight_map.values()):
                if not (self.directory / shard).is_file():
                    raise CheckpointError(f"{index} names shard {shard}, which is missing")
            return dict(weight_map)
        single = self.directory / SINGLE
        if not single.is_file():
            raise CheckpointError(f"{self.directory} has neither {SINGLE} nor {INDEX}")
        try:
            with safe_open(single, framework="pt") as handle:
                return {name: SINGLE for name in handle.keys()}
        except Exception as err:
            raise CheckpointError(f"{single} cannot be read as safetensors: {err}") from err


def _progress(done: int, total: int, shard: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\rloading weights [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {shard}")
    sys.stderr.flush()


def listed(names: Sequence[str]) -> str:
    """The first LISTED names and how many more: a large checkpoint can miss tens of thousands of experts."""
    more = f", ... and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more


def check_tensor_names(names: Iterable[str], shapes: Mapping[str, tuple[int, ...]], canonical: Callable[[str], str],
                       ignored: Callable[[str], bool], model: str,
                       explain_missing: Callable[[list[str]], str | None] | None = None) -> int:
    """Raise ValueError naming every missing, unexpected or doubled tensor; return how many are ignored.

    Run on `Checkpoint.names()` before any tensor is read, so a wrong checkpoint fails before gigabytes move.
    `canonical` maps a checkpoint name to the spelling `shapes` uses; `ignored` is asked about that spelling and
    says which tensors the model does not read; `model` names what an unexpected tensor is not part of;
    `explain_missing`, given the missing names, may add one sentence after them.
    """
    seen: dict[str, str] = {}
    unexpected, doubled, skips = [], [], 0
    for name in names:
        key = canonical(name)
        if ignored(key):
            skips += 1
        elif key not in shapes:
            unexpected.append(name)
        elif key in seen:
            doubled.append(f"{seen[key]} and {name}")
        else:
            seen[key] = name
    problems = []
    missing = [name for name in shapes if name not in seen]
    if missing:
        problems.append(f"missing tensors: {listed(missing)}")
        explained = explain_missing(missing) if explain_missing else None
        if explained:
            problems.append(explained)
    if unexpected:
        problems.append(f"unexpected tensors (not part of a {model} with this config): {listed(unexpected)}")
    if doubled:
        problems.append(f"tensors given twice: {'; '.join(doubled[:LISTED])}")
    if problems:
        raise ValueError("the checkpoint does not match its config.json: " + "; ".join(problems))
    return skips


def expected_tensors(checkpoint: Checkpoint, shapes: Mapping[str, tuple[int, ...]], canonical: Callable[[str], str],
                     progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor `shapes` names, once, under its `canonical` name, shard by shard; ValueError on a wrong shape.

    Names outside `shapes` and second copies are passed over: `check_tensor_names` has refused all but the ignored.
    """
    given: set[str] = set()
    for name, tensor in checkpoint.tensors(progress=progress):
        key = canonical(name)
        if key not in shapes or key in given:
            continue
        if tuple(tensor.shape) != shapes[key]:
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, the config needs {shapes[key]}")
        given.add(key)
        yield key, tensor
