"""The kit's autouse fixtures, imported here as a family's conftest imports them: they are active in every test."""

from __future__ import annotations

from pathlib import Path

import torch

from tensorfold.testing.fixtures import one_thread, own_cwd  # noqa: F401  (imported fixtures are active)


def test_each_test_runs_in_its_own_directory_on_one_thread(tmp_path: Path) -> None:
    assert Path.cwd() == tmp_path and torch.get_num_threads() == 1
