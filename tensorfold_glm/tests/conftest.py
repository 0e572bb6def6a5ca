"""Fixtures every glm family test uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _own_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in its own directory: HF probes optional kernels (`fla`, ...) with importlib, and a folder
    of that name in the working directory would fool it."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny models gain nothing from threads, and on a shared 2-core machine OpenMP threads spinning against
    other processes made this suite ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
