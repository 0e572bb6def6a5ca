"""Names in the rows store: the chained hash of an identity and a token prefix, so a block's name says exactly which
rows it holds and two states sharing a prefix name (and so share) the same blocks.

    h₀        sha256(identity hash ‖ u32 LE block_rows)       the block size is in the seed: blocks cut on
                                                              another grid never share a name
              for a partition other than "" (a hex digest, engine/api.py Request.partition), h₀ is
              sha256(identity hash ‖ u32 LE block_rows ‖ "partition" ‖ the partition as ASCII): its states and
              blocks have names no other partition's tokens can produce
    hₖ₊₁      sha256(hₖ ‖ tokens [kB, (k+1)B) as int32 LE)    block k's name is hex(hₖ₊₁)
    chain(p)  sha256(h_j ‖ tokens [jB, p)), j = (p-1) // B    so chain(kB) = hₖ; chain(0) = h₀
    key       sha256(chain(at) ‖ "cuts" ‖ cuts as int64 LE)   a state's name: equal tokens cut differently differ
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int32, the bytes the chain feeds on and the state file stores."""
    packed = array("i", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def tokens_from(data: bytes | memoryview) -> tuple[int, ...]:
    """The tokens `token_bytes` wrote."""
    packed = array("i")
    packed.frombytes(bytes(data))
    if sys.byteorder != "little":
        packed.byteswap()
    return tuple(packed)


def seed(identity: str, block_rows: int, partition: str = "") -> bytes:
    """h₀: the identity, the block size and the partition (engine/api.py Request.partition) every name below
    depends on; the shared partition "" adds nothing, so its names are those of stores written before partitions."""
    salt = b"partition" + partition.encode() if partition else b""
    return hashlib.sha256(identity.encode() + struct.pack("<I", block_rows) + salt).digest()


def state_key(chain: bytes, cuts: Sequence[int]) -> str:
    """A state's name: its chain at `at` and the cuts that made it."""
    return hashlib.sha256(chain + b"cuts" + struct.pack(f"<{len(cuts)}q", *cuts)).hexdigest()


class Chain:
    """The chained hashes of one token sequence, computed once per block as positions are asked for in order."""

    def __init__(self, identity: str, block_rows: int, tokens: Sequence[int], partition: str = "") -> None:
        if block_rows < 1:
            raise ValueError(f"block rows must be >= 1, got {block_rows}")
        self.block_rows = block_rows
        self._data = token_bytes(tokens)
        self._length = len(tokens)
        self._heads = [seed(identity, block_rows, partition)]   # hₖ for k = 0 … blocks hashed so far

    def head(self, k: int) -> bytes:
        """hₖ: the chain after k full blocks."""
        if k * self.block_rows > self._length:
            raise ValueError(f"block {k} ends past the {self._length} tokens")
        step = 4 * self.block_rows
        while len(self._heads) <= k:
            j = len(self._heads) - 1
            self._heads.append(hashlib.sha256(self._heads[j] + self._data[j * step: (j + 1) * step]).digest())
        return self._heads[k]

    def at(self, position: int) -> bytes:
        """chain(position): the hash of the identity and tokens [0, position)."""
        if not 0 <= position <= self._length:
            raise ValueError(f"position {position} is outside the {self._length} tokens")
        if position == 0:
            return self.head(0)
        j = (position - 1) // self.block_rows
        if (j + 1) * self.block_rows == position:
            return self.head(j + 1)
        tail = self._data[4 * j * self.block_rows: 4 * position]
        return hashlib.sha256(self.head(j) + tail).digest()

    def blocks(self, position: int) -> tuple[str, ...]:
        """The names of the full blocks below `position`, in order."""
        return tuple(self.head(k + 1).hex() for k in range(position // self.block_rows))
