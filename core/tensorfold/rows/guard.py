"""The rows store's root as the file system holds it, checked before anything is written there: a directory of the
store's own, owned by this user and closed to group and others (its mode guards every file under it, and the store
keeps conversations), and the errors that mean the disk takes no more writes (the store then writes nothing)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from tensorfold.rows.api import StoreRefused

log = logging.getLogger(__name__)

NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
STORE_FILES = frozenset({"FORMAT", "lock", "budget.json"})     # what a store holds at its root besides identities
HEX = frozenset("0123456789abcdef")


def no_room(error: BaseException) -> bool:
    """A write refused because the disk is full (or over quota) or read-only: the store then writes nothing."""
    return isinstance(error, OSError) and error.errno in NO_ROOM


def read_only(path: Path) -> bool:
    """Whether the file system holding `path` is mounted read-only (os.access answers no to writes there, even for
    root, and the store can still be read)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def path_problem(root: Path) -> str | None:
    """Why `root` can never be a store's root, whatever it holds: no path at all (`""` or `.`: the working
    directory), the file system's root, or something that is not a directory."""
    if not root.parts:
        return ("an empty path (or '.') is the working directory: give the store a directory of its own, such as "
                "./learned")
    if root.resolve() == Path(root.resolve().anchor):
        return f"{root} is the file system's root: give the store a directory of its own"
    if root.exists() and not root.is_dir():
        return f"{root} exists and is not a directory"
    return None


def _mode(st: os.stat_result) -> str:
    return f"0{stat.S_IMODE(st.st_mode):03o}"


def _open_to(st: os.stat_result) -> str:
    who = [name for name, bits in (("group", 0o070), ("others", 0o007)) if st.st_mode & bits]
    writable = st.st_mode & 0o022
    return f"{' and '.join(who)} ({'writable' if writable else 'readable'})"


def _foreign(root: Path) -> str | None:
    """The first name under `root` that no rows store makes, or None (the directory holds only a store, or
    nothing)."""
    with os.scandir(root) as found:
        for item in found:
            name = item.name
            ours = name in STORE_FILES or name.endswith(".part") or (len(name) == 32 and set(name) <= HEX)
            if not ours:
                return name
    return None


def guard_root(root: Path, create: bool = True) -> str | None:
    """Make `root` fit to hold the store, or raise StoreRefused naming it and why. Missing, it is made mode 0700
    (when `create`). A root open to group or others is refused when another user owns it or it holds files no
    store makes (it is not the store's own: /tmp, a home); else it is ours and set to 0700, logged. Returns why the
    store must write nothing (a read-only file system kept the mode), else None; other OSErrors propagate."""
    problem = path_problem(root)
    if problem is not None:
        raise StoreRefused(problem)
    if create:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise StoreRefused(f"{root} does not exist: there is no rows store there") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StoreRefused(f"{root} is not a directory")
    if not st.st_mode & 0o077:
        return None
    if st.st_uid != os.geteuid():
        raise StoreRefused(f"{root} is open to {_open_to(st)}, mode {_mode(st)}, and owned by uid {st.st_uid}, not "
                           f"this user (uid {os.geteuid()}): kept conversations must be private; have its owner run "
                           f"`chmod 700 {root}`, or choose a directory of your own")
    foreign = _foreign(root)
    if foreign is not None:
        raise StoreRefused(f"{root} is open to {_open_to(st)}, mode {_mode(st)}, and holds {foreign!r}, which no "
                           f"rows store makes: it is not a directory of the store's own (which the store would set to "
                           f"mode 0700); choose one")
    try:
        os.chmod(root, 0o700)
    except OSError as error:
        if not no_room(error):
            raise
        return f"{root} is mode {_mode(st)}, open to {_open_to(st)}, and could not be set to 0700: {error}"
    log.warning("rows store: %s was mode %s, open to %s: set to 0700 (kept conversations are private)", root,
                _mode(st), _open_to(st))
    return None
