"""`python -m tensorfold` from a working directory holding a folder named `tensorfold` (a cache, say): the folder
would shadow the installed package (an empty namespace package, `from tensorfold import __version__` failing), so
the real package is loaded and one line on stderr names the folder. Run as real processes in a temporary folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tensorfold

REAL = Path(tensorfold.__file__).resolve().parent


def make_tiny(cwd: Path) -> subprocess.CompletedProcess:
    """`python -m tensorfold make-tiny` (it reaches `from tensorfold import __version__`) run in `cwd`."""
    return subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", "example", "out"], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("shadow", ["cache folder", "package folder"])
def test_a_folder_named_tensorfold_in_the_working_directory_does_not_shadow_the_package(tmp_path, shadow):
    folder = tmp_path / "tensorfold"
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / "data.bin").write_bytes(b"\0" * 16)
    if shadow == "package folder":
        (folder / "__init__.py").write_text("")
    done = make_tiny(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "wrote out\n"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3"
    assert done.stderr.splitlines()[0] == (
        f"tensorfold: the folder {folder} shadows the installed package for `python -m tensorfold` (the working "
        f"directory comes first on sys.path); using {REAL}. Rename the folder, or run the `tensorfold` command.")


def test_without_a_shadow_nothing_is_said(tmp_path):
    done = make_tiny(tmp_path)
    assert done.returncode == 0 and done.stdout == "wrote out\n"
    assert "shadows" not in done.stderr
