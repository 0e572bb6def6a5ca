"""What the rows store tests share: a small Layout with a pooled row state (every=4), images read out of a real
KvStore whose rows depend on the token prefix (so states sharing a prefix share their rows' bytes, as a model's
do), a fake clock, and a store opener."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from tensorfold.image import ImageFormat, StateImage, read_out, row_offset
from tensorfold.kv import WindowStore
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState
from tensorfold.rows.store import RowsStore

LAYOUT = Layout([
    LayerLayout("rec", fixed=[FixedState("s", (2, 2), "float32")]),
    LayerLayout("attn", rows=[RowState("k", (2,), "bfloat16"), RowState("pool", (3,), "float32", every=4)]),
])
FMT = ImageFormat.of_layout("rows-test", 1, LAYOUT)
OFFSET = functools.partial(row_offset, LAYOUT, FMT)
BLOCK = 8
FACTS = {"family": "rows-test", "dtype": "bfloat16"}
DAY = 86_400.0


def tokens(seed: int, n: int) -> tuple[int, ...]:
    """A deterministic token sequence."""
    return tuple((seed * 7919 + i * 104_729) % 50_000 for i in range(n))


def image(prompt: Sequence[int], at: int) -> StateImage:
    """The image of a state at `at` over `prompt`: row p depends on (p, prompt[p]) alone, the fixed state on all
    of prompt[:at]."""
    kv = WindowStore(LAYOUT, slots=1, capacity=max(at, 1))
    kv.clear(0)
    if at:
        k = torch.tensor([[t * 0.5 + p, p * 0.25 - t] for p, t in enumerate(prompt[:at])]).bfloat16()
        kv.write_rows(1, "k", 0, 0, k)
    pooled = [[p * 1.0, prompt[p] * 1.0, p * 0.5 + prompt[p]] for p in range(3, at, 4)]
    if pooled:
        kv.write_rows(1, "pool", 0, 0, torch.tensor(pooled))
    kv.fixed(0, "s", 0).copy_(torch.full((2, 2), float(sum(prompt[:at]) % 997)))
    return read_out(kv, 0, at, FMT)


class Clock:
    """A clock the test moves: each reading one second after the last."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._ticks = itertools.count()
        self.start = start

    def __call__(self) -> float:
        return self.start + next(self._ticks)


def open_store(root: Path, facts: dict[str, str] | None = None, **options) -> RowsStore:
    """A store on `root` with the test Layout's row offsets and 8-row blocks (options override)."""
    options.setdefault("block_rows", BLOCK)
    options.setdefault("min_free_bytes", 0)
    options.setdefault("clock", Clock())
    return RowsStore(root, FACTS if facts is None else facts, row_offset=OFFSET, **options)


def write(store: RowsStore, prompt: Sequence[int], at: int, cuts: Sequence[int] | None = None,
          used: float | None = None):
    """Write the state at `at` over `prompt` (cut on the block grid and at `at` unless `cuts` is given; last used
    at `used`, else now)."""
    cuts = tuple(range(BLOCK, at, BLOCK)) + (at,) if cuts is None else tuple(cuts)
    return store.write(prompt[:at], cuts, image(prompt, at), used=used)


def files(root: Path, suffix: str) -> list[Path]:
    """Every file of a kind under the root."""
    return sorted(root.rglob(f"*{suffix}"))
