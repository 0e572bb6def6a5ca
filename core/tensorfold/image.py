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

from tensorfold.kv import KvStore
from tensorfold.layout import DTYPES, Layout

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
    own: bytes
    rows: bytes | bytearray       # a bytearray when read from disk: put back without another copy

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


def _from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(like.dtype).reshape(like.shape).to(like.device)


PUT_PIECE_BYTES = 64 << 20    # rows of an image moved to the device at a time: bounds the extra device memory


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
    parts = [kv.rows(i, name, slot, at) for i, name in fmt.rows]
    everies = [_every(kv.layout, i, name) for i, name in fmt.rows]
    if all(every == 1 for every in everies) and parts:
        table = torch.cat([p.contiguous().reshape(at, -1).view(torch.uint8).reshape(at, -1) for p in parts], dim=1)
        rows = _as_bytes(table)
    else:
        chunks = bytearray()
        for position in range(at):
            for part, every in zip(parts, everies, strict=True):
                if (position + 1) % every == 0:
                    chunks += _as_bytes(part[position // every])
        rows = bytes(chunks)
    return StateImage(format=fmt.name, version=fmt.version, at=at, digest=layout_digest(kv.layout),
                      own=own, rows=rows)


def put_back(kv: KvStore, slot: int, image: StateImage, fmt: ImageFormat) -> None:
    """Restore an image into a slot, so the slot continues from `image.at` as if it had never stopped."""
    if (image.format, image.version) != (fmt.name, fmt.version):
        raise ValueError(f"image is {image.format} v{image.version}, this family writes {fmt.name} v{fmt.version}")
    if image.digest != layout_digest(kv.layout):
        raise ValueError("image was made for another Layout")
    kv.clear(slot)
    offset = 0
    for i, name in fmt.own:
        target = kv.fixed(i, name, slot)
        size = target.numel() * target.element_size()
        target.copy_(_from_bytes(image.own[offset: offset + size], target))
        offset += size
    if offset != len(image.own):
        raise ValueError(f"image own part is {len(image.own)} bytes, the format needs {offset}")
    _put_rows(kv, slot, image, fmt)


def _put_rows(kv: KvStore, slot: int, image: StateImage, fmt: ImageFormat) -> None:
    specs = [next(s for s in kv.layout.layers[i].rows if s.name == name) for i, name in fmt.rows]
    if all(spec.every == 1 for spec in specs):
        _put_plain_rows(kv, slot, image, fmt, specs)
        return
    offset = 0
    for position in range(image.at):
        for (i, name), spec in zip(fmt.rows, specs, strict=True):
            if (position + 1) % spec.every:
                continue
            entry = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=kv.device)
            entry = _from_bytes(image.rows[offset: offset + spec.entry_bytes], entry)
            kv.write_rows(i, name, slot, position + 1 - spec.every, entry.unsqueeze(0))
            offset += spec.entry_bytes
    if offset != len(image.rows):
        raise ValueError(f"image rows part is {len(image.rows)} bytes, {image.at} rows need {offset}")


def _put_plain_rows(kv: KvStore, slot: int, image: StateImage, fmt: ImageFormat, specs: list) -> None:
    record = sum(spec.entry_bytes for spec in specs)
    if len(image.rows) != record * image.at:
        raise ValueError(f"image rows part is {len(image.rows)} bytes, {image.at} rows need {record * image.at}")
    if not image.at or not specs:
        return
    rows = image.rows if isinstance(image.rows, bytearray) else bytearray(image.rows)
    table = torch.frombuffer(rows, dtype=torch.uint8).reshape(image.at, record)
    step = max(1, PUT_PIECE_BYTES // record)
    for first in range(0, image.at, step):
        piece = table[first: first + step].to(kv.device)        # one copy per piece; the columns split there
        offset = 0
        for (i, name), spec in zip(fmt.rows, specs, strict=True):
            values = piece[:, offset: offset + spec.entry_bytes].contiguous().view(DTYPES[spec.dtype])
            kv.write_rows(i, name, slot, first, values.reshape(piece.shape[0], *spec.shape))
            offset += spec.entry_bytes


def _every(layout: Layout, layer: int, name: str) -> int:
    return next(s.every for s in layout.layers[layer].rows if s.name == name)
