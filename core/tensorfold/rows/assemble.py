"""One state's image put together from its state file and its blocks, every byte verified on the way.

With the block rows known (the store's own reads: its states' names fold its block rows in), one reader thread
reads the blocks in order, then the state file, one after another (a disk serves one sequential stream fastest),
each into its own slice of the rows; the hashing thread hashes each chunk behind the read (files.py), so the reader
goes on with the next chunk and the next file; a block's rows, once verified, go to `put` on the calling thread
while the later files are still read and hashed: read, hash and put back run as a pipeline. Without them
(`tensorfold learned verify`), the state file is read first and names them. The rows part and the state file's
body go into `into(bytes)` when given (buffers the caller reuses: nothing reads or writes them once `assemble`
returns or raises; the image's rows and own part are views of them), else new ones.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tensorfold.image import StateImage
from tensorfold.rows.api import StateEntry
from tensorfold.rows.files import BLOCK, STATE, Bytes, damaged, read_file, read_started
from tensorfold.rows.names import Chain, state_key, tokens_from
from tensorfold.rows.shelf import Shelf, block_words, state_problem

Put = Callable[[int, int, memoryview], None]    # (first row, rows, their verified bytes in the rows part)
Into = Callable[[int], memoryview]              # a writable buffer of that many bytes for the rows part


def assemble(shelf: Shelf, identity: str, entry: StateEntry, row_offset: Callable[[int], int],
             block_rows: int | None = None, put: Put | None = None, into: Into | None = None) -> StateImage:
    """The image of `entry`: trailers and hashes of every file, its words against the index, its tokens against
    its name and its blocks' names; raises Damaged naming the file that fails. With `block_rows`, the files are
    read in one pipeline and each verified block's rows handed to `put` as it lands (module docstring)."""
    path = shelf.state_path(entry.key)
    first: tuple[dict[str, Any], Bytes] | None = None
    if block_rows is None:
        first = read_file(path, STATE)
        _check_state(path, identity, entry, row_offset, *first)
        block_rows = first[0]["block_rows"]
    size = row_offset(entry.at)
    view = into(size) if into is not None else memoryview(bytearray(size))
    wants = [block_words(index, block_rows, row_offset) for index in range(len(entry.blocks))]
    files = [(shelf.block_path(name), BLOCK, view[want["start"]: want["start"] + want["body"]])
             for name, want in zip(entry.blocks, wants, strict=True)]
    if first is None:
        files.append((path, STATE, into))
    reading = InOrder(files)
    try:
        for index, want in enumerate(wants):
            got, _ = reading.next()                 # the first file that fails raises, naming it
            if got != want:
                raise damaged(files[index][0], f"words {got} are not block {index}'s {want}")
            if put is not None:
                put(index * block_rows, block_rows, files[index][2])
        if first is None:
            first = reading.next()
            _check_state(path, identity, entry, row_offset, *first)
            if first[0]["block_rows"] != block_rows:
                raise damaged(path, f"words say block rows {first[0]['block_rows']}, the store's are {block_rows}")
    finally:
        reading.close()
    words, body = first
    at = words["at"]
    own_end = 4 * at + words["own"]
    view[len(view) - words["tail"]:] = body[own_end:]
    own = body[4 * at: own_end]
    return StateImage(format=words["format"], version=words["version"], at=at, digest=words["digest"],
                      own=own if into is not None else bytes(own), rows=view if into is not None else view.obj)


class InOrder:
    """Files read one after another on a reader thread of their own, each hashed behind its read (files.py
    `read_started`); `next` gives each one's (words, body) in order, verified, or raises what its read raised."""

    def __init__(self, files: list[tuple[Path, bytes, memoryview | Into | None]]) -> None:
        self._files = files
        self._done: queue.Queue[Future | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tf-rows-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for path, magic, into in self._files:
            if self._stop.is_set():
                return
            try:
                self._done.put(read_started(path, magic, into))
            except BaseException as error:
                self._done.put(error)
                return

    def next(self) -> tuple[dict[str, Any], Bytes]:
        """The next file's words and body once read and verified."""
        item = self._done.get()
        if isinstance(item, BaseException):
            raise item
        return item.result()

    def close(self) -> None:
        """Stop after the file being read; return once nothing reads or hashes into the buffers any more."""
        self._stop.set()
        self._thread.join()
        while not self._done.empty():
            item = self._done.get_nowait()
            if isinstance(item, Future):
                item.exception()                    # waits for its hashing; its outcome no longer matters


def _check_state(path: Path, identity: str, entry: StateEntry, row_offset: Callable[[int], int],
                 words: dict[str, Any], body: Bytes) -> None:
    """A state file's words and tokens against its name, the index and its blocks' names; raises Damaged."""
    problem = state_problem(words, entry.key, row_offset)
    if problem:
        raise damaged(path, problem)
    if (words["at"], tuple(words["cuts"]), tuple(words["blocks"])) != (entry.at, entry.cuts, entry.blocks):
        raise damaged(path, "words differ from the index")
    check_names(path, identity, words, body, entry)


def check_names(path: Path, identity: str, words: dict[str, Any], body: Bytes, entry: StateEntry) -> None:
    """A state file's tokens, under the partition its words record ("" when none), hash to its own name, chain and
    blocks' names; raises Damaged naming the file."""
    at = words["at"]
    chain = Chain(identity, words["block_rows"], tokens_from(body[: 4 * at]), words.get("partition", ""))
    if chain.at(at).hex() != words["chain"] or state_key(chain.at(at), entry.cuts) != entry.key:
        raise damaged(path, "its tokens do not hash to its name")
    if chain.blocks(at) != entry.blocks:
        raise damaged(path, "its tokens do not hash to its blocks' names")
