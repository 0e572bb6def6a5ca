"""The rows store's files: written so a crash never leaves one that reads as valid, read so damage is named.

A data file (`.blk`, `.st`) is a payload then a trailer:

    payload   magic (4) ‖ u32 LE store version ‖ u32 LE W ‖ words (W bytes of JSON, `body` among them) ‖ body
    trailer   u64 LE payload length ‖ sha256 of the payload (32)

Every file, data or JSON, is written as `<name>.part`, flushed and fsynced, renamed over `<name>`, then its
directory fsynced (callers writing many files in one directory may fsync it once, before anything refers to them).
No file is opened through a symbolic link: a `.part` is made new (a link or file planted at its name is removed
first), and every read opens a regular file without following a link, so nothing planted in the store's place is
written through or read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import attrs

from tensorfold.rows.api import Damaged

STORE_VERSION = 1
BLOCK = b"TFBK"
STATE = b"TFST"
HEAD = 12                # magic, version, W
TRAILER = 40             # u64 length, sha256
CHUNK = 8 << 20          # bytes per read or write call: large sequential I/O

# The one thread that hashes what reads read, in the order they read it (sha256 releases the GIL): a reader goes
# on with its next chunk, or its next file, while the last one is hashed.
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tf-rows-hash")

Bytes = bytes | bytearray | memoryview


def encode(words: dict[str, Any]) -> bytes:
    """Words as the canonical JSON every file and size computation uses."""
    return json.dumps(words, sort_keys=True, separators=(",", ":")).encode()


def file_size(words: dict[str, Any]) -> int:
    """Bytes of a data file whose words are `words` (its body is words["body"] bytes)."""
    return HEAD + len(encode(words)) + words["body"] + TRAILER


def damaged(path: Path, problem: str) -> Damaged:
    """The error a failed check raises: it names the file and what is wrong."""
    return Damaged(f"{path}: {problem}", path=str(path), problem=problem)


def open_plain(path: Path, buffering: int = -1) -> BinaryIO:
    """A regular file opened for reading without following a symbolic link or waiting on a FIFO: OSError naming
    what is there otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, never followed", str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return open(fd, "rb", buffering=buffering)


def read_small(path: Path) -> bytes:
    """A small plain file's bytes (open_plain: never through a link)."""
    with open_plain(path) as handle:
        return handle.read()


def real_dir(path: Path) -> bool:
    """A directory itself, not a symbolic link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def fsync_dir(directory: Path) -> None:
    """Make renames and removals in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: Bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:CHUNK]):]


def write_file(path: Path, magic: bytes, words: dict[str, Any], body: Sequence[Bytes], sync_dir: bool = True) -> int:
    """Write a data file durably (module docstring); returns its size. words["body"] must be the body's length."""
    text = encode(words)
    if sum(memoryview(b).nbytes for b in body) != words["body"]:
        raise ValueError(f"{path.name}: the body is not the {words['body']} bytes its words say")
    head = magic + struct.pack("<II", STORE_VERSION, len(text)) + text
    digest = hashlib.sha256(head)
    for part in body:
        digest.update(part)
    trailer = struct.pack("<Q", len(head) + words["body"]) + digest.digest()
    _durable(path, [head, *body, trailer], sync_dir)
    return len(head) + words["body"] + TRAILER


def write_json(path: Path, value: Any) -> None:
    """Write a small JSON file durably (no trailer: people and `tensorfold learned` read these)."""
    write_small(path, json.dumps(value, sort_keys=True, indent=1).encode() + b"\n")


def write_small(path: Path, data: bytes) -> None:
    """Write a small plain file durably."""
    _durable(path, [data], sync_dir=True)


def _durable(path: Path, parts: Sequence[Bytes], sync_dir: bool) -> None:
    part = path.with_name(path.name + ".part")
    part.unlink(missing_ok=True)       # whatever a crash (or anyone) left there: the .part is always a new file
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        for data in parts:
            _write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        part.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(part, path)
    if sync_dir:
        fsync_dir(path.parent)


@attrs.frozen
class Header:
    """A data file's words, checked against its size and its trailer's length (its hash is not read)."""

    words: dict[str, Any]
    size: int


def _read_exact(handle, count: int) -> bytes:
    data = handle.read(count)
    if len(data) != count:
        raise EOFError
    return data


