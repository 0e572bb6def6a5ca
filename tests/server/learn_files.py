"""What a --learn-dir holds, read as the server tests check it: its state and block files, and `tensorfold learned`
run on it as a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tensorfold.rows.files import STATE, read_header


def learned(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`tensorfold learned ARGS --learn-dir ROOT` as a real process."""
    return subprocess.run([sys.executable, "-m", "tensorfold", "learned", *args, "--learn-dir", str(root)],
                          capture_output=True, text=True, timeout=60)


def kept(root: Path) -> dict[int, Path]:
    """Every state file under the root, by the rows it covers (its words' `at`)."""
    return {read_header(path, STATE).words["at"]: path for path in root.glob("*/states/*.st")}


def blocks_of(state: Path) -> list[Path]:
    """The block files a state file lists, in order."""
    return [state.parent.parent / "blocks" / f"{name}.blk" for name in read_header(state, STATE).words["blocks"]]


def data_files(root: Path) -> set[Path]:
    """Every state and block file under the root."""
    return {*root.glob("*/states/*.st"), *root.glob("*/blocks/*.blk")}


def data_bytes(root: Path) -> int:
    """Bytes of every state and block file under the root (what --learn-gib counts)."""
    return sum(path.stat().st_size for path in data_files(root))
