"""The kept-state image: how a stream's state at position `at` becomes bytes and comes back, without the tiers
knowing what the bytes mean.

An image is three parts:
    words   the fixed facts: format name and version, `at`, a digest of the Layout
    own     the state's own bytes: the fixed states the format names, in its order
    rows    rows [0, at) by position: record p holds, for each row state the format names, the entries that
            complete at position p; so rows [a, b) are one contiguous byte range and two states that share a
            prefix share those bytes exactly
"""

from __future__ import annotations

import hashlib
import json
import struct

import attrs
import torch

from tensorfold.image_rows import RowsTable, put_rows, rows_bytes
from tensorfold.kv import KvStore
from tensorfold.layout import Layout

MAGIC = b"TFIM"
CONTAINER_VERSION = 1


@attrs.frozen
class ImageFormat:
    """A family's declaration of its image: which fixed states are its own part, which row states go by position."""

    name: str
    version: int
    own: tuple[tuple[int, str], ...] = attrs.field(converter=lambda v: tuple(tuple(x) for x in v))
    rows: tuple[tuple[int, str], ...] = attrs.field(converter=lambda v: tuple(tuple(x) for x in v))

    @classmethod
    def of_layout(cls, name: str, version: int, layout: Layout) -> ImageFormat:
        """The plain format: every fixed state is own, every row state goes by position, in layer order."""
        own = [(i, s.name) for i, layer in enumerate(layout.layers) for s in layer.fixed]
        rows = [(i, s.name) for i, layer in enumerate(layout.layers) for s in layer.rows]
        return cls(name=name, version=version, own=own, rows=rows)

    def problems(self, layout: Layout) -> list[str]:
        """What makes this format unfit for the Layout: a state missing, named twice or unknown."""
        fixed = {(i, s.name) for i, layer in enumerate(layout.layers) for s in layer.fixed}
        rows = {(i, s.name) for i, layer in enumerate(layout.layers) for s in layer.rows}
        found = []
        if not self.name or self.version < 1:
            found.append(f"format needs a name and a version >= 1, got {self.name!r} v{self.version}")
        for part, declared, kind in ((self.own, fixed, "fixed"), (self.rows, rows, "row")):
            if len(set(part)) != len(part):
                found.append(f"a {kind} state is named twice: {list(part)}")
            unknown = set(part) - declared
            missing = declared - set(part)
            if unknown:
                found.append(f"{kind} states not in the Layout: {sorted(unknown)}")
            if missing:
                found.append(f"{kind} states the image leaves out (a kept state would lose them): {sorted(missing)}")
        return found


def layout_digest(layout: Layout) -> str:
    """A short hash of the Layout, so an image is never put back into memory of another shape."""
    text = json.dumps(layout.describe()["layers"], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@attrs.frozen
class StateImage:
    """One kept state as bytes: words, own part, rows by position."""

    format: str
    version: int
    at: int
    digest: str
    own: bytes | memoryview               # read from disk into the reader's own buffers: memoryviews of them,
    rows: bytes | bytearray | memoryview  # valid while it keeps them; put back without another copy

    def to_bytes(self) -> bytes:
        """The image as one byte string: magic, container version, words (JSON), own, rows."""
        words = json.dumps({"format": self.format, "version": self.version, "at": self.at,
                            "digest": self.digest, "own": len(self.own), "rows": len(self.rows)}).encode()
        return MAGIC + struct.pack("<II", CONTAINER_VERSION, len(words)) + words + self.own + self.rows

    @classmethod
    def from_bytes(cls, data: bytes) -> StateImage:
        """Parse an image; raises ValueError naming what is wrong with damaged bytes."""
        if data[:4] != MAGIC:
            raise ValueError("not a state image: bad magic")
        container, size = struct.unpack("<II", data[4:12])
        if container != CONTAINER_VERSION:
            raise ValueError(f"state image container version {container} is not {CONTAINER_VERSION}")
        words = json.loads(data[12: 12 + size])
        body = data[12 + size:]
        if len(body) != words["own"] + words["rows"]:
            raise ValueError(f"state image body is {len(body)} bytes, its words say {words['own'] + words['rows']}")
        return cls(format=words["format"], version=words["version"], at=words["at"], digest=words["digest"],
                   own=body[: words["own"]], rows=body[words["own"]:])


def _as_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return flat.view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes | memoryview, like: torch.Tensor) -> torch.Tensor:
    writable = isinstance(data, memoryview) and not data.readonly        # a reader's own buffer: no copy of it
    raw = torch.frombuffer(data if writable else bytearray(data), dtype=torch.uint8)
    return raw.view(like.dtype).reshape(like.shape).to(like.device)


def row_offset(layout: Layout, fmt: ImageFormat, position: int) -> int:
    """Bytes of the rows part before `position`."""
    layers = layout.layers
    return sum(
        s.entries(position) * s.entry_bytes
        for i, name in fmt.rows for s in layers[i].rows if s.name == name
    )


def read_out(kv: KvStore, slot: int, at: int, fmt: ImageFormat) -> StateImage:
    """The image of the state a slot holds at `at` (the slot must have run exactly to `at`)."""
    own = b"".join(_as_bytes(kv.fixed(i, name, slot)) for i, name in fmt.own)
    rows = rows_bytes(kv, slot, at, RowsTable.of(kv, fmt.rows))
    return StateImage(format=fmt.name, version=fmt.version, at=at, digest=layout_digest(kv.layout),
                      own=own, rows=rows)


def put_back(kv: KvStore, slot: int, image: StateImage, fmt: ImageFormat, start: int = 0) -> None:
    """Restore an image into a slot, so the slot continues from `image.at` as if it had never stopped; rows before
    `start` (a multiple of the rows table's period) are in the slot already (the disk tier puts them as read)."""
    if (image.format, image.version) != (fmt.name, fmt.version):
        raise ValueError(f"image is {image.format} v{image.version}, this family writes {fmt.name} v{fmt.version}")
    if image.digest != layout_digest(kv.layout):
        raise ValueError("image was made for another Layout")
    targets = [(i, name, kv.fixed(i, name, slot)) for i, name in fmt.own]
    need = sum(target.numel() * target.element_size() for _, _, target in targets)
    if need != len(image.own):
        raise ValueError(f"image own part is {len(image.own)} bytes, the format needs {need}")
    if not start:
        kv.clear(slot)
    offset = 0
    for i, name, target in targets:
        size = target.numel() * target.element_size()
        kv.write_fixed(i, name, slot, _from_bytes(image.own[offset: offset + size], target))
        offset += size
    put_rows(kv, slot, image.rows, image.at, RowsTable.of(kv, fmt.rows), start)