def _parse_head(path: Path, magic: bytes, handle, size: int) -> tuple[bytes, dict[str, Any]]:
    try:
        head = _read_exact(handle, HEAD)
    except EOFError:
        raise damaged(path, f"{size} bytes, shorter than a header") from None
    if head[:4] != magic:
        raise damaged(path, f"bad magic {head[:4]!r}, expected {magic!r}")
    version, length = struct.unpack("<II", head[4:])
    if version != STORE_VERSION:
        raise damaged(path, f"store version {version}, this tensorfold writes {STORE_VERSION}")
    if HEAD + length + TRAILER > size:
        raise damaged(path, f"words of {length} bytes do not fit in {size} bytes")
    text = _read_exact(handle, length)
    try:
        words = json.loads(text)
    except ValueError as error:
        raise damaged(path, f"words are not JSON ({error})") from None
    if not isinstance(words, dict) or not isinstance(words.get("body"), int) or words["body"] < 0:
        raise damaged(path, "words name no body length")
    if size != HEAD + length + words["body"] + TRAILER:
        raise damaged(path, f"{size} bytes, its words say {HEAD + length + words['body'] + TRAILER}")
    return head + text, words


def read_header(path: Path, magic: bytes) -> Header:
    """The words of a data file, its size checked against them and its trailer's length field."""
    try:
        with open_plain(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            _, words = _parse_head(path, magic, handle, size)
            handle.seek(size - TRAILER)
            (length,) = struct.unpack("<Q", _read_exact(handle, 8))
    except OSError as error:
        raise damaged(path, f"cannot be read ({error.strerror or error})") from None
    if length != size - TRAILER:
        raise damaged(path, f"trailer says a payload of {length} bytes, the file holds {size - TRAILER}")
    return Header(words=words, size=size)


def read_prefix(path: Path, magic: bytes, count: int) -> bytes:
    """The first `count` bytes of a data file's body, its header checked (not its hash)."""
    try:
        with open_plain(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            _, words = _parse_head(path, magic, handle, size)
            if count > words["body"]:
                raise damaged(path, f"body is {words['body']} bytes, shorter than {count}")
            return _read_exact(handle, count)
    except EOFError:
        raise damaged(path, "ends inside its body") from None
    except OSError as error:
        raise damaged(path, f"cannot be read ({error.strerror or error})") from None


def read_started(path: Path, magic: bytes, into: memoryview | Callable[[int], memoryview] | None = None) -> Future:
    """Read a data file's words and body on this thread, each chunk hashed on the hashing thread behind the read;
    the Future gives (words, body) once every byte is checked against the trailer, or raises Damaged naming the
    file. A file that cannot be read raises here. The body is read into `into` when given (a buffer of exactly the
    body's length, or a callable giving one for that length), else into a new buffer; no hashing of it is left
    running once this returns or raises and the Future is done."""
    pending: Future | None = None
    try:
        with open_plain(path, buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)   # a larger read-ahead
            head, words = _parse_head(path, magic, handle, size)
            if callable(into):
                into = into(words["body"])
            if into is not None and into.nbytes != words["body"]:
                raise damaged(path, f"body is {words['body']} bytes, the reader expects {into.nbytes}")
            body = memoryview(bytearray(words["body"])) if into is None else into
            digest = hashlib.sha256(head)
            filled = 0
            while filled < body.nbytes:
                got = handle.readinto(body[filled: filled + CHUNK])
                if not got:
                    raise damaged(path, f"ends after {HEAD + filled} bytes of body")
                pending = _HASHER.submit(digest.update, body[filled: filled + got])
                filled += got
            trailer = _read_exact(handle, TRAILER)
    except BaseException as error:
        if pending is not None:
            _HASHER.submit(int).result()            # the chunks already queued are hashed: the body is free again
        if isinstance(error, EOFError):
            raise damaged(path, "ends inside its trailer") from None
        if isinstance(error, OSError):
            raise damaged(path, f"cannot be read ({error.strerror or error})") from None
        raise
    return _HASHER.submit(_checked, path, head, words, body, digest, trailer)


def _checked(path: Path, head: bytes, words: dict[str, Any], body: memoryview, digest: Any,
             trailer: bytes) -> tuple[dict[str, Any], Bytes]:
    """On the hashing thread, after the body's chunks: the trailer against the payload."""
    (length,) = struct.unpack("<Q", trailer[:8])
    if length != len(head) + body.nbytes:
        raise damaged(path, f"trailer says a payload of {length} bytes, the file holds {len(head) + body.nbytes}")
    if digest.digest() != trailer[8:]:
        raise damaged(path, "sha256 of the payload differs from its trailer")
    return words, body


def read_file(path: Path, magic: bytes, into: memoryview | None = None) -> tuple[dict[str, Any], Bytes]:
    """A data file's words and body, every byte checked against the trailer. The body is read into `into` when
    given (it must be exactly the body's length), else into a new buffer."""
    return read_started(path, magic, into).result()
