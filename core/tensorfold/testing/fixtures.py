"""Autouse pytest fixtures a family's tests share: import them into the tests' conftest.py to turn them on.

    from tensorfold.testing.fixtures import one_thread, own_cwd  # noqa: F401  (imported fixtures are active)

Only tests import this module: it needs pytest, which `pip install 'tensorfold[testing]'` brings.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from tensorfold.testing.extras import need

pytest = need("pytest", __name__)


@pytest.fixture(autouse=True)
def own_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in its own directory: HF probes optional kernels (`fla`, ...) with importlib, and a folder
    of that name in the working directory would fool it."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared machine with few cores OpenMP threads spinning
    against other processes slow a suite down many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
