"""fla-core (flash-linear-attention's kernels) imported on first use, for the ops with an fla backend (gated_delta,
kda): fla is optional, so an op's module imports without it and can say why fla cannot run and what to use instead."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple


class FlaFunctions(NamedTuple):
    """What an fla_backend module exposes about fla, each reading fla's module through one loader."""

    available: Callable[[], bool]
    import_error: Callable[[], str | None]
    environment: Callable[[], dict[str, object]]
    require: Callable[[], ModuleType]


class FlaImport:
    """One fla.ops submodule (e.g. "fla.ops.kda"), imported at most once, with the reason when it cannot be."""

    def __init__(self, module: str, *, packages: tuple[str, ...], switches: tuple[str, ...], instead: str) -> None:
        self.module = module            # the fla.ops submodule to import
        self.packages = packages        # optional packages that change fla's dispatch (reported by environment())
        self.switches = switches        # environment variables that do (likewise)
        self.instead = instead          # the backends to name when fla cannot run
        self.error: str | None = None   # why the import failed, once tried
        self._tried = False
        self._ops: ModuleType | None = None

    def load(self) -> ModuleType | None:
        """The module, or None when fla cannot be imported (the reason in `error`); tried once per process."""
        if not self._tried:
            self._tried = True
            self._ops = self._import()
        return self._ops

    def _import(self) -> ModuleType | None:
        if importlib.util.find_spec("fla") is None:
            self.error = "fla-core is not installed"
            return None
        try:
            module = importlib.import_module(self.module)
        except Exception as error:                                                 # noqa: BLE001 (any import failure)
            self.error = f"fla-core is installed but does not import: {error!r} (fla-core also needs einops)"
            return None
        pin_l2norm()
        return module


    def functions(self, ops: Callable[[], ModuleType | None]) -> FlaFunctions:
        """available, import_error, environment and require over `ops` (the backend module's loader, called
        through its name so that stubbing it stubs all four)."""

        def available() -> bool:
            """fla-core is installed and the op's fla module imports."""
            return ops() is not None

        def import_error() -> str | None:
            """Why fla cannot be used, or None when it can."""
            return None if available() else self.error

        def environment() -> dict[str, object]:
            """What decides which of fla's code paths runs: versions, optional packages, and the FLA_* switches."""
            info: dict[str, object] = {"fla": None, "fla_import_error": import_error()}
            if available():
                import fla
                info["fla"] = getattr(fla, "__version__", "?")
            for package in self.packages:
                info[package] = importlib.util.find_spec(package) is not None
            info["env"] = {name: os.environ[name] for name in self.switches if name in os.environ}
            return info

        def require() -> ModuleType:
            """fla's module, or a RuntimeError that says why not and which backend to use instead."""
            module = ops()
            if module is None:
                reason = import_error() or "fla-core is not installed"
                raise RuntimeError(f"{reason}: pip install fla-core einops, or use {self.instead}")
            return module

        return FlaFunctions(available, import_error, environment, require)


# fla's l2norm kernels (the chunked ops' use_qk_l2norm_in_kernel) autotune rows per program and warps per
# NB = cdiv(rows·heads, 65536), and a row's Σx² is reduced in the chosen layout's order: one stream alone and the
# same stream inside a larger batch could get other configs, by timing, and other bits. One config, always.
L2NORM_CONFIG = {"BT": 16, "num_warps": 4}


def pin_l2norm() -> bool:
    """fla's l2norm forward and backward kernels held to L2NORM_CONFIG (nothing autotuned); False when this fla
    has no such kernels."""
    try:
        import triton
        from fla.modules.norm import l2norm
    except ImportError:
        return False
    kernels = [getattr(l2norm, name, None) for name in ("l2norm_fwd_kernel", "l2norm_bwd_kernel")]
    if not all(hasattr(kernel, "configs") for kernel in kernels):
        return False
    for kernel in kernels:
        kernel.configs = [triton.Config({"BT": L2NORM_CONFIG["BT"]}, num_warps=L2NORM_CONFIG["num_warps"])]
    return True
