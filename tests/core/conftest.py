"""Shared fixtures for the core's tests: the template family, loaded through its real entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorfold.family import Family
from tensorfold.plugins import load_families


@pytest.fixture(scope="session")
def example() -> Family:
    """The template family `example`, as `--family example` loads it."""
    return load_families(["example"])["example"]


@pytest.fixture(scope="session")
def tiny_dir(example: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The template family's tiny checkpoint, written once per session."""
    directory = tmp_path_factory.mktemp("tiny-example")
    example.make_tiny(directory, seed=0)
    return directory
