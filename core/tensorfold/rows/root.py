"""The rows store's root, shared by every identity: its format mark, its lock, the day's write budget, and a
read-only listing for `tensorfold learned`."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from tensorfold.rows.api import StateEntry, StoreRefused
from tensorfold.rows.files import STORE_VERSION, read_small, real_dir, write_json, write_small
from tensorfold.rows.guard import no_room
from tensorfold.rows.shelf import HEX, Shelf

FORMAT = "FORMAT"
LOCK = "lock"
BUDGET = "budget.json"
IDENTITY = "identity.json"


def is_identity(path: Path) -> bool:
    """An identity directory: named by 32 hex digits (rows/api.py identity_hash), a directory itself (a link to one
    is never followed: nothing outside the root is read or removed)."""
    return len(path.name) == 32 and set(path.name) <= HEX and real_dir(path)


def read_json(path: Path) -> object:
    """A small JSON file's value; None when it is missing, not a regular file (a link is not followed) or not JSON."""
    try:
        return json.loads(read_small(path))
    except (OSError, ValueError):
        return None


def take_lock(root: Path) -> int:
    """An exclusive lock on `<root>/lock` holding our pid (one server per root, whatever its identity): the open
    descriptor, or StoreRefused naming the directory and the holder's pid, or naming the lock when it is a link or
    not a regular file of one link (it is opened without following a link, and written only after this check). On
    a read-only file system the lock a server made before is taken read-only; a pid the disk has no room for is
    left out (the flock is the lock)."""
    path = root / LOCK
    fd, writable = _open_lock(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file of {st.st_nlink} hard links"
            raise StoreRefused(f"{path} is {what}: the rows store's lock must be its own regular file; remove it")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreRefused(f"{root} is in use by another tensorfold server (pid {holder}): give each server its own "
                           f"--learn-dir") from None
    except BaseException:
        os.close(fd)
        raise
    if not writable:
        return fd
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as error:
        if not no_room(error):
            release_lock(fd)
            raise
    return fd


def _open_lock(path: Path) -> tuple[int, bool]:
    """The lock's descriptor and whether it is open for writing (not on a read-only file system)."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600), True
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise StoreRefused(f"{path} is a symbolic link: the rows store's lock must be a regular file, and the "
                               f"store follows no link; remove it") from None
        if error.errno == errno.EISDIR:
            raise StoreRefused(f"{path} is a directory: the rows store's lock must be a regular file; remove "
                               f"it") from None
        if error.errno != errno.EROFS:
            raise
        try:
            return os.open(path, os.O_RDONLY | flags), False
        except FileNotFoundError:
            raise error from None


def release_lock(fd: int) -> None:
    """Let the next server in."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def check_format(root: Path) -> str | None:
    """Refuse a root another store format wrote, by name (or whose `FORMAT` is a link or not a regular file: it is
    never read through); mark a new root with ours. Returns why the store must write nothing when the disk has no
    room for the mark (or is read-only), else None."""
    path = root / FORMAT
    try:
        text = read_small(path).decode(errors="replace").strip()
    except FileNotFoundError:
        try:
            write_small(path, f"{STORE_VERSION}\n".encode())
        except OSError as error:
            if not no_room(error):
                raise
            return f"{path} could not be written: {error}"
        return None
    except OSError as error:
        raise StoreRefused(f"{path} cannot be read: {error.strerror or error}; move it aside") from None
    if text != str(STORE_VERSION):
        raise StoreRefused(f"{path} names rows store format {text[:40]!r}; this tensorfold reads format "
                           f"{STORE_VERSION}: move the directory aside or choose another --learn-dir")
    return None


def leftover_parts(root: Path) -> list[Path]:
    """Every `.part` file a crash mid-write may have left under the root (through no link)."""
    found = list(root.glob("*.part"))
    for folder in (p for p in root.iterdir() if is_identity(p)):
        found += folder.glob("*.part")
        for sub in ("states", "blocks"):
            if real_dir(folder / sub):
                found += (folder / sub).glob("*.part")
    return found


class DailyBudget:
    """Bytes written per UTC day by every identity under the root (`budget.json`), against --learn-daily-gib."""

    def __init__(self, root: Path, clock: Callable[[], float]) -> None:
        self.path = root / BUDGET
        self._clock = clock
        value = read_json(self.path)
        ok = isinstance(value, dict) and isinstance(value.get("day"), str) and isinstance(value.get("bytes"), int)
        self._value = value if ok else {}

    def today(self) -> str:
        """The UTC day the clock is in."""
        return time.strftime("%Y-%m-%d", time.gmtime(self._clock()))

    def spent(self) -> int:
        """Bytes written today."""
        return self._value["bytes"] if self._value.get("day") == self.today() else 0

    def spend(self, nbytes: int) -> None:
        """Record `nbytes` more written today (raises OSError when the file cannot be written)."""
        self._value = {"day": self.today(), "bytes": self.spent() + nbytes}
        write_json(self.path, self._value)


def list_identities(root: Path) -> list[tuple[str, dict, list[StateEntry]]]:
    """Every identity under `root`: its hash, its facts and its states (least recently used first), read without
    the lock and without repairing anything (for `tensorfold learned ls/show`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(p for p in root.iterdir() if is_identity(p)):
        facts = read_json(folder / IDENTITY)
        shelf = Shelf(folder)
        if real_dir(folder / "states") and real_dir(folder / "blocks"):
            shelf.load(None, repair=False)
        found.append((folder.name, facts if isinstance(facts, dict) else {}, list(shelf.states.values())))
    return found
