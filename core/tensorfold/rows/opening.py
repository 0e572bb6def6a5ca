"""What a store's startup does under its root beyond the root's own checks (rows/guard.py): the lock, its identity's
folders (never through a link), leftover `.part` files removed, the other identities' indexes loaded and repaired;
a write the disk has no room for (or a read-only disk refuses) becomes the reason the store writes nothing, and
startup goes on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from tensorfold.rows.api import StoreRefused
from tensorfold.rows.files import real_dir
from tensorfold.rows.guard import no_room
from tensorfold.rows.root import LOCK, is_identity, leftover_parts, take_lock
from tensorfold.rows.shelf import Shelf

log = logging.getLogger(__name__)


def attempt(action: Callable[[], object], what: str) -> str | None:
    """Run one startup write: None when it was made, why the store must write nothing when the disk had no room
    for it (or is read-only); other OSErrors propagate."""
    try:
        action()
    except OSError as error:
        if not no_room(error):
            raise
        return f"{what} could not be written: {error}"
    return None


def lock_root(root: Path) -> tuple[int | None, str | None]:
    """The root's lock (take_lock) and None; or, when a read-only or full disk cannot even make the lock file (so no
    server ever held it), no lock and why the store must write nothing (a store that writes nothing needs none)."""
    try:
        return take_lock(root), None
    except OSError as error:
        if not no_room(error):
            raise
        return None, f"{root / LOCK} could not be made: {error}"


def make_folders(directory: Path) -> str | None:
    """An identity's folder with its states/ and blocks/ (mode 0700): StoreRefused naming one that is a link or not a
    directory; why the store must write nothing when the disk could not make one, else None."""
    for folder in (directory, directory / "states", directory / "blocks"):
        if folder.is_symlink():
            raise StoreRefused(f"{folder} is a symbolic link: the rows store follows none; remove it")
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
        except OSError as error:
            if not no_room(error):
                raise
            return f"{folder} could not be made: {error}"
        if not real_dir(folder):
            raise StoreRefused(f"{folder} is not a directory: remove it")
    return None


def remove_parts(root: Path) -> list[Path]:
    """Remove every `.part` a crash mid-write left under the root; the ones removed (a read-only disk keeps them,
    logged: nothing reads a `.part`)."""
    removed = []
    for path in leftover_parts(root):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as error:
            log.warning("rows store: could not remove %s: %s", path, error)
            continue
        removed.append(path)
    return removed


def other_shelves(root: Path, identity: str) -> list[Shelf]:
    """Every other identity's index under the root (the cap counts them all), each loaded with its failed states
    and its unlisted blocks removed (logged); an identity whose states/ or blocks/ is a link, or cannot be made, is
    left alone."""
    shelves = []
    for folder in sorted(p for p in root.iterdir() if is_identity(p) and p.name != identity):
        subs = [folder / "states", folder / "blocks"]
        try:
            for sub in subs:
                if not sub.is_symlink():
                    sub.mkdir(mode=0o700, exist_ok=True)
        except OSError as error:
            log.warning("rows store: left %s alone: %s", folder, error)
            continue
        if not all(real_dir(sub) for sub in subs):
            log.warning("rows store: left %s alone: its states/ or blocks/ is not a directory (a link is never "
                        "followed)", folder)
            continue
        shelf = Shelf(folder)
        for file, problem in shelf.load(None, repair=True):
            log.warning("rows store: removed %s of another identity: %s", file, problem)
        shelves.append(shelf)
    return shelves
