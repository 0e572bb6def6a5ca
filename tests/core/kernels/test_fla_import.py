"""kernels.fla_import: without fla-core the import names why and nothing is pinned (the CPU machines have no
fla-core; with it, tests/core/kernels/test_kda_gpu.py checks the pinned l2norm on the device)."""

from __future__ import annotations

import importlib.util

import pytest

from tensorfold.kernels import fla_import

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla-core is installed")


def test_without_fla_the_import_says_why_and_pins_nothing():
    loader = fla_import.FlaImport("fla.ops.kda", packages=(), switches=(), instead="backend='naive'")
    assert loader.load() is None and loader.error == "fla-core is not installed"
    assert fla_import.pin_l2norm() is False
    require = loader.functions(loader.load).require
    with pytest.raises(RuntimeError, match="fla-core is not installed: pip install fla-core einops, or use "
                                           "backend='naive'"):
        require()
