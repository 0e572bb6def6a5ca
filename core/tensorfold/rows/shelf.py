"""One identity directory of the rows store, as an index: its states (least recently used first), which states hold
each block, its bytes on disk. The state files' headers are the index; nothing else is needed to rebuild it."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from tensorfold.image import StateImage
from tensorfold.rows.api import Damaged, StateEntry
from tensorfold.rows.files import STATE, file_size, read_header, read_small, write_json

log = logging.getLogger(__name__)

HEX = frozenset("0123456789abcdef")
USAGE = "usage.json"     # key → [used, hits], saved at close; a state file's mtime is its last use if newer


def is_name(value: object) -> bool:
    """A sha256 hex name, as blocks and states are named."""
    return isinstance(value, str) and len(value) == 64 and set(value) <= HEX


def block_words(index: int, block_rows: int, row_offset: Callable[[int], int]) -> dict[str, Any]:
    """The words of block `index`: where its rows are in the image's rows part."""
    start, end = row_offset(index * block_rows), row_offset((index + 1) * block_rows)
    return {"block_rows": block_rows, "body": end - start, "index": index, "start": start}


def state_words(key: str, chain: str, cuts: Sequence[int], names: Sequence[str], image: StateImage, tail: int,
                block_rows: int, written: float, partition: str = "") -> dict[str, Any]:
    """A state file's words (docs/formats.md); `partition` only when not the shared "", so a shared state's file is
    byte for byte what a store before partitions wrote."""
    if partition and not is_name(partition):
        raise ValueError("a partition on disk is a sha256 hex digest (server/isolation.py), never a salt or key")
    at = image.at
    words = {"at": at, "block_rows": block_rows, "blocks": list(names), "body": 4 * at + len(image.own) + tail,
             "chain": chain, "cuts": list(cuts), "digest": image.digest, "format": image.format, "key": key,
             "own": len(image.own), "rows": len(image.rows), "tail": tail, "version": image.version,
             "written": written}
    if partition:
        words["partition"] = partition
    return words


def state_problem(words: dict[str, Any], key: str, row_offset: Callable[[int], int] | None) -> str | None:
    """What is wrong with a state file's words (None when nothing): fields, name, sizes against the rows part."""
    types = {"key": str, "chain": str, "at": int, "cuts": list, "block_rows": int, "blocks": list, "format": str,
             "version": int, "digest": str, "own": int, "tail": int, "rows": int, "written": (int, float)}
    for field, kind in types.items():
        if not isinstance(words.get(field), kind):
            return f"words lack {field!r}"
    at, cuts, block_rows = words["at"], words["cuts"], words["block_rows"]
    if words["key"] != key:
        return f"words name state {words['key'][:16]}…, the file is {key[:16]}…"
    if "partition" in words and not is_name(words["partition"]):
        return "words name a partition that is not a sha256 digest"
    if at < 1 or block_rows < 1 or not is_name(words["chain"]):
        return f"words say at {at}, block rows {block_rows}"
    if not cuts or cuts[-1] != at or any(not isinstance(c, int) for c in cuts) or cuts != sorted(set(cuts)):
        return f"cuts {cuts[:8]} do not rise to at {at}"
    if len(words["blocks"]) != at // block_rows or not all(is_name(b) for b in words["blocks"]):
        return f"{len(words['blocks'])} block names for {at} rows of {block_rows}"
    if min(words["own"], words["tail"], words["rows"]) < 0 or words["body"] != 4 * at + words["own"] + words["tail"]:
        return f"body of {words['body']} bytes is not tokens + own + tail"
    if row_offset is not None:
        full = at // block_rows * block_rows
        if words["rows"] != row_offset(at) or words["tail"] != row_offset(at) - row_offset(full):
            return f"rows part of {words['rows']} bytes (tail {words['tail']}), {at} rows make {row_offset(at)}"
    return None


