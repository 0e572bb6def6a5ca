"""A real small file system for the rows store's full- and read-only-disk tests: a tmpfs mounted under a test's
directory (mounting needs root, as the CI sandbox runs; elsewhere the test is skipped, saying why), filled to the
last byte or remounted read-only."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


def _skip(why: str) -> None:
    import pytest

    pytest.skip(f"a real small file system is needed and {why}")


@contextlib.contextmanager
def tmpfs(directory: Path, size: str = "4m", inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of `size` (and at most `inodes` files and folders, when given) mounted at `directory` (made first),
    mode 0700, unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        _skip("mounting one needs root and mount(8)")
    directory.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700" + (f",nr_inodes={inodes}" if inodes is not None else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        _skip(f"mount refused one here: {done.stderr.strip() or done.returncode}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


def fill(directory: Path, name: str = "filler") -> int:
    """Write `directory/name` until the file system has no byte left (ENOSPC at every size down to one byte); the
    bytes it holds."""
    total = 0
    with open(directory / name, "wb", buffering=0) as handle:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 8, 1):
            chunk = b"\0" * size
            while True:
                try:
                    total += handle.write(chunk)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
    return total


def fill_inodes(directory: Path) -> int:
    """Make empty files in `directory` until the file system has no inode left; how many."""
    count = 0
    while True:
        try:
            (directory / f"inode-{count}").touch()
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            return count
        count += 1


def read_only(directory: Path) -> None:
    """Remount the tmpfs at `directory` read-only."""
    subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True, capture_output=True)
