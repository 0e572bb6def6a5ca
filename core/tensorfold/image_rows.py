"""The rows part of a kept-state image, by position, moved as whole tables rather than position by position.

Record p holds, for each row state the format names (in its order), the entry that completes at position p (a
state with `every` k completes one entry at each p with (p + 1) % k == 0). With E the least common multiple of the
`every`s, every E positions repeat one byte pattern, so rows [0, G·E) are a table [G, group bytes] whose columns
are (position in the group, state) slices: both directions are a few strided copies per column, on the device,
and only the last at % E positions go one by one.
"""

from __future__ import annotations

import math

import attrs
import torch

from tensorfold.kv import KvStore
from tensorfold.layout import DTYPES, RowState

PUT_PIECE_BYTES = 64 << 20    # rows moved to the device at a time when put back: bounds the extra device memory


@attrs.frozen
class RowsTable:
    """The repeating pattern of the rows part: E, the row states and each column's (state, entry, byte offset)."""

    period: int                                        # E
    states: tuple[tuple[int, str, RowState], ...]      # (layer, name, spec) in the format's order
    columns: tuple[tuple[int, int, int], ...]          # (state index, entry within the group, byte offset)
    group_bytes: int

    @classmethod
    def of(cls, kv: KvStore, rows: tuple[tuple[int, str], ...]) -> RowsTable:
        states = tuple((i, name, next(s for s in kv.layout.layers[i].rows if s.name == name)) for i, name in rows)
        period = math.lcm(*(spec.every for _, _, spec in states)) if states else 1
        columns, offset = [], 0
        for j in range(period):
            for n, (_, _, spec) in enumerate(states):
                if (j + 1) % spec.every == 0:
                    columns.append((n, (j + 1) // spec.every - 1, offset))
                    offset += spec.entry_bytes
        return cls(period=period, states=states, columns=tuple(columns), group_bytes=offset)

    def nbytes(self, at: int) -> int:
        """Bytes of rows [0, at)."""
        return sum(spec.entries(at) * spec.entry_bytes for _, _, spec in self.states)


def _entry_bytes(values: torch.Tensor, spec: RowState) -> torch.Tensor:
    """[entries, *shape] -> uint8 [entries, entry bytes]."""
    return values.contiguous().reshape(values.shape[0], math.prod(spec.shape)).view(torch.uint8)


def rows_bytes(kv: KvStore, slot: int, at: int, table: RowsTable) -> bytes:
    """The rows part of the image of the state a slot holds at `at`."""
    if not table.states or not at:
        return b""
    parts = [_entry_bytes(kv.rows(i, name, slot, at), spec) for i, name, spec in table.states]   # [entries, bytes]
    groups = at // table.period
    out = []
    if groups:
        grouped = [p[: groups * (table.period // spec.every)].reshape(groups, table.period // spec.every,
                                                                       spec.entry_bytes)
                   for p, (_, _, spec) in zip(parts, table.states, strict=True)]
        whole = torch.cat([grouped[n][:, k, :] for n, k, _ in table.columns], dim=1)      # [G, group bytes]
        out.append(whole.cpu().numpy().tobytes())
    for position in range(groups * table.period, at):
        for part, (_, _, spec) in zip(parts, table.states, strict=True):
            if (position + 1) % spec.every == 0:
                out.append(part[(position + 1) // spec.every - 1].cpu().numpy().tobytes())
    return b"".join(out)


def put_rows(kv: KvStore, slot: int, rows: bytes | bytearray | memoryview, at: int, table: RowsTable,
             start: int = 0) -> None:
    """Write an image's rows part for positions [start, at) into a slot (rows before `start`, a multiple of the
    table's period, are in place already); ValueError when its length is wrong."""
    if len(rows) != table.nbytes(at):
        raise ValueError(f"image rows part is {len(rows)} bytes, {at} rows need {table.nbytes(at)}")
    begin = table.nbytes(start)
    put_rows_part(kv, slot, memoryview(rows)[begin:], start, at, table)


def put_rows_part(kv: KvStore, slot: int, data: bytes | bytearray | memoryview, start: int, end: int,
                  table: RowsTable) -> None:
    """Write the rows part's bytes of positions [start, end) (`data`, exactly those) into a slot: `start` is a
    multiple of the table's period, so a rows store block's bytes go in as soon as they are read."""
    if start % table.period:
        raise ValueError(f"rows from {start} do not start a group of {table.period}")
    if len(data) != table.nbytes(end) - table.nbytes(start):
        raise ValueError(f"rows [{start}, {end}) are {table.nbytes(end) - table.nbytes(start)} bytes, got {len(data)}")
    if not table.states or end <= start:
        return
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    data = torch.frombuffer(data if writable else bytearray(data), dtype=torch.uint8)
    first_group, groups = start // table.period, end // table.period - start // table.period
    step = max(1, PUT_PIECE_BYTES // max(table.group_bytes, 1))
    for first in range(0, groups, step):
        count = min(step, groups - first)
        piece = data[first * table.group_bytes: (first + count) * table.group_bytes].view(count, -1).to(kv.device)
        for n, (i, name, spec) in enumerate(table.states):
            per = table.period // spec.every
            entries = torch.empty((count, per, spec.entry_bytes), dtype=torch.uint8, device=kv.device)
            for state, k, offset in table.columns:
                if state == n:
                    entries[:, k, :] = piece[:, offset: offset + spec.entry_bytes]
            values = entries.view(count * per, spec.entry_bytes).view(DTYPES[spec.dtype])
            kv.write_rows(i, name, slot, (first_group + first) * table.period, values.reshape(count * per, *spec.shape))
    offset = groups * table.group_bytes
    for position in range((first_group + groups) * table.period, end):
        for i, name, spec in table.states:
            if (position + 1) % spec.every:
                continue
            raw = data[offset: offset + spec.entry_bytes].to(kv.device).view(DTYPES[spec.dtype])
            kv.write_rows(i, name, slot, position + 1 - spec.every, raw.reshape(1, *spec.shape))
            offset += spec.entry_bytes
