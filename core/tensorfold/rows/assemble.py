"""One state's image put together from its state file and its blocks, every byte verified on the way; the blocks
are read and hashed by a few threads at once, each into its own slice of the rows."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tensorfold.image import StateImage
from tensorfold.rows.api import StateEntry
from tensorfold.rows.files import BLOCK, STATE, Bytes, damaged, read_file
from tensorfold.rows.names import Chain, state_key, tokens_from
from tensorfold.rows.shelf import Shelf, block_words, state_problem

READERS = 4     # blocks read and hashed at once: file reads and sha256 release the GIL, and a disk serves a queue


def assemble(shelf: Shelf, identity: str, entry: StateEntry, row_offset: Callable[[int], int]) -> StateImage:
    """The image of `entry`: trailers and hashes of every file, its words against the index, its tokens against
    its name and its blocks' names; raises Damaged naming the file that fails."""
    path = shelf.state_path(entry.key)
    words, body = read_file(path, STATE)
    problem = state_problem(words, entry.key, row_offset)
    if problem:
        raise damaged(path, problem)
    at, block_rows = words["at"], words["block_rows"]
    if (at, tuple(words["cuts"]), tuple(words["blocks"])) != (entry.at, entry.cuts, entry.blocks):
        raise damaged(path, "words differ from the index")
    check_names(path, identity, words, body, entry)
    rows = bytearray(words["rows"])
    view = memoryview(rows)

    def read_block(index: int, name: str) -> None:
        want = block_words(index, block_rows, row_offset)
        block = shelf.block_path(name)
        got, _ = read_file(block, BLOCK, into=view[want["start"]: want["start"] + want["body"]])
        if got != want:
            raise damaged(block, f"words {got} are not block {index}'s {want}")

    with ThreadPoolExecutor(max_workers=min(READERS, max(1, len(entry.blocks)))) as pool:
        for done in [pool.submit(read_block, index, name) for index, name in enumerate(entry.blocks)]:
            done.result()                       # the first block that fails raises, naming its file
    own_end = 4 * at + words["own"]
    view[len(rows) - words["tail"]:] = body[own_end:]
    return StateImage(format=words["format"], version=words["version"], at=at, digest=words["digest"],
                      own=bytes(body[4 * at: own_end]), rows=rows)


def check_names(path: Path, identity: str, words: dict[str, Any], body: Bytes, entry: StateEntry) -> None:
    """A state file's tokens, under the partition its words record ("" when none), hash to its own name, chain and
    blocks' names; raises Damaged naming the file."""
    at = words["at"]
    chain = Chain(identity, words["block_rows"], tokens_from(body[: 4 * at]), words.get("partition", ""))
    if chain.at(at).hex() != words["chain"] or state_key(chain.at(at), entry.cuts) != entry.key:
        raise damaged(path, "its tokens do not hash to its name")
    if chain.blocks(at) != entry.blocks:
        raise damaged(path, "its tokens do not hash to its blocks' names")
