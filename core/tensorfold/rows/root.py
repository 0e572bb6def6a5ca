"""The rows store's root, shared by every identity: its format mark, its lock, the day's write budget, and a
read-only listing for `tensorfold learned`."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from tensorfold.rows.api import StateEntry, StoreRefused
from tensorfold.rows.files import STORE_VERSION, write_json, write_small
from tensorfold.rows.shelf import HEX, Shelf

FORMAT = "FORMAT"
LOCK = "lock"
BUDGET = "budget.json"
IDENTITY = "identity.json"


def is_identity(path: Path) -> bool:
    """An identity directory: named by 32 hex digits (rows/api.py identity_hash)."""
    return len(path.name) == 32 and set(path.name) <= HEX and path.is_dir()


def read_json(path: Path) -> object:
    """A small JSON file's value; None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def take_lock(root: Path) -> int:
    """An exclusive lock on `<root>/lock` holding our pid (one server per root, whatever its identity): the open
    descriptor, or StoreRefused naming the directory and the holder's pid."""
    path = root / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreRefused(f"{root} is in use by another tensorfold server (pid {holder}): give each server its own "
                           f"--learn-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_lock(fd: int) -> None:
    """Let the next server in."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def check_format(root: Path) -> None:
    """Refuse a root another store format wrote, by name; mark a new root with ours."""
    path = root / FORMAT
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        write_small(path, f"{STORE_VERSION}\n".encode())
        return
    if text != str(STORE_VERSION):
        raise StoreRefused(f"{path} names rows store format {text!r}; this tensorfold reads format {STORE_VERSION}: "
                           f"move the directory aside or choose another --learn-dir")


def leftover_parts(root: Path) -> list[Path]:
    """Every `.part` file a crash mid-write may have left under the root."""
    found = list(root.glob("*.part"))
    for folder in (p for p in root.iterdir() if is_identity(p)):
        for pattern in ("*.part", "states/*.part", "blocks/*.part"):
            found += folder.glob(pattern)
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
        if (folder / "states").is_dir() and (folder / "blocks").is_dir():
            shelf.load(None, repair=False)
        found.append((folder.name, facts if isinstance(facts, dict) else {}, list(shelf.states.values())))
    return found
