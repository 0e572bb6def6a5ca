"""The kv Layout: what memory one stream needs, declared per layer by a family; the core prices memory from it alone."""

from __future__ import annotations

import math

import attrs
import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The Layout's spelling of a torch dtype."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no Layout name; use one of {sorted(DTYPES)}")


def _check_name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not value or not value.replace("_", "").isalnum():
        raise ValueError(f"{attribute.name} must be a non-empty identifier, got {value!r}")


def _check_shape(instance: object, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not all(isinstance(n, int) and n > 0 for n in value):
        raise ValueError(f"{attribute.name} must be positive ints, got {value!r}")


def _check_dtype(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in DTYPES:
        raise ValueError(f"{attribute.name} {value!r} is not one of {sorted(DTYPES)}")


@attrs.frozen
class RowState:
    """A state that grows with position: one entry of `shape` per `every` tokens (KV rows, a latent, a pooled key)."""

    name: str = attrs.field(validator=_check_name)
    shape: tuple[int, ...] = attrs.field(converter=tuple, validator=_check_shape)
    dtype: str = attrs.field(validator=_check_dtype)
    every: int = attrs.field(default=1, validator=attrs.validators.gt(0))

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry (one row, or one pooled entry when every > 1)."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def entries(self, rows: int) -> int:
        """Entries held for `rows` tokens: complete groups of `every` only."""
        return rows // self.every


@attrs.frozen
class FixedState:
    """A state whose size does not depend on position (a recurrent state, a conv tail)."""

    name: str = attrs.field(validator=_check_name)
    shape: tuple[int, ...] = attrs.field(converter=tuple, validator=_check_shape)
    dtype: str = attrs.field(validator=_check_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of this state for one stream."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@attrs.frozen
class LayerLayout:
    """One layer's states; `kind` is the family's word for the mixer (e.g. "attention", "gdn")."""

    kind: str = attrs.field(validator=_check_name)
    rows: tuple[RowState, ...] = attrs.field(default=(), converter=tuple)
    fixed: tuple[FixedState, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        names = [s.name for s in self.rows] + [s.name for s in self.fixed]
        if len(set(names)) != len(names):
            raise ValueError(f"layer of kind {self.kind!r} repeats a state name: {names}")

    @property
    def bytes_per_token(self) -> float:
        """Row bytes per token (a pooled state counts its share)."""
        return sum(s.entry_bytes / s.every for s in self.rows)

    @property
    def fixed_bytes(self) -> int:
        """Fixed bytes of this layer per stream."""
        return sum(s.nbytes for s in self.fixed)


@attrs.frozen
class Layout:
    """Every layer's states, in layer order; the only thing the core knows of a family's memory."""

    layers: tuple[LayerLayout, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a Layout needs at least one layer")
        for layer in self.layers:
            if not isinstance(layer, LayerLayout):
                raise TypeError(f"Layout.layers holds {type(layer).__name__}, not LayerLayout")

    @property
    def bytes_per_token(self) -> float:
        """Row bytes one token costs across all layers."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def fixed_bytes(self) -> int:
        """Fixed bytes one stream costs across all layers."""
        return sum(layer.fixed_bytes for layer in self.layers)

    def stream_bytes(self, rows: int) -> int:
        """Bytes one stream holding `rows` tokens costs."""
        row_part = sum(s.entries(rows) * s.entry_bytes for layer in self.layers for s in layer.rows)
        return row_part + self.fixed_bytes

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Per layer kind: how many layers, bytes per token and fixed bytes per stream, for plans and docs."""
        out: dict[str, dict[str, float]] = {}
        for layer in self.layers:
            entry = out.setdefault(layer.kind, {"layers": 0, "bytes_per_token": 0.0, "fixed_bytes": 0})
            entry["layers"] += 1
            entry["bytes_per_token"] += layer.bytes_per_token
            entry["fixed_bytes"] += layer.fixed_bytes
        return out

    def describe(self) -> dict:
        """A JSON-ready description (for `tensorfold families --json` and `explain`)."""
        return {
            "bytes_per_token": self.bytes_per_token,
            "fixed_bytes_per_stream": self.fixed_bytes,
            "by_kind": self.by_kind(),
            "layers": [attrs.asdict(layer) for layer in self.layers],
        }