class Shelf:
    """The index of one identity directory (`<root>/<identity>/`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.states: OrderedDict[str, StateEntry] = OrderedDict()
        self.chains: dict[str, str] = {}           # key → chain(at) hex
        self.by_chain: dict[str, list[str]] = {}   # chain(at) hex → keys
        self.refs: Counter[str] = Counter()        # block → states listing it
        self.ats: Counter[int] = Counter()         # at → states there, so a lookup hashes only where one may be
        self.block_rows: dict[str, int] = {}       # key → its words' block rows, so a read places blocks at once
        self.bytes = 0
        self.orphans_removed = 0                   # block files `load` removed because no state lists them

    def state_path(self, key: str) -> Path:
        return self.directory / "states" / f"{key}.st"

    def block_path(self, name: str) -> Path:
        return self.directory / "blocks" / f"{name}.blk"

    def load(self, row_offset: Callable[[int], int] | None, repair: bool) -> list[tuple[str, str]]:
        """Read every state file's header into the index. A state whose header, trailer length, words or blocks
        (present; their sizes too when `row_offset` is given) fail is left out and, when `repair`, removed with
        the blocks no other state lists. Returns (file, problem) for each state left out."""
        usage = self._usage()
        found: list[tuple[StateEntry, str, int]] = []
        problems: list[tuple[str, str]] = []
        sizes: dict[str, int] = {}
        for path in sorted((self.directory / "states").glob("*.st")):
            try:
                entry, chain, block_rows = self._entry(path, row_offset, sizes, usage)
            except Damaged as error:
                problems.append((str(path), error.problem or str(error)))
                if repair:
                    unlink(path)
                continue
            found.append((entry, chain, block_rows))
        for entry, chain, block_rows in sorted(found, key=lambda found: found[0].used):
            self.add(entry, chain, block_rows)
        if repair:
            for path in (self.directory / "blocks").glob("*.blk"):
                if path.stem not in self.refs:
                    unlink(path)
                    self.orphans_removed += not path.exists()
        self.bytes = self.measure()
        return problems

    def _entry(self, path: Path, row_offset: Callable[[int], int] | None, sizes: dict[str, int],
               usage: dict[str, Any]) -> tuple[StateEntry, str, int]:
        header = read_header(path, STATE)
        words = header.words
        problem = state_problem(words, path.stem, row_offset)
        if problem:
            raise Damaged(f"{path}: {problem}", path=str(path), problem=problem)
        nbytes = header.size
        for index, name in enumerate(words["blocks"]):
            if name not in sizes:
                try:
                    sizes[name] = os.lstat(self.block_path(name)).st_size
                except OSError:
                    problem = f"its block {index} ({name[:16]}…) is missing"
                    raise Damaged(f"{path}: {problem}", path=str(path), problem=problem) from None
            if row_offset is not None:
                want = file_size(block_words(index, words["block_rows"], row_offset))
                if sizes[name] != want:
                    problem = f"its block {index} ({name[:16]}…) is {sizes[name]} bytes, not {want}"
                    raise Damaged(f"{path}: {problem}", path=str(path), problem=problem)
            nbytes += sizes[name]
        try:
            used, hits = float(usage[path.stem][0]), int(usage[path.stem][1])
        except (KeyError, IndexError, TypeError, ValueError):
            used, hits = 0.0, 0
        entry = StateEntry(key=path.stem, at=words["at"], cuts=tuple(words["cuts"]), blocks=tuple(words["blocks"]),
                           nbytes=nbytes, written=float(words["written"]), used=max(used, path.stat().st_mtime),
                           hits=hits)
        return entry, words["chain"], words["block_rows"]

    def _usage(self) -> dict[str, Any]:
        try:
            value = json.loads(read_small(self.directory / USAGE))
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def save_usage(self) -> None:
        """Keep each state's last use and hits for the next startup."""
        write_json(self.directory / USAGE, {k: [e.used, e.hits] for k, e in self.states.items()})

    def measure(self) -> int:
        """Bytes of its state and block files, as the disk holds them now (what --learn-gib counts; a folder a full
        disk kept from being made holds none)."""
        total = 0
        for folder, suffix in (("states", ".st"), ("blocks", ".blk")):
            try:
                with os.scandir(self.directory / folder) as found:
                    for item in found:
                        if item.name.endswith(suffix):
                            try:
                                total += item.stat(follow_symlinks=False).st_size
                            except OSError:
                                pass
            except FileNotFoundError:
                pass
        return total

    def add(self, entry: StateEntry, chain: str, block_rows: int | None = None) -> None:
        """Index a state as the most recently used (`block_rows`: its words', when known)."""
        self.states[entry.key] = entry
        if block_rows is not None:
            self.block_rows[entry.key] = block_rows
        self.chains[entry.key] = chain
        self.by_chain.setdefault(chain, []).append(entry.key)
        self.ats[entry.at] += 1
        for name in entry.blocks:
            self.refs[name] += 1

    def touch(self, entry: StateEntry) -> None:
        """Replace a state's entry and make it the most recently used."""
        self.states[entry.key] = entry
        self.states.move_to_end(entry.key)

    def drop(self, key: str, keep: Collection[str] = ()) -> int:
        """Remove a state's file and the blocks no other state lists (except `keep`: blocks a write in progress
        relies on); returns the bytes freed. A no-op for an unknown key."""
        entry = self.states.pop(key, None)
        if entry is None:
            return 0
        chain = self.chains.pop(key)
        self.block_rows.pop(key, None)
        keys = self.by_chain[chain]
        keys.remove(key)
        if not keys:
            del self.by_chain[chain]
        self.ats[entry.at] -= 1
        if not self.ats[entry.at]:
            del self.ats[entry.at]
        freed = unlink(self.state_path(key))
        for name in entry.blocks:
            self.refs[name] -= 1
            if self.refs[name] <= 0:
                del self.refs[name]
                if name not in keep:
                    freed += unlink(self.block_path(name))
        self.bytes -= freed
        return freed

    def orphans(self, keep: Collection[str] = ()) -> int:
        """Remove block files no state lists (except `keep`); returns the bytes freed."""
        freed = 0
        for path in (self.directory / "blocks").glob("*.blk"):
            if path.stem not in self.refs and path.stem not in keep:
                freed += unlink(path)
        self.bytes -= freed
        return freed


def unlink(path: Path) -> int:
    """Remove a file; its size, or 0 when it was not there or the file system keeps it (read-only: a state file
    left behind is a valid state again at the next startup, a block an orphan removed then)."""
    try:
        size = os.lstat(path).st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    except OSError as error:
        log.warning("rows store: could not remove %s: %s", path, error)
        return 0
    return size
