"""The packages the `tensorfold[testing]` extra brings (core/pyproject.toml), imported so that a missing one names
the extra: a family's tests outside this repository get the core's dependencies only."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA = "tensorfold[testing]"


def need(module: str, user: str) -> ModuleType:
    """Import `module` for `user` (a tensorfold.testing module), or fail saying which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{user} needs {module}, which tensorfold does not install by itself: "
                          f"pip install '{EXTRA}'", name=module) from err
